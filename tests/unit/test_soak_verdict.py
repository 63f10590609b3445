"""The soak's flatness verdict (tests/stress/soak.py): judged on anonymous RSS and fds, not total RSS."""

from __future__ import annotations

import os

from builders.stage_watch import anonymous_rss, sample_process
from tests.stress.fault_load import Outcome
from tests.stress.soak import verdict

MiB = 2**20


def samples(rss: list[float], anon: list[float]) -> list[dict]:
    rows = [
        {"t_s": 70.0 + 3 * i, "phase": "load",
         "processes": {"engine:decode": {"rss": r * MiB, "anon": a * MiB, "fds": 73, "threads": 50}},
         "store": {"active_leases": 0, "entries": 1}, "unfinished": {"decode": 0.0}}
        for i, (r, a) in enumerate(zip(rss, anon, strict=True))
    ]
    return [*rows, {**rows[-1], "phase": "idle"}]


def judged(rss: list[float], anon: list[float]) -> list[str]:
    outcomes = [Outcome("unique", 0.0, 1.0, "success")]
    return verdict(outcomes, samples(rss, anon), warmup_s=60.0)["not_flat_within_5pct"]


def test_total_rss_falling_with_the_page_cache_is_not_a_finding():
    # File-backed pages dropped under memory pressure: RSS -20%, heap flat.
    assert judged([2000.0] * 10 + [1600.0] * 10, [900.0] * 20) == []


def test_anonymous_rss_that_grows_is_a_finding():
    found = judged([2000.0] * 20, [900.0] * 10 + [1000.0] * 10)
    assert len(found) == 1 and found[0].startswith("engine:decode anon +")


def test_this_process_has_an_anonymous_rss_below_its_rss():
    anon = anonymous_rss(os.getpid())
    sample = sample_process(os.getpid())
    assert anon is not None and sample is not None and 0 < sample["anon"] <= sample["rss"]
    assert anonymous_rss(2**22 + 12345) is None  # no such process

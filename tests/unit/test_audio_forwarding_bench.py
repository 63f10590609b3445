"""bench.audio_forwarding's arithmetic, Triton-free: every clip is new, rounds become the table."""

from __future__ import annotations

import itertools

import pytest

from bench.audio_forwarding import ARMS, ClipPool, Round, clips, summarize, table


def test_every_clip_is_new_and_the_containers_take_turns() -> None:
    made = list(itertools.islice(clips(0.5), 8))
    assert len(set(made)) == 8
    assert [c[:4] for c in made[:4]] != [made[4][:4]] * 4  # not one container
    assert made[3][:4] == b"RIFF" and made[1][:4] == b"fLaC" and made[2][:4] == b"OggS"
    pool = ClipPool(0.5)
    pool.fill(2)
    got = [pool.next() for _ in range(3)]  # the third made as it was asked for
    assert got[:2] == made[:2] and got[2][:4] == b"OggS"  # (Ogg's stream serial is random)


def test_rounds_become_medians_ratios_and_a_table() -> None:
    rounds = [
        Round(arm, 10.0, [latency] * count, 0, media, 400.0)
        for arm, count, latency, media in (
            ("metadata", 80, 0.5, 0.0), ("raw", 60, 0.7, 160_000.0), ("control", 78, 0.52, 0.0),
            ("metadata", 84, 0.48, 0.0), ("raw", 62, 0.68, 160_000.0), ("control", 82, 0.5, 0.0),
        )
    ]  # fmt: skip
    arms = summarize(rounds)
    assert list(arms) == list(ARMS)
    assert arms["metadata"]["requests_per_s"] == pytest.approx(8.2) and arms["raw"]["requests_per_s"] == 6.1
    assert arms["raw"]["throughput_vs_metadata"] == pytest.approx(6.1 / 8.2)
    assert arms["raw"]["latency_vs_metadata"] == pytest.approx(0.69 / 0.49)
    assert arms["raw"]["prefill_media_bytes_per_request"] == 160_000 and arms["metadata"]["requests"] == 164
    rendered = table(arms)
    assert "| raw | 6.10 | 0.744 | 0.690 | 1.408 | 122 | 0 | 160000 / 400 |" in rendered

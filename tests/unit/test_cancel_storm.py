"""tests.stress.cancel_storm's tally: unclean stops per (model, load), and its table."""

from __future__ import annotations

import argparse

from tests.stress.cancel_storm import markdown, summarize


def row(model: str, load: str, clean: bool, early: int = 3, mid: int = 5, complete: int = 2) -> dict:
    return {
        "model": model, "load": load, "requests": early + mid + complete, "cancel_early": early,
        "cancel_mid": mid, "complete": complete, "error": 0, "clean_stop": clean, "exit_timeout": not clean,
        "held_by_triton": not clean, "tritonserver_segfault": False,
    }  # fmt: skip


def test_unclean_stops_are_counted_per_model_and_load() -> None:
    rows = [row("ticker", "cancel", False), row("ticker", "cancel", True), row("canonical", "complete", True, 0, 0, 9)]
    table = summarize(rows)
    assert table == [
        {"model": "ticker", "load": "cancel", "rounds": 2, "requests": 20, "cancelled": 16, "errors": 0,
         "unclean_stops": 1, "exit_timeouts": 1, "held_by_triton": 1, "tritonserver_segfaults": 0},
        {"model": "canonical", "load": "complete", "rounds": 1, "requests": 9, "cancelled": 0, "errors": 0,
         "unclean_stops": 0, "exit_timeouts": 0, "held_by_triton": 0, "tritonserver_segfaults": 0},
    ]  # fmt: skip
    args = argparse.Namespace(rounds=2, seconds=40.0, clients=8, exit_timeout_s=15)
    machine = {"cpu": "cpu", "cores_usable": 2, "memory_gib": 24, "gpu": "none", "os": "linux", "glibc": "2.36",
               "python": "3.11"}  # fmt: skip
    text = markdown(table, args, machine)
    assert "| ticker | cancel | 2 | 20 | 16 | 0 | 1 of 2 | 1 | 1 | 0 |" in text
    assert "| canonical | complete | 1 | 9 | 0 | 0 | 0 of 1 | 0 | 0 | 0 |" in text

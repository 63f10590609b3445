"""bench.path_choice: adaptive's majority path against the faster forced path, ties by the control."""

from __future__ import annotations

from typing import Any

import pytest

from bench.path_choice import adaptive_choices, choice_lines
from bench.sweep import ModeSpec

MODES = [ModeSpec.parse(m) for m in ("llm", "llm:again", "epd:colocated", "epd:disaggregated", "epd")]


def _point(mode: str, load: str, rate: float, paths: dict[str, int] | None = None) -> dict[str, Any]:
    return {
        "mode": mode,
        "load_label": load,
        "status": "ran",
        "summary": {"request_throughput": rate, "serving_paths": paths},
    }


def _points(load: str, control: float, colocated: float, disaggregated: float, paths: dict[str, int]) -> list:
    return [
        _point("llm", load, 10.0),
        _point("llm:again", load, control),
        _point("epd:colocated", load, colocated),
        _point("epd:disaggregated", load, disaggregated),
        _point("epd", load, colocated, paths),
    ]


def test_the_majority_path_is_compared_with_the_faster_forced_path() -> None:
    points = (
        _points("c=1", 10.2, colocated=8.0, disaggregated=5.0, paths={"colocated": 15, "disaggregated": 1})
        + _points("c=4", 10.0, colocated=8.0, disaggregated=5.0, paths={"colocated": 2, "disaggregated": 14})
        # 3% apart: a tie, as the control's spread in this run is 5% (at c=8; 2% at c=1, 0% at c=4).
        + _points("c=8", 10.5, colocated=8.0, disaggregated=8.24, paths={"colocated": 16})
    )
    rows = {row["load_label"]: row for row in adaptive_choices(points, MODES)}
    assert rows["c=1"]["winner"] == "colocated" and rows["c=1"]["picked"] and not rows["c=1"]["tie"]
    assert rows["c=1"]["adaptive_shares"] == {"colocated": 15 / 16, "disaggregated": 1 / 16}
    assert rows["c=4"]["adaptive_choice"] == "disaggregated" and not rows["c=4"]["picked"]
    assert rows["c=8"]["winner"] == "disaggregated" and rows["c=8"]["tie"] and rows["c=8"]["picked"]
    assert rows["c=4"]["control_spread"] == pytest.approx(0.05)
    text = "\n".join(choice_lines(list(rows.values())))
    assert "the measured winner at 2 of 3 points" in text and "Without ties: 1 of 3" in text
    assert "| 3.0% / 5.0% |" in text


def test_no_row_without_both_forced_paths_or_without_adaptive() -> None:
    points = _points("c=1", 10.0, 8.0, 5.0, {"colocated": 4})
    assert adaptive_choices(points, [m for m in MODES if m.label != "epd:disaggregated"]) == []
    assert adaptive_choices(points, [m for m in MODES if m.label != "epd"]) == []
    assert choice_lines([]) == []

"""Diff two results files: same (mode, load point), metric by metric, with ratios.

``python -m bench compare OLD NEW`` (files or folders holding summary.json)
prints a markdown table of NEW/OLD ratios and marks changes beyond ``--threshold`` in
the bad direction (higher latency, lower throughput) as regressions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# (metric, statistic or None, True when higher is better)
COMPARED = (
    ("request_throughput", None, True),
    ("output_token_throughput", None, True),
    ("goodput", None, True),
    ("ttft_ms", "p50", False),
    ("ttft_ms", "p90", False),
    ("ttft_ms", "p99", False),
    ("tpot_ms", "p50", False),
    ("itl_ms", "p50", False),
    ("e2e_ms", "p50", False),
    ("e2e_ms", "p90", False),
    ("e2e_ms", "p99", False),
)


@dataclass(frozen=True)
class Change:
    mode: str
    load: str
    metric: str
    old: float
    new: float
    higher_is_better: bool

    @property
    def ratio(self) -> float:
        return self.new / self.old if self.old else float("inf")

    def is_regression(self, threshold: float) -> bool:
        if self.higher_is_better:
            return self.ratio < 1.0 - threshold
        return self.ratio > 1.0 + threshold


def load_summary(path: Path) -> dict[str, Any]:
    file = path / "summary.json" if path.is_dir() else path
    return json.loads(file.read_text())


def _points(summary: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(p["mode"], p["load_label"]): p["summary"] for p in summary["points"] if p.get("status") == "ran"}


def _value(summary: dict[str, Any], metric: str, stat: str | None) -> float | None:
    value = summary.get(metric)
    return value.get(stat) if stat and isinstance(value, dict) else value


def diff(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[Change], list[str], list[str]]:
    """Changes for points in both, and the point names only in old / only in new."""
    old_points, new_points = _points(old), _points(new)
    changes = []
    for key in sorted(old_points.keys() & new_points.keys()):
        for metric, stat, higher_is_better in COMPARED:
            a, b = _value(old_points[key], metric, stat), _value(new_points[key], metric, stat)
            if a is None or b is None:
                continue
            name = f"{metric} {stat}" if stat else metric
            changes.append(Change(key[0], key[1], name, a, b, higher_is_better))
    only_old = [" ".join(k) for k in sorted(old_points.keys() - new_points.keys())]
    only_new = [" ".join(k) for k in sorted(new_points.keys() - old_points.keys())]
    return changes, only_old, only_new


def render(
    changes: list[Change], only_old: list[str], only_new: list[str], threshold: float, names: tuple[str, str]
) -> str:
    lines = [
        f"# {names[1]} vs {names[0]}",
        "",
        f"Regression: more than {threshold:.0%} worse (higher latency or lower throughput).",
        "",
        "| mode | load | metric | old | new | new/old | |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for c in changes:
        flag = "REGRESSION" if c.is_regression(threshold) else ""
        lines.append(f"| {c.mode} | {c.load} | {c.metric} | {c.old:,.2f} | {c.new:,.2f} | {c.ratio:.2f} | {flag} |")
    if only_old:
        lines += ["", "Only in old: " + ", ".join(only_old)]
    if only_new:
        lines += ["", "Only in new: " + ", ".join(only_new)]
    regressions = sum(c.is_regression(threshold) for c in changes)
    lines += ["", f"{regressions} regression(s) in {len(changes)} compared values."]
    return "\n".join(lines) + "\n"

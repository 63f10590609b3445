"""Did ``adaptive`` take the path that measured faster? (issue 33: it should at >= 90% of points)

At each load point where ``epd`` (adaptive) ran beside its forced paths (``epd:colocated``,
``epd:disaggregated``) on the same media policy, the winner is the forced path with the higher
req/s, and adaptive's choice is the path that served most of its requests (``serving_paths`` of
its point). Where the two paths are closer than the control's spread, either one is a winner:
the run cannot tell them apart. The spread is the run's, the largest gap between ``llm:again``
and ``llm`` over its points: one point's control is a single sample of the noise (0.4% at one
point of a run whose others reach 4%).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # bench.sweep puts the rows in its summary
    from bench.sweep import ModeSpec

FORCED_PATHS = ("colocated", "disaggregated")


def _throughputs(points: Iterable[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(p["mode"], p["load_label"]): p["summary"] for p in points if p.get("status") == "ran"}


def control_spread(ran: dict[tuple[str, str], dict[str, Any]], baseline: str) -> float | None:
    """The largest relative req/s gap between the control and the baseline over the run's points."""
    gaps = [
        abs(again["request_throughput"] / base["request_throughput"] - 1.0)
        for (label, load), base in ran.items()
        if label == baseline and base["request_throughput"] and (again := ran.get((f"{baseline}:again", load)))
    ]
    return max(gaps, default=None)


def adaptive_choices(
    points: list[dict[str, Any]], specs: Sequence[ModeSpec], baseline: str = "llm"
) -> list[dict[str, Any]]:
    """One row per load point where adaptive and both forced paths ran (see the module docstring)."""
    ran = _throughputs(points)
    spread = control_spread(ran, baseline)
    rows = []
    for adaptive in specs:
        if adaptive.model != "epd" or adaptive.path not in (None, "adaptive") or adaptive.again:
            continue
        forced = {
            spec.path: spec.label
            for spec in specs
            if spec.model == "epd" and spec.path in FORCED_PATHS and spec.media == adaptive.media and not spec.again
        }
        if len(forced) < len(FORCED_PATHS):
            continue
        for (label, load), summary in ran.items():
            if label != adaptive.label or any((forced[path], load) not in ran for path in FORCED_PATHS):
                continue
            rates = {path: ran[(forced[path], load)]["request_throughput"] for path in FORCED_PATHS}
            winner = max(rates, key=lambda path: rates[path])
            served = summary.get("serving_paths") or {}
            total = sum(served.values())
            chosen = max(served, key=lambda path: served[path]) if total else None
            loser = min(rates.values())
            gap = rates[winner] / loser - 1.0 if loser > 0 else None
            tie = spread is not None and gap is not None and gap <= spread
            rows.append(
                {
                    "mode": label,
                    "load_label": load,
                    "path_request_throughput": rates,
                    "gap": gap,
                    "winner": winner,
                    "adaptive_shares": {path: count / total for path, count in served.items()} if total else {},
                    "adaptive_choice": chosen,
                    "adaptive_vs_winner": summary["request_throughput"] / rates[winner] if rates[winner] else None,
                    "control_spread": spread,
                    "tie": tie,
                    "picked": chosen == winner or (tie and chosen in rates),
                }
            )
    return rows


def _percent(share: float | None) -> str:
    return "not measured" if share is None else f"{share:.1%}"


def choice_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The report's section (empty without rows)."""
    if not rows:
        return []
    picked = sum(row["picked"] for row in rows)
    lines = [
        "",
        f"## Adaptive's path choices: the measured winner at {picked} of {len(rows)} points",
        "",
        "Winner: the forced path with more req/s; a tie when the gap between the two is within the control's "
        "spread (the largest gap between `llm:again` and `llm` in the run). Without ties: "
        f"{sum(row['adaptive_choice'] == row['winner'] for row in rows)} of {len(rows)}.",
        "",
        "| mode | load | colocated req/s | disaggregated req/s | gap / control's spread | winner | adaptive's paths "
        "| adaptive / winner req/s | picked |",
        "|---|---|---:|---:|---:|---|---|---:|---|",
    ]
    for row in rows:
        rates = row["path_request_throughput"]
        shares = ", ".join(f"{path} {share:.0%}" for path, share in sorted(row["adaptive_shares"].items()))
        winner = row["winner"] + (" (tie)" if row["tie"] else "")
        ratio = "-" if row["adaptive_vs_winner"] is None else f"{row['adaptive_vs_winner']:.2f}"
        lines.append(
            f"| {row['mode']} | {row['load_label']} | {rates['colocated']:.2f} | {rates['disaggregated']:.2f} | "
            f"{_percent(row['gap'])} / {_percent(row['control_spread'])} | {winner} | {shares or '-'} | {ratio} | "
            f"{'yes' if row['picked'] else 'no'} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.path_choice SUMMARY.json...``: the section again, from saved summaries
    (runs made before the summary carried it, or several runs counted together)."""
    import argparse
    import json
    from pathlib import Path

    from bench.sweep import ModeSpec

    parser = argparse.ArgumentParser(prog="python -m bench.path_choice", description=main.__doc__)
    parser.add_argument("summaries", nargs="+", type=Path, help="summary.json of `python -m bench run`")
    rows = []
    for path in parser.parse_args(argv).summaries:
        summary = json.loads(path.read_text())
        specs = [ModeSpec.parse(label) for label in summary["config"]["modes"]]
        rows += [{**row, "mode": f"{path.parent.name}: {row['mode']}"} for row in
                 adaptive_choices(summary["points"], specs, summary["config"]["baseline"])]  # fmt: skip
    print("\n".join(choice_lines(rows)) if rows else "no point with epd, epd:colocated and epd:disaggregated")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Issue 14's acceptance table from one ``bench run`` of epd's paths against ``llm``.

Reads the run's ``summary.json`` (modes ``llm:<media>``, ``epd:adaptive:<media>``,
``epd:disaggregated:<media>``, ``epd:colocated:<media>`` for media ``unique``, ``repeated``
(pool of images, prompts differ) and ``identical`` (identical requests), at each load point)
and writes ``acceptance.json``, ``acceptance.md`` and ``acceptance.png`` beside it:

- adaptive e2e p50 / llm e2e p50 (goal <= 1.05 with unique images);
- adaptive TTFT p50 / llm TTFT p50 (goal <= 1.0 with repeated images, both kinds);
- adaptive vs the better of the two fixed policies (llm, epd disaggregated) on e2e p50 and
  TTFT p50 (goal <= 1.05), and vs epd's own colocated path;
- which paths adaptive took (the ``serving_path`` output) and the greedy-token agreement;
- with ``llm:<media>:again`` in the run (``llm`` once more, on requests of its own), the same
  goals for that control in adaptive's place: how often ``llm`` measured against itself meets
  them, the bar a miss of adaptive's is read against on a noisy machine.

``python -m bench.path_acceptance RUN_DIR``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

MEDIA = ("unique", "repeated", "identical")
MEDIA_TEXT = {
    "unique": "unique images",
    "repeated": "pool of 4 images, prompts differ",
    "identical": "identical requests",
}
FIXED = ("llm", "epd:disaggregated")
CONTROL = "again"  # bench.sweep.AGAIN: ``llm:<media>:again``
LIMIT_VS_LLM_UNIQUE_E2E = 1.05
LIMIT_VS_LLM_REPEATED_TTFT = 1.0
LIMIT_VS_BEST_FIXED = 1.05


def _label(mode: str, media: str) -> str:
    return f"{mode}:{media}"


def _p50(point: dict[str, Any] | None, metric: str) -> float | None:
    if point is None:
        return None
    value = point["summary"].get(metric, {})
    return value.get("p50") if isinstance(value, dict) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _rep_p50s(point: dict[str, Any] | None, metric: str) -> list[float | None]:
    return [] if point is None else [rep.get(metric, {}).get("p50") for rep in point.get("reps", [])]


def round_ratios(adaptive: dict[str, Any], others: list[dict[str, Any] | None], metric: str) -> list[float]:
    """Per round (``bench run --interleave``: repetition r of every mode ran in round r, seconds
    apart), adaptive's p50 over the best of ``others``' p50s in that round: how the ratio moves
    from round to round on this machine, beside the run's ratio of medians."""
    columns = [_rep_p50s(adaptive, metric)] + [_rep_p50s(o, metric) for o in others]
    ratios = []
    for a, *rest in zip(*columns, strict=False):
        known = [v for v in rest if v is not None]
        if (ratio := _ratio(a, min(known) if known else None)) is not None:
            ratios.append(ratio)
    return ratios


def token_agreement(raw: list[dict[str, Any]]) -> dict[str, float | None]:
    """``"<mode> <load>"`` -> share of its requests with ``llm:<media>``'s greedy tokens for the
    same request (same key, same images: unique images only for ``epd:adaptive``, see
    ``ModeSpec.media_namespace``)."""
    base = {(r["mode"], r["load_label"], r["key"]): r["output_token_ids"] for r in raw if r.get("error") is None}
    pairs: dict[str, list[bool]] = {}
    for r in raw:
        mode = r["mode"]
        media = mode.rsplit(":", 1)[-1]
        if not mode.startswith("epd:") or r.get("error") is not None:
            continue
        if media == "unique" and not mode.startswith("epd:adaptive"):
            continue  # its own images: llm never saw them
        other = base.get((f"llm:{media}", r["load_label"], r["key"]))
        if other is not None:
            pairs.setdefault(f"{mode} {r['load_label']}", []).append(other == r["output_token_ids"])
    return {name: sum(same) / len(same) for name, same in pairs.items()}


def acceptance_rows(summary: dict[str, Any], agreement: dict[str, float | None]) -> list[dict[str, Any]]:
    points = {(p["mode"], p["load_label"]): p for p in summary["points"] if p.get("status") == "ran"}
    loads = list(dict.fromkeys(p["load_label"] for p in summary["points"] if p.get("status") == "ran"))
    rows = []
    for media in MEDIA:
        for load in loads:
            get = {mode: points.get((_label(mode, media), load)) for mode in (*FIXED, "epd:adaptive", "epd:colocated")}
            adaptive = get["epd:adaptive"]
            control = points.get((f"{_label('llm', media)}:{CONTROL}", load))
            if adaptive is None or get["llm"] is None:
                continue
            row: dict[str, Any] = {"media": media, "load": load}
            for metric in ("e2e_ms", "ttft_ms"):
                values = {mode: _p50(point, metric) for mode, point in get.items()}
                row[metric] = values
                row[f"{metric}_adaptive_vs_llm"] = _ratio(values["epd:adaptive"], values["llm"])
                fixed = [v for mode, v in values.items() if mode in FIXED and v is not None]
                row[f"{metric}_adaptive_vs_best_fixed"] = _ratio(values["epd:adaptive"], min(fixed) if fixed else None)
                row[f"{metric}_adaptive_vs_colocated"] = _ratio(values["epd:adaptive"], values["epd:colocated"])
                row[f"{metric}_control_vs_llm"] = _ratio(_p50(control, metric), values["llm"])
            row["adaptive_paths"] = adaptive["summary"].get("serving_paths")
            row["errors"] = {mode: (p["summary"]["errors"] if p else None) for mode, p in get.items()}
            row["token_agreement_vs_llm"] = {
                mode: agreement.get(f"{_label(mode, media)} {load}") for mode in get if mode != "llm"
            }
            # goal -> (metric, limit, the modes adaptive is set against: the better of them)
            goals = {"adaptive_vs_best_fixed_e2e": ("e2e_ms", LIMIT_VS_BEST_FIXED, FIXED)}
            if media == "unique":
                goals["adaptive_vs_llm_e2e"] = ("e2e_ms", LIMIT_VS_LLM_UNIQUE_E2E, ("llm",))
            else:
                goals["adaptive_vs_llm_ttft"] = ("ttft_ms", LIMIT_VS_LLM_REPEATED_TTFT, ("llm",))
            row["goals"] = {}
            for name, (metric, limit, modes) in goals.items():
                against = [get[m] for m in modes]
                goal = _goal_of(adaptive, against, metric, limit)
                if control is not None:  # the same test with llm measured again in adaptive's place
                    goal["control"] = _goal_of(control, against, metric, limit)
                row["goals"][name] = goal
            rows.append(row)
    return rows


def _goal_of(point: dict[str, Any], against: list[dict[str, Any] | None], metric: str, limit: float) -> dict[str, Any]:
    """``point``'s p50 over the best p50 of ``against``, for the run and per round, held to ``limit``."""
    best = min((v for v in (_p50(p, metric) for p in against) if v is not None), default=None)
    return _goal(_ratio(_p50(point, metric), best), limit, round_ratios(point, against, metric))


def _goal(value: float | None, limit: float, rounds: list[float]) -> dict[str, Any]:
    met = value is not None and value <= limit
    return {"value": value, "limit": limit, "met": met, "rounds": rounds, "rounds_met": sum(r <= limit for r in rounds)}


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _verdict(goal: dict[str, Any]) -> str:
    text = f"{'yes' if goal['met'] else 'NO'} ({_f(goal['value'])}"
    rounds = goal.get("rounds") or []
    if len(rounds) > 1:
        text += f"; rounds {min(rounds):.2f}-{max(rounds):.2f}, {goal['rounds_met']} of {len(rounds)} met"
    return text + ")"


def markdown(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    meta = summary.get("meta", {})
    lines = [
        "# epd serving paths vs llm (issue 14), one run",
        "",
        f"- Command: `{meta.get('command', '?')}`",
        f"- Load average at start {meta.get('machine', {}).get('load_average_1_5_15')}, at end "
        f"{meta.get('load_average_end')}: a shared 2-core machine; ratios within this one run are what count.",
        "- p50 latencies in ms; ratios are adaptive over the other; `best fixed` = the better of `llm` and epd "
        "`disaggregated` at that point. Goals: unique images e2e vs llm <= 1.05; repeated images TTFT vs llm "
        "<= 1.0; vs best fixed <= 1.05. Each goal's `rounds`: the same ratio per interleaved round (repetition r of "
        "every mode), its range and how many rounds met the goal: the spread a single point's ratio has here. "
        "`control`: the same goals, in the same order, with `llm` measured again (`llm:<media>:again`) in "
        "adaptive's place: what the baseline against itself gives on this machine in this run.",
        "",
        "| media | load | e2e llm / adaptive / disagg / colocated | e2e adaptive/llm | e2e adaptive/best fixed | "
        "TTFT llm / adaptive / disagg / colocated | TTFT adaptive/llm | TTFT adaptive/best fixed | adaptive paths | "
        "goals met | control | greedy tokens = llm's |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|---|",
    ]
    for row in rows:
        e2e, ttft = row["e2e_ms"], row["ttft_ms"]
        order = ("llm", "epd:adaptive", "epd:disaggregated", "epd:colocated")
        met = ", ".join(f"{name} {_verdict(g)}" for name, g in row["goals"].items())
        control = ", ".join(f"{_verdict(g['control'])}" for g in row["goals"].values() if "control" in g)
        same = ", ".join(f"{m[4:]} {_f(v)}" for m, v in row["token_agreement_vs_llm"].items() if v is not None)
        lines.append(
            f"| {MEDIA_TEXT[row['media']]} | {row['load']} | {' / '.join(_f(e2e[m], 0) for m in order)} | "
            f"{_f(row['e2e_ms_adaptive_vs_llm'])} | {_f(row['e2e_ms_adaptive_vs_best_fixed'])} | "
            f"{' / '.join(_f(ttft[m], 0) for m in order)} | {_f(row['ttft_ms_adaptive_vs_llm'])} | "
            f"{_f(row['ttft_ms_adaptive_vs_best_fixed'])} | {row['adaptive_paths']} | {met} | {control or '-'} | "
            f"{same or '-'} |"
        )
    goals = [g for r in rows for g in r["goals"].values()]
    lines += ["", f"Goals met: {sum(g['met'] for g in goals)} of {len(goals)}."]
    controls = [g["control"] for g in goals if "control" in g]
    if controls:
        lines.append(
            f"The control (`llm` measured again in the same rounds, on requests of its own, in adaptive's place) met "
            f"{sum(g['met'] for g in controls)} of the same {len(controls)} tests."
        )
    lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, metric in zip(axes, ("e2e_ms", "ttft_ms"), strict=True):
        for media in MEDIA:
            media_rows = [r for r in rows if r["media"] == media]
            loads = [r["load"] for r in media_rows]
            line = ax.plot(loads, [r[f"{metric}_adaptive_vs_llm"] for r in media_rows], marker="o",
                           label=MEDIA_TEXT[media])[0]
            control = [r.get(f"{metric}_control_vs_llm") for r in media_rows]
            if any(v is not None for v in control):
                ax.plot(loads, [float("nan") if v is None else v for v in control], marker="x", linestyle=":",
                        color=line.get_color(), label=f"{MEDIA_TEXT[media]}: control, llm again / llm")
        ax.axhline(1.05 if metric == "e2e_ms" else 1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"{metric[:-3].upper()} p50: epd adaptive / llm")
        ax.set_xlabel("load")
    axes[0].set_ylabel("ratio (lower is better)")
    axes[0].legend()
    fig.tight_layout()
    path = out / "acceptance.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a bench run's output folder (its summary.json)")
    args = parser.parse_args(argv)
    summary = json.loads((args.run_dir / "summary.json").read_text())
    raw = json.loads((args.run_dir / "raw.json").read_text())["records"]
    rows = acceptance_rows(summary, token_agreement(raw))
    if not rows:
        print("no epd:adaptive:<media> point with its llm:<media> point in this run", file=sys.stderr)
        return 1
    (args.run_dir / "acceptance.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.run_dir / "acceptance.md").write_text(markdown(rows, summary))
    plot(rows, args.run_dir)
    print((args.run_dir / "acceptance.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

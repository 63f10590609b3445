"""Fit a profile's stage costs on some measured bench points, then check it predicts the others.

``python -m bench.advisor.fit --measured SUMMARY.json --train 1 2 --profile cpu-2core --out-profile P``
reads a ``python -m bench run`` summary (modes llm, llm:repeated, epd, epd:repeated,
epd:colocated[:repeated], or the path benchmark's names for them, ``MODE_ALIASES``; with a
per-role profile, llm, epd:colocated and epd:disaggregated, ``PER_ROLE_SETUPS``), or several
(fitted together, each named by its folder), fits the profile's free parameters on the training
points (a deterministic pattern search in log space over e2e p50, req/s, TTFT p50 and, for epd,
the encode/prefill/decode stage means), and writes the validity report: predicted vs measured
e2e p50 and req/s on every point and the winner per concurrency, as JSON, markdown and a plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.advisor.profiles import Profile, load_profile, save_profile
from bench.advisor.simulator import Workload, simulate

# How each measured bench mode maps onto a simulated layout and hit ratio.
MODE_SETUPS: dict[str, tuple[str, float]] = {
    "llm": ("colocated", 0.0),
    "llm:repeated": ("colocated", 1.0),
    "epd": ("1E+1P+1D", 0.0),
    "epd:repeated": ("1E+1P+1D", 1.0),
    # epd forced onto its colocated path: one engine in the model's process, as llm's.
    "epd:colocated": ("colocated", 0.0),
    "epd:colocated:repeated": ("colocated", 1.0),
}
# The same modes as the serving-path benchmark names them (``MODEL[:PATH][:MEDIA]``,
# docs/benchmarks/serving-paths.md): llm with unique images is plain ``llm``; epd forced onto its
# disaggregated path is the ``epd`` above.
MODE_ALIASES: dict[str, str] = {
    "llm:unique": "llm",
    "epd:disaggregated:unique": "epd",
    "epd:disaggregated:repeated": "epd:repeated",
    "epd:colocated:unique": "epd:colocated",
}
# A profile with CPU sets (``Profile.cpu_sets``) models the deployment of docs/benchmarks/epd-pays.md:
# llm floating over both cores, E|PD (epd's own engine fed by the encoders, ``--colocated-encodes
# encoders``) and E|P|D; each point's hit ratio is its mode's reuse ratio in the summary.
PER_ROLE_SETUPS: dict[str, str] = {"llm": "colocated", "epd:colocated": "1E+1PD", "epd:disaggregated": "1E+1P+1D"}
TOLERANCE = 0.20  # the acceptance (docs/benchmarks/advisor.md): predictions within +-20%
METRICS = {"e2e": "e2e_error", "throughput": "throughput_error"}

# The parameters the fit moves, with bounds; the rest of the profile stays as given.
FIT_PARAMETERS: tuple[tuple[str, float, float], ...] = (
    ("colocated_engine.step_base_ms", 0.2, 30.0),
    ("colocated_engine.prefill_ms_per_token", 0.001, 1.0),
    ("colocated_engine.decode_ms_per_seq", 0.01, 20.0),
    ("colocated_engine.vit_ms_per_patch", 0.001, 0.2),
    ("colocated_frontend.media_ms_per_patch", 0.001, 0.2),
    ("colocated_frontend.relay_ms_per_token", 0.01, 20.0),
    ("encoder.ms_per_patch", 0.005, 0.5),
    ("prefill_engine.prefill_ms_per_token", 0.001, 1.0),
    ("decode_engine.step_base_ms", 0.2, 30.0),
    ("decode_engine.decode_ms_per_seq", 0.01, 20.0),
    ("decode_engine.prefill_ms_per_token", 0.0005, 1.0),
    ("disaggregated_frontend.relay_ms_per_token", 0.01, 20.0),
    ("disaggregated_frontend.request_ms", 0.1, 50.0),
    ("colocated_frontend.relay_ms_per_step", 0.01, 20.0),
    ("disaggregated_frontend.relay_ms_per_step", 0.01, 20.0),
    ("colocated_engine.spin_ms_per_step", 0.01, 50.0),
    ("prefill_engine.spin_ms_per_step", 0.01, 50.0),
    ("decode_engine.spin_ms_per_step", 0.01, 50.0),
    ("encoder.spin_ms", 0.1, 500.0),
    ("encoder.base_ms", 0.5, 50.0),
    ("encoder.call_ms", 0.5, 100.0),  # starts at 0 (not fitted) unless a profile sets it
    ("colocated_frontend.hit_ms", 0.1, 50.0),  # llm: what a repeated image still costs (vLLM's caches)
    ("colocated_engine.vit_hit_share", 0.01, 1.0),  # starts at 0 (not fitted) unless a profile sets it
    ("disaggregated_frontend.hit_ms", 0.1, 50.0),
)


@dataclass(frozen=True)
class MeasuredPoint:
    mode: str
    concurrency: int
    e2e_p50_ms: float
    ttft_p50_ms: float
    stages_ms: dict[str, float]
    input_tokens: float
    output_tokens: int
    image_size: tuple[int, int]
    images_per_request: int
    other_cpu_share: float | None
    cpu_ms_per_request: float | None = None  # the server's process-tree CPU per request (/proc)
    request_throughput: float | None = None
    workload: str = ""  # the run's name (its folder), when several runs are fitted together
    image_sizes: tuple[tuple[int, int], ...] = ()  # mixed sizes, each image drawn from them
    hit_ratio: float = 0.0  # the mode's reuse ratio in the run (per-role profiles use it)

    @property
    def key(self) -> str:
        return f"{self.workload}:{self.mode}@{self.concurrency}" if self.workload else f"{self.mode}@{self.concurrency}"


def in_training(point: MeasuredPoint | dict[str, Any], train: Sequence[str]) -> bool:
    """``train`` entries: ``C`` (every mode at concurrency C), ``MODE@C`` (one mode), ``WORKLOAD@C``
    (every mode of one run) or ``WORKLOAD:MODE@C`` (one point)."""
    if isinstance(point, MeasuredPoint):
        mode, c, workload = point.mode, point.concurrency, point.workload
    else:
        mode, c, workload = point["mode"], point["concurrency"], point.get("workload", "")
    return bool({str(c), f"{mode}@{c}", f"{workload}@{c}", f"{workload}:{mode}@{c}"} & set(train))


def _size(text: str) -> tuple[int, int]:
    width, height = (int(v) for v in text.split("x"))
    return width, height


def load_points(
    summary_path: Path, modes: Iterable[str] = MODE_SETUPS, workload_name: str = ""
) -> list[MeasuredPoint]:
    """The closed-loop points of a bench summary for the modes the simulator knows."""
    summary = json.loads(summary_path.read_text())
    workload = summary["config"]["workload"]
    sizes = tuple(_size(text) for text in workload["image_sizes"])
    reuse = {mode["label"]: mode.get("reuse_ratio") or 0.0 for mode in summary["modes"]}
    wanted = list(modes)
    points = []
    for point in summary["points"]:
        mode = MODE_ALIASES.get(point["mode"], point["mode"])
        if point.get("status") != "ran" or point["load_kind"] != "concurrency" or mode not in wanted:
            continue
        s = point["summary"]
        stages = {k: v for k, v in ((point.get("stages") or {}).get("ms") or {}).items() if k in MODE_STAGES}
        if mode == "epd:colocated" and "encode" in stages and "prefill" in stages:
            # epd's colocated path times its first token from the request's start, its encode
            # included (python_backends/epd/colocated.py); the simulator's prefill starts after it.
            stages["prefill"] = max(stages["prefill"] - stages["encode"], 0.0)
        points.append(
            MeasuredPoint(
                mode=mode,
                concurrency=int(point["load"]),
                e2e_p50_ms=s["e2e_ms"]["p50"],
                ttft_p50_ms=s["ttft_ms"]["p50"],
                stages_ms=stages,
                input_tokens=s["mean_input_tokens"],
                output_tokens=round(s["mean_output_tokens"]),
                image_size=sizes[0],
                images_per_request=int(workload["images_per_request"]),
                other_cpu_share=(s.get("cpu") or {}).get("other_processes_cpu_share"),
                cpu_ms_per_request=(s.get("cpu") or {}).get("server_cpu_ms_per_request"),
                request_throughput=s["request_throughput"],
                workload=workload_name,
                image_sizes=sizes if len(sizes) > 1 else (),
                hit_ratio=reuse.get(point["mode"], 0.0),
            )
        )
    return sorted(points, key=lambda p: (wanted.index(p.mode), p.concurrency))


def slim_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """A bench summary cut to what :func:`load_points` reads (a run's summary is ~0.3 MB, this a
    few KB): how committed measurements are kept (tests/data/advisor/)."""
    point_keys = ("mode", "status", "load_kind", "load", "load_label")
    kept = ("e2e_ms", "ttft_ms", "mean_input_tokens", "mean_output_tokens", "request_throughput")
    cpu_kept = ("other_processes_cpu_share", "server_cpu_ms_per_request")
    points = []
    for point in summary["points"]:
        s = point.get("summary") or {}
        slim = {key: point[key] for key in point_keys if key in point}
        slim["summary"] = {key: s[key] for key in kept if key in s}
        slim["summary"]["cpu"] = {key: (s.get("cpu") or {}).get(key) for key in cpu_kept}
        slim["stages"] = {"ms": (point.get("stages") or {}).get("ms") or {}}
        points.append(slim)
    workload = summary["config"]["workload"]
    return {
        "config": {"workload": {key: workload[key] for key in ("image_sizes", "images_per_request")}},
        "modes": [{key: mode.get(key) for key in ("label", "reuse_ratio")} for mode in summary["modes"]],
        "points": points,
    }


def setup_of(point: MeasuredPoint, profile: Profile) -> tuple[str, float]:
    """The simulated layout and hit ratio of a measured point."""
    if profile.cpu_sets:
        return PER_ROLE_SETUPS[point.mode], point.hit_ratio
    return MODE_SETUPS[point.mode]


MODE_STAGES = ("encode", "prefill", "decode")


def workload_for(point: MeasuredPoint, profile: Profile, requests: int = 96, seed: int = 0) -> Workload:
    sizes = point.image_sizes or (point.image_size,)
    mean_tokens = sum(profile.vision.tokens(*size) for size in sizes) / len(sizes)
    return Workload(
        concurrency=point.concurrency,
        images_per_request=point.images_per_request,
        image_size=point.image_size,
        image_sizes=point.image_sizes,
        prompt_tokens=max(1, round(point.input_tokens - point.images_per_request * mean_tokens)),
        output_tokens=point.output_tokens,
        hit_ratio=setup_of(point, profile)[1],
        requests=requests,
        warmup=8,
        seed=seed,
    )


def predict(
    profile: Profile, points: Sequence[MeasuredPoint], requests: int = 96, seed: int = 0
) -> list[dict[str, Any]]:
    """One row per point: measured and predicted e2e/TTFT p50 (and epd stage means), relative errors."""
    rows = []
    for point in points:
        layout = setup_of(point, profile)[0]
        pred = simulate(profile, layout, workload_for(point, profile, requests, seed))
        measured_rate = point.request_throughput
        rows.append(
            {
                "mode": point.mode,
                "concurrency": point.concurrency,
                "workload": point.workload,
                "layout": layout,
                "measured_request_throughput": measured_rate,
                "predicted_request_throughput": pred.request_throughput,
                "throughput_error": pred.request_throughput / measured_rate - 1.0 if measured_rate else None,
                "measured_e2e_p50_ms": point.e2e_p50_ms,
                "predicted_e2e_p50_ms": pred.e2e_ms["p50"],
                "e2e_error": pred.e2e_ms["p50"] / point.e2e_p50_ms - 1.0,
                "measured_ttft_p50_ms": point.ttft_p50_ms,
                "predicted_ttft_p50_ms": pred.ttft_ms["p50"],
                "ttft_error": pred.ttft_ms["p50"] / point.ttft_p50_ms - 1.0,
                "measured_stages_ms": point.stages_ms,
                "predicted_stages_ms": pred.stages_ms,
                "measured_cpu_ms_per_request": point.cpu_ms_per_request,
                "predicted_cpu_ms_per_request": pred.cpu_ms_per_request,
            }
        )
    return rows


def loss(rows: Sequence[dict[str, Any]]) -> float:
    """Mean squared log error: e2e p50 and req/s (weight 1), TTFT p50 (0.5), epd stage means and CPU per
    request (0.25)."""
    total, weight = 0.0, 0.0
    for row in rows:
        terms = [(row["predicted_e2e_p50_ms"], row["measured_e2e_p50_ms"], 1.0)]
        rate = row["predicted_request_throughput"]
        if row.get("measured_request_throughput") and not math.isnan(rate):
            terms.append((rate, row["measured_request_throughput"], 1.0))
        terms.append((row["predicted_ttft_p50_ms"], row["measured_ttft_p50_ms"], 0.5))
        for stage, measured in row["measured_stages_ms"].items():
            if stage in row["predicted_stages_ms"] and measured > 1.0:
                terms.append((row["predicted_stages_ms"][stage], measured, 0.25))
        if row.get("measured_cpu_ms_per_request") and row.get("predicted_cpu_ms_per_request"):
            terms.append((row["predicted_cpu_ms_per_request"], row["measured_cpu_ms_per_request"], 0.25))
        for predicted, measured, w in terms:
            total += w * math.log(max(predicted, 1e-3) / measured) ** 2
            weight += w
    return total / weight if weight else 0.0


def get_param(profile: Profile, path: str) -> float:
    part, name = path.split(".")
    return float(getattr(getattr(profile, part), name))


def set_param(profile: Profile, path: str, value: float) -> Profile:
    part, name = path.split(".")
    return profile.replace(**{part: dataclasses.replace(getattr(profile, part), **{name: value})})


def fit(
    profile: Profile,
    points: Sequence[MeasuredPoint],
    parameters: Sequence[tuple[str, float, float]] = FIT_PARAMETERS,
    rounds: int = 6,
    requests: int = 48,
    log: Any = None,
    checkpoint: Any = None,
) -> tuple[Profile, float]:
    """Coordinate pattern search in log space (deterministic: fixed seed, fixed order)."""
    best = loss(predict(profile, points, requests))
    step = 0.5
    for round_no in range(rounds):
        improved = False
        for path, lo, hi in parameters:
            current = get_param(profile, path)
            for factor in (1 + step, 1 / (1 + step)):
                value = min(hi, max(lo, current * factor))
                if value == current:
                    continue
                candidate = set_param(profile, path, value)
                score = loss(predict(candidate, points, requests))
                if score < best:
                    profile, best, improved = candidate, score, True
                    break
        if log:
            log(f"[fit] round {round_no + 1}/{rounds}: loss {best:.4f} (step {step:.2f})")
        if checkpoint:
            checkpoint(profile)
        if not improved:
            step /= 2
    return profile, best


def _markdown(rows: Sequence[dict[str, Any]], train: Sequence[str], tolerance: float, metric: str) -> str:
    lines = [
        "| run | mode | c | set | measured e2e p50 ms | predicted | error | measured req/s | predicted | error "
        f"| {metric} within +-{tolerance:.0%} | measured TTFT p50 | predicted | error |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        used = "fit" if in_training(r, train) else "check"
        ok = "yes" if _within(r, metric, tolerance) else "**no**"
        rate_error = r.get("throughput_error")
        lines.append(
            f"| {r.get('workload') or '-'} | {r['mode']} | {r['concurrency']} | {used} | "
            f"{r['measured_e2e_p50_ms']:.0f} | {r['predicted_e2e_p50_ms']:.0f} | {r['e2e_error']:+.0%} | "
            f"{r.get('measured_request_throughput') or float('nan'):.2f} | {r['predicted_request_throughput']:.2f} | "
            f"{'-' if rate_error is None else f'{rate_error:+.0%}'} | {ok} | {r['measured_ttft_p50_ms']:.0f} | "
            f"{r['predicted_ttft_p50_ms']:.0f} | {r['ttft_error']:+.0%} |"
        )
    return "\n".join(lines)


def _within(row: dict[str, Any], metric: str, tolerance: float) -> bool:
    error = row.get(METRICS[metric])
    return error is not None and abs(error) <= tolerance


def winner_checks(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (run, concurrency) with two or more modes: the mode with the most req/s, measured and
    predicted (the advisor's question: which layout wins here)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("measured_request_throughput"):
            groups.setdefault((row.get("workload", ""), row["concurrency"]), []).append(row)
    checks = []
    for (workload, concurrency), group in sorted(groups.items()):
        if len(group) < 2:
            continue
        measured = max(group, key=lambda r: r["measured_request_throughput"])["mode"]
        predicted = max(group, key=lambda r: r["predicted_request_throughput"])["mode"]
        checks.append(
            {"workload": workload, "concurrency": concurrency, "measured_winner": measured,
             "predicted_winner": predicted, "right": measured == predicted}
        )  # fmt: skip
    return checks


def validity_report(
    rows: list[dict[str, Any]],
    train: Sequence[str],
    out: Path,
    measured: Sequence[Path],
    tolerance: float = TOLERANCE,
    metric: str = "e2e",
) -> dict[str, Any]:
    from bench.advisor.plots import validity_plot

    out.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r["used_for_fit"] = in_training(r, train)
    checks = [r for r in rows if not r["used_for_fit"]]
    within = [r for r in checks if _within(r, metric, tolerance)]
    winners = winner_checks(rows)
    right = sum(w["right"] for w in winners)
    report = {
        "measured": [str(path) for path in measured],
        "train": list(train),
        "tolerance": tolerance,
        "metric": metric,
        "checked_points": len(checks),
        "within_tolerance": len(within),
        "winners": winners,
        "winners_right": right,
        "rows": rows,
    }
    (out / "validity.json").write_text(json.dumps(report, indent=2) + "\n")
    winner_line = (
        f" The winner (most req/s) predicted at {right} of {len(winners)} measured points"
        + "".join(
            f"; wrong at {w['workload']} c={w['concurrency']} ({w['predicted_winner']} for {w['measured_winner']})"
            for w in winners
            if not w["right"]
        )
        + "."
        if winners
        else ""
    )
    metric_name = {"e2e": "e2e p50", "throughput": "req/s"}[metric]
    (out / "validity.md").write_text(
        f"Fitted on {' '.join(train)}; {len(within)} of {len(checks)} other points within "
        f"+-{tolerance:.0%} on {metric_name}.{winner_line}\n\n" + _markdown(rows, train, tolerance, metric) + "\n"
    )
    validity_plot(rows, train, out / "validity.png")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.advisor.fit", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--measured", type=Path, nargs="+", required=True,
        help="summary.json of a `python -m bench run`; several: fitted together, each named by its folder",
    )  # fmt: skip
    parser.add_argument(
        "--train", nargs="+", default=["1", "2"], help="points the fit may use: C (all modes) or MODE@C"
    )
    parser.add_argument("--profile", default="cpu-2core", help="starting profile (name or JSON path)")
    parser.add_argument("--out-profile", type=Path, help="write the fitted profile here")
    parser.add_argument("--report", type=Path, required=True, help="folder for validity.{json,md,png}")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--no-fit", action="store_true", help="only check the given profile")
    parser.add_argument("--metric", choices=sorted(METRICS), default="e2e", help="what must be within +-20%%")
    parser.add_argument(
        "--require-within", type=float, default=0.0, metavar="SHARE",
        help="exit 1 unless at least this share of the points not fitted on is within +-20%% "
        "(e.g. 0.8, the advisor's goal; default 0: report only)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    profile = load_profile(args.profile)
    modes = PER_ROLE_SETUPS if profile.cpu_sets else MODE_SETUPS
    several = len(args.measured) > 1
    points = [
        point
        for path in args.measured
        for point in load_points(path, modes, workload_name=path.parent.name if several else "")
    ]
    train = list(args.train)
    if not args.no_fit:
        training = [p for p in points if in_training(p, train)]
        keep = (lambda p: save_profile(p, args.out_profile)) if args.out_profile else None
        profile, score = fit(
            profile, training, rounds=args.rounds, log=lambda m: print(m, file=sys.stderr), checkpoint=keep
        )
        sources = dict(profile.sources)
        sources["fit"] = (
            f"python -m bench.advisor.fit --measured {' '.join(map(str, args.measured))} --train {' '.join(train)} "
            f"(training loss {score:.4f}, {len(training)} points)"
        )
        profile = profile.replace(sources=sources)
        if args.out_profile:
            save_profile(profile, args.out_profile)
    report = validity_report(predict(profile, points), train, args.report, args.measured, metric=args.metric)
    print((args.report / "validity.md").read_text())
    required = math.ceil(args.require_within * report["checked_points"])
    return 0 if report["within_tolerance"] >= required else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Fit a profile's stage costs on some measured bench points, then check it predicts the others.

``python -m bench.advisor.fit --measured SUMMARY.json --train 1 2 --profile cpu-2core --out-profile P``
reads a ``python -m bench run`` summary (modes llm, llm:repeated, epd, epd:repeated,
epd:colocated[:repeated], or the path benchmark's names for them, ``MODE_ALIASES``), fits the
profile's free parameters on the training concurrencies (a deterministic pattern search in log
space over e2e p50, TTFT p50 and, for epd, the encode/prefill/decode stage means), and writes the
validity report: predicted vs measured e2e p50 on every point, as JSON, markdown and a plot.
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
TOLERANCE = 0.20  # the acceptance (docs/benchmarks/advisor.md): predictions within +-20% on e2e p50

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

    @property
    def key(self) -> str:
        return f"{self.mode}@{self.concurrency}"


def in_training(point: MeasuredPoint | dict[str, Any], train: Sequence[str]) -> bool:
    """``train`` entries: ``C`` (every mode at concurrency C) or ``MODE@C`` (one point)."""
    mode, c = (
        (point.mode, point.concurrency) if isinstance(point, MeasuredPoint) else (point["mode"], point["concurrency"])
    )
    return str(c) in train or f"{mode}@{c}" in train


def load_points(summary_path: Path, modes: Iterable[str] = MODE_SETUPS) -> list[MeasuredPoint]:
    """The closed-loop points of a bench summary for the modes the simulator knows."""
    summary = json.loads(summary_path.read_text())
    workload = summary["config"]["workload"]
    width, height = (int(v) for v in workload["image_sizes"][0].split("x"))
    wanted = set(modes)
    points = []
    for point in summary["points"]:
        mode = MODE_ALIASES.get(point["mode"], point["mode"])
        if point.get("status") != "ran" or point["load_kind"] != "concurrency" or mode not in wanted:
            continue
        s = point["summary"]
        points.append(
            MeasuredPoint(
                mode=mode,
                concurrency=int(point["load"]),
                e2e_p50_ms=s["e2e_ms"]["p50"],
                ttft_p50_ms=s["ttft_ms"]["p50"],
                stages_ms={k: v for k, v in ((point.get("stages") or {}).get("ms") or {}).items() if k in MODE_STAGES},
                input_tokens=s["mean_input_tokens"],
                output_tokens=round(s["mean_output_tokens"]),
                image_size=(width, height),
                images_per_request=int(workload["images_per_request"]),
                other_cpu_share=(s.get("cpu") or {}).get("other_processes_cpu_share"),
                cpu_ms_per_request=(s.get("cpu") or {}).get("server_cpu_ms_per_request"),
            )
        )
    return sorted(points, key=lambda p: (list(MODE_SETUPS).index(p.mode), p.concurrency))


MODE_STAGES = ("encode", "prefill", "decode")


def workload_for(point: MeasuredPoint, profile: Profile, requests: int = 96, seed: int = 0) -> Workload:
    image_tokens = point.images_per_request * profile.vision.tokens(*point.image_size)
    return Workload(
        concurrency=point.concurrency,
        images_per_request=point.images_per_request,
        image_size=point.image_size,
        prompt_tokens=max(1, round(point.input_tokens - image_tokens)),
        output_tokens=point.output_tokens,
        hit_ratio=MODE_SETUPS[point.mode][1],
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
        layout = MODE_SETUPS[point.mode][0]
        pred = simulate(profile, layout, workload_for(point, profile, requests, seed))
        rows.append(
            {
                "mode": point.mode,
                "concurrency": point.concurrency,
                "layout": layout,
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
    """Mean squared log error: e2e p50 (weight 1), TTFT p50 (0.5), epd stage means and CPU per request (0.25)."""
    total, weight = 0.0, 0.0
    for row in rows:
        terms = [(row["predicted_e2e_p50_ms"], row["measured_e2e_p50_ms"], 1.0)]
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


def _markdown(rows: Sequence[dict[str, Any]], train: Sequence[str], tolerance: float) -> str:
    lines = [
        "| mode | c | set | measured e2e p50 ms | predicted | error | within +-20% "
        "| measured TTFT p50 | predicted | error |",
        "|---|---:|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        used = "fit" if in_training(r, train) else "check"
        ok = "yes" if abs(r["e2e_error"]) <= tolerance else "**no**"
        lines.append(
            f"| {r['mode']} | {r['concurrency']} | {used} | {r['measured_e2e_p50_ms']:.0f} | "
            f"{r['predicted_e2e_p50_ms']:.0f} | {r['e2e_error']:+.0%} | {ok} | {r['measured_ttft_p50_ms']:.0f} | "
            f"{r['predicted_ttft_p50_ms']:.0f} | {r['ttft_error']:+.0%} |"
        )
    return "\n".join(lines)


def validity_report(
    rows: list[dict[str, Any]], train: Sequence[str], out: Path, measured: Path, tolerance: float = TOLERANCE
) -> dict[str, Any]:
    from bench.advisor.plots import validity_plot

    out.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r["used_for_fit"] = in_training(r, train)
    checks = [r for r in rows if not r["used_for_fit"]]
    within = [r for r in checks if abs(r["e2e_error"]) <= tolerance]
    report = {
        "measured": str(measured),
        "train": list(train),
        "tolerance": tolerance,
        "checked_points": len(checks),
        "within_tolerance": len(within),
        "rows": rows,
    }
    (out / "validity.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "validity.md").write_text(
        f"Fitted on {' '.join(train)}; {len(within)} of {len(checks)} other points within "
        f"+-{tolerance:.0%} on e2e p50.\n\n" + _markdown(rows, train, tolerance) + "\n"
    )
    validity_plot(rows, train, out / "validity.png")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.advisor.fit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--measured", type=Path, required=True, help="summary.json of a `python -m bench run`")
    parser.add_argument(
        "--train", nargs="+", default=["1", "2"], help="points the fit may use: C (all modes) or MODE@C"
    )
    parser.add_argument("--profile", default="cpu-2core", help="starting profile (name or JSON path)")
    parser.add_argument("--out-profile", type=Path, help="write the fitted profile here")
    parser.add_argument("--report", type=Path, required=True, help="folder for validity.{json,md,png}")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--no-fit", action="store_true", help="only check the given profile")
    parser.add_argument(
        "--require-within", type=float, default=0.0, metavar="SHARE",
        help="exit 1 unless at least this share of the points not fitted on is within +-20%% "
        "(e.g. 0.8, the advisor's goal; default 0: report only)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    points = load_points(args.measured)
    profile = load_profile(args.profile)
    train = list(args.train)
    if not args.no_fit:
        training = [p for p in points if in_training(p, train)]
        keep = (lambda p: save_profile(p, args.out_profile)) if args.out_profile else None
        profile, score = fit(
            profile, training, rounds=args.rounds, log=lambda m: print(m, file=sys.stderr), checkpoint=keep
        )
        sources = dict(profile.sources)
        sources["fit"] = (
            f"python -m bench.advisor.fit --measured {args.measured} --train {' '.join(train)} "
            f"(training loss {score:.4f}, {len(training)} points)"
        )
        profile = profile.replace(sources=sources)
        if args.out_profile:
            save_profile(profile, args.out_profile)
    report = validity_report(predict(profile, points), train, args.report, args.measured)
    print((args.report / "validity.md").read_text())
    required = math.ceil(args.require_within * report["checked_points"])
    return 0 if report["within_tolerance"] >= required else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""``triton-epd-advise``: which layout and path policy to serve a workload with, and from which load on.

Simulates every candidate layout (colocated and disaggregated, on the same number of devices)
over a concurrency sweep with a hardware profile, then prints the recommended layout at the
target load, the ``path_policy`` for ``epd`` (``colocated``, ``disaggregated``, or ``adaptive``
with the switch point), the crossover concurrency, and writes a plot of predicted TTFT/e2e.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.advisor.profiles import Profile, ProfileError, load_profile
from bench.advisor.simulator import Layout, Workload, simulate

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128)


def candidate_layouts(profile: Profile, devices: int | None) -> list[Layout]:
    """Colocated plus every xE+yPD and xE+yP+zD on ``devices`` devices (CPU: the 2 shipped shapes)."""
    if profile.shared_cpu_slots is not None or not devices:
        # One machine whose cores every instance shares: the layouts the CPU target builds.
        return [Layout.parse(t) for t in ("colocated", "1E+1PD", "1E+1P+1D")]
    layouts = [Layout(colocated=devices)]
    for e in range(1, devices):
        layouts.append(Layout(encoders=e, pds=devices - e))
        for p in range(1, devices - e):
            layouts.append(Layout(encoders=e, prefills=p, decodes=devices - e - p))
    return layouts


METRICS = ("e2e", "ttft")


@dataclass(frozen=True)
class Advice:
    metric: str
    margin: float
    target_concurrency: int
    recommended: str
    policy: str
    # Per metric: the lowest concurrency where the best disaggregated layout beats colocated by the margin.
    crossover: dict[str, int | None]
    disaggregated_wins: dict[str, list[int]]
    best_by_concurrency: dict[int, str]
    sweep: dict[str, list[dict[str, Any]]]

    def text(self) -> str:
        lines = [
            f"recommended layout at c={self.target_concurrency}: {self.recommended}",
            f"path policy: {self.policy}",
        ]
        for metric in METRICS:
            wins = self.disaggregated_wins[metric]
            where = f" (disaggregated ahead at c={','.join(map(str, wins))})" if wins else ""
            found = f"c={self.crossover[metric]}" if self.crossover[metric] is not None else "none in the sweep"
            lines.append(f"crossover concurrency, {metric} p50 (>= {self.margin:.0%} better): {found}{where}")
        lines += ["", "predicted p50 ms (TTFT / e2e) per layout:"]
        loads = sorted(self.best_by_concurrency)
        lines.append("layout".ljust(14) + "".join(f"c={c}".rjust(16) for c in loads))
        for layout, rows in self.sweep.items():
            cells = {r["concurrency"]: f"{r['ttft_ms']['p50']:.0f} / {r['e2e_ms']['p50']:.0f}" for r in rows}
            lines.append(layout.ljust(14) + "".join(cells.get(c, "-").rjust(16) for c in loads))
        lines.append(f"best ({self.metric})".ljust(14) + "".join(self.best_by_concurrency[c].rjust(16) for c in loads))
        return "\n".join(lines)


def advise(
    profile: Profile,
    workload: Workload,
    layouts: Sequence[Layout],
    concurrency: Sequence[int],
    metric: str = "e2e",
    target: int | None = None,
    margin: float = 0.05,
) -> Advice:
    sweep: dict[str, list[dict[str, Any]]] = {}
    for layout in layouts:
        rows = []
        for c in concurrency:
            # Enough requests per client that the closed loop reaches a steady state at every load.
            steady = {"requests": max(workload.requests, 3 * c), "warmup": max(workload.warmup, c)}
            point = simulate(
                profile, layout, Workload(**{**workload.__dict__, "concurrency": c, "request_rate": None, **steady})
            )
            rows.append({"concurrency": c, **point.summary()})
        sweep[layout.label] = rows
    colocated = next(label for label in sweep if label.startswith("colocated"))
    best_by_c: dict[int, str] = {}
    wins: dict[str, list[int]] = {m: [] for m in METRICS}
    for i, c in enumerate(concurrency):
        for m in METRICS:
            values = {label: rows[i][f"{m}_ms"]["p50"] for label, rows in sweep.items()}
            if m == metric:
                best_by_c[c] = min(values, key=lambda label: values[label])
            # Disaggregation costs more moving parts: it counts as better only by the margin.
            if min(v for label, v in values.items() if label != colocated) < (1 - margin) * values[colocated]:
                wins[m].append(c)
    crossover = {m: (min(wins[m]) if wins[m] else None) for m in METRICS}
    target = target or max(concurrency)
    recommended = min(sweep, key=lambda label: _at(sweep[label], target, f"{metric}_ms"))
    # Values of epd's ``path_policy`` (python_backends/contract: colocated, disaggregated, adaptive).
    won = wins[metric]
    split = "disaggregated"
    if profile.pd_in_frontend and won and Layout.parse(best_by_c[won[-1]]).pds:
        # Here xE+yPD is epd's colocated path fed by the encoders, not the disaggregated path.
        split = "E|PD (--colocated-encodes encoders, path colocated)"
    if not won:
        policy = "colocated (disaggregation does not pay anywhere in this sweep)"
    elif len(won) == len(concurrency):
        policy = f"{split} (it wins at every load in this sweep)"
    else:
        policy = (
            f"adaptive (colocated below ~{min(won)} requests in flight; {split} ahead at "
            f"c={','.join(map(str, won))})"
        )
    return Advice(metric, margin, target, recommended, policy, crossover, wins, best_by_c, sweep)


def _at(rows: list[dict[str, Any]], c: int, key: str) -> float:
    nearest = min(rows, key=lambda r: abs(r["concurrency"] - c))
    return float(nearest[key]["p50"])


def _size(text: str) -> tuple[int, int]:
    width, _, height = text.lower().partition("x")
    try:
        return int(width), int(height)
    except ValueError:
        raise argparse.ArgumentTypeError(f"image size {text!r}: use WIDTHxHEIGHT, e.g. 640x480") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triton-epd-advise", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="cpu-2core", help="cpu-2core, gpu-a100 or a profile JSON path")
    parser.add_argument("--devices", type=int, help="devices to lay out (GPU profiles; default: the profile's)")
    parser.add_argument("--layouts", nargs="+", help="layouts to compare, e.g. colocated:4 1E+3PD 1E+1P+2D")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(DEFAULT_CONCURRENCY))
    parser.add_argument("--target", type=int, help="operating concurrency to recommend for (default: the largest)")
    parser.add_argument("--metric", choices=METRICS, default="e2e", help="what 'better' means (p50)")
    parser.add_argument(
        "--margin", type=float, default=0.05, help="how much better disaggregated must be to count (0.05 = 5%%)"
    )
    parser.add_argument("--images-per-request", type=int, default=1)
    parser.add_argument("--image-size", type=_size, help="WIDTHxHEIGHT (default: the profile's workload)")
    parser.add_argument("--prompt-tokens", type=int, help="text tokens incl. the chat template (default: profile's)")
    parser.add_argument("--output-tokens", type=int, help="default: the profile's workload")
    parser.add_argument("--hit-ratio", type=float, default=0.0, help="share of images already encoded (0..1)")
    parser.add_argument("--requests", type=int, default=96, help="simulated requests per point (after 8 warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/latest/advisor"), help="plot and JSON go here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        profile = load_profile(args.profile)
    except ProfileError as exc:
        print(f"triton-epd-advise: {exc}", file=sys.stderr)
        return 2
    defaults = profile.default_workload
    if not 0.0 <= args.hit_ratio <= 1.0:
        print("triton-epd-advise: --hit-ratio must be within 0..1", file=sys.stderr)
        return 2
    workload = Workload(
        images_per_request=args.images_per_request,
        image_size=args.image_size or _size(str(defaults.get("image_size", "640x480"))),
        prompt_tokens=args.prompt_tokens or int(defaults.get("prompt_tokens", 64)),
        output_tokens=args.output_tokens or int(defaults.get("output_tokens", 32)),
        hit_ratio=args.hit_ratio,
        requests=args.requests,
        seed=args.seed,
    )
    try:
        layouts = (
            [Layout.parse(t) for t in args.layouts]
            if args.layouts
            else candidate_layouts(profile, args.devices or profile.devices)
        )
    except ValueError as exc:
        print(f"triton-epd-advise: {exc}", file=sys.stderr)
        return 2
    if not any(layout.is_colocated for layout in layouts):
        layouts.insert(0, Layout(colocated=max(1, layouts[0].instances if profile.shared_cpu_slots is None else 1)))
    advice = advise(profile, workload, layouts, sorted(set(args.concurrency)), args.metric, args.target, args.margin)
    print(f"profile {profile.name}: {profile.description}")
    print(
        f"workload: {workload.images_per_request} image(s) {workload.image_size[0]}x{workload.image_size[1]}, "
        f"{workload.prompt_tokens} text + {workload.output_tokens} output tokens, hit ratio {workload.hit_ratio:g}"
    )
    print(advice.text())
    args.out.mkdir(parents=True, exist_ok=True)
    from bench.advisor.plots import layouts_plot

    plot = layouts_plot(
        advice.sweep,
        advice.crossover[advice.metric],
        f"{profile.name}: predicted p50 per layout ({workload.images_per_request} image, "
        f"{workload.prompt_tokens}+{workload.output_tokens} tokens, hit {workload.hit_ratio:g})",
        args.out / f"advise-{profile.name}.png",
    )
    (args.out / f"advise-{profile.name}.json").write_text(
        json.dumps(
            {
                "profile": profile.name,
                "workload": workload.__dict__,
                "recommended": advice.recommended,
                "policy": advice.policy,
                "crossover_concurrency": advice.crossover,
                "disaggregated_wins": advice.disaggregated_wins,
                "metric": advice.metric,
                "margin": advice.margin,
                "best_by_concurrency": advice.best_by_concurrency,
                "sweep": advice.sweep,
                "command": "triton-epd-advise " + " ".join(sys.argv[1:] if argv is None else argv),
            },
            indent=2,
        )
        + "\n"
    )
    print(f"plot: {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

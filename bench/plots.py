"""PNG plots: latency percentiles and throughput vs load, one line per mode."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

PERCENTILE_STYLES = {"p50": "-", "p90": "--", "p99": ":"}
LATENCY_PANELS = (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "end-to-end"))
THROUGHPUT_PANELS = (("request_throughput", "requests/s"), ("output_token_throughput", "output tokens/s"))
AXIS_LABELS = {"concurrency": "concurrent requests (closed loop)", "rate": "offered request rate, req/s (open loop)"}


def _series(summary: dict[str, Any], kind: str) -> dict[str, list[dict[str, Any]]]:
    by_mode: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for point in summary["points"]:
        if point.get("status") == "ran" and point["load_kind"] == kind:
            # Poisson and burst at the same rates are different curves.
            name = point["mode"] if kind == "concurrency" else f"{point['mode']} {point.get('pattern', '')}"
            by_mode[name].append(point)
    return {mode: sorted(points, key=lambda p: p["load"]) for mode, points in by_mode.items()}


def _values(points: list[dict[str, Any]], metric: str, stat: str | None = None) -> list[float]:
    out = []
    for p in points:
        value = p["summary"][metric]
        value = value.get(stat) if stat else value
        out.append(float("nan") if value is None else value)
    return out


def _load_axis(ax: Any, kind: str, series: dict[str, list[dict[str, Any]]]) -> None:
    loads = sorted({p["load"] for points in series.values() for p in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(loads, [f"{x:g}" for x in loads])  # the measured points, not powers of two
    ax.minorticks_off()
    ax.set_xlabel(AXIS_LABELS[kind])
    ax.grid(True, alpha=0.3)


def latency_plot(summary: dict[str, Any], kind: str, path: Path) -> Path:
    series = _series(summary, kind)
    fig, axes = plt.subplots(1, len(LATENCY_PANELS), figsize=(15, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (metric, title) in zip(axes, LATENCY_PANELS, strict=True):
        for i, (mode, points) in enumerate(series.items()):
            x = [p["load"] for p in points]
            for stat, style in PERCENTILE_STYLES.items():
                ax.plot(
                    x,
                    _values(points, metric, stat),
                    style,
                    marker="o",
                    ms=3,
                    color=colors[i % len(colors)],
                    label=f"{mode} {stat}",
                )
        ax.set_title(f"{title} (ms)")
        _load_axis(ax, kind, series)
    axes[0].legend(fontsize=7, ncol=1)
    fig.suptitle("Latency percentiles (solid p50, dashed p90, dotted p99)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput_plot(summary: dict[str, Any], kind: str, path: Path) -> Path:
    series = _series(summary, kind)
    fig, axes = plt.subplots(1, len(THROUGHPUT_PANELS), figsize=(11, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (metric, title) in zip(axes, THROUGHPUT_PANELS, strict=True):
        for i, (mode, points) in enumerate(series.items()):
            color, x = colors[i % len(colors)], [p["load"] for p in points]
            ax.plot(x, _values(points, metric), marker="o", color=color, label=mode)
            if metric == "request_throughput" and any(p["summary"].get("goodput") is not None for p in points):
                ax.plot(
                    x, _values(points, "goodput"), "--", marker="x", color=color, label=f"{mode} goodput (SLOs met)"
                )
        ax.set_title(title)
        _load_axis(ax, kind, series)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle("Throughput vs load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(summary: dict[str, Any], out: Path) -> list[Path]:
    kinds = sorted({p["load_kind"] for p in summary["points"] if p.get("status") == "ran"})
    written = []
    for kind in kinds:
        written.append(latency_plot(summary, kind, out / f"latency_vs_{kind}.png"))
        written.append(throughput_plot(summary, kind, out / f"throughput_vs_{kind}.png"))
    return written


# --- bench peers ------------------------------------------------------------------------------

PEER_LATENCY_PANELS = (
    ("ttft_ms", "p50", "TTFT p50"),
    ("ttft_ms", "p90", "TTFT p90"),
    ("e2e_ms", "p50", "end-to-end p50"),
)
PEER_RATIO_METRICS = (
    ("ttft_ms_p50", "TTFT p50"),
    ("ttft_ms_p90", "TTFT p90"),
    ("e2e_ms_p50", "E2E p50"),
    ("request_throughput", "req/s"),
)


def _is_peer(mode: str) -> bool:
    return mode.startswith("vllm-")


def peer_latency_plot(summary: dict[str, Any], path: Path) -> Path:
    """p50/p90 only, one line per mode: ours solid, the vLLM peers dashed; repeated media
    in the right-hand colour of each pair."""
    series = _series(summary, "concurrency")
    fig, axes = plt.subplots(1, len(PEER_LATENCY_PANELS), figsize=(16, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (metric, stat, title) in zip(axes, PEER_LATENCY_PANELS, strict=True):
        for i, (mode, points) in enumerate(series.items()):
            ax.plot(
                [p["load"] for p in points],
                _values(points, metric, stat),
                "--" if _is_peer(mode) else "-",
                marker="s" if _is_peer(mode) else "o",
                ms=4,
                color=colors[i % len(colors)],
                label=mode,
            )
        ax.set_title(f"{title} (ms)")
        ax.set_ylim(bottom=0)
        _load_axis(ax, "concurrency", series)
    axes[0].legend(fontsize=7)
    fig.suptitle("Ours (solid) vs vLLM peers (dashed), same model, machine and workload")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def peer_ratio_plot(summary: dict[str, Any], path: Path) -> Path:
    """Ours / best peer (same media policy) per metric and load point; 1.0 = parity."""
    rows = summary["peers"]["ratios_vs_best_peer"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    loads = list(dict.fromkeys(r["load_label"] for r in rows))
    fig, axes = plt.subplots(1, max(len(modes), 1), figsize=(4.2 * max(len(modes), 1), 4.5), squeeze=False)
    width = 0.8 / max(len(loads), 1)
    for ax, mode in zip(axes[0], modes, strict=False):  # one empty panel when there is no mode
        for j, load in enumerate(loads):
            row = next((r for r in rows if r["mode"] == mode and r["load_label"] == load), None)
            values = [float("nan") if row is None or row.get(k) is None else row[k] for k, _ in PEER_RATIO_METRICS]
            ax.bar([i + j * width for i in range(len(PEER_RATIO_METRICS))], values, width, label=load)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(
            [i + width * (len(loads) - 1) / 2 for i in range(len(PEER_RATIO_METRICS))],
            [t for _, t in PEER_RATIO_METRICS],
        )
        ax.set_title(f"{mode} / best peer")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Ratio to the best vLLM peer (latency: < 1 is better; req/s: > 1 is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_peer_plots(summary: dict[str, Any], out: Path) -> list[Path]:
    written = []
    if any(p.get("status") == "ran" and p["load_kind"] == "concurrency" for p in summary["points"]):
        written.append(peer_latency_plot(summary, out / "peers_latency_vs_concurrency.png"))
    if summary["peers"]["ratios_vs_best_peer"]:
        written.append(peer_ratio_plot(summary, out / "peers_ratio_vs_best_peer.png"))
    return written

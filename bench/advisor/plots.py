"""PNG plots of the advisor: predicted latency vs concurrency per layout, predicted vs measured."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt


def _concurrency_axis(ax: Any, loads: Sequence[float]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(loads), [f"{x:g}" for x in loads])
    ax.minorticks_off()
    ax.set_xlabel("concurrent requests (closed loop)")
    ax.grid(True, alpha=0.3)


def layouts_plot(sweep: dict[str, list[dict[str, Any]]], crossover: float | None, title: str, path: Path) -> Path:
    """Predicted TTFT and e2e p50 vs concurrency, one line per layout; the crossover as a vertical line."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    loads = sorted({row["concurrency"] for rows in sweep.values() for row in rows})
    for ax, (metric, name) in zip(axes, (("ttft_ms", "TTFT p50"), ("e2e_ms", "end-to-end p50")), strict=True):
        for layout, rows in sweep.items():
            rows = sorted(rows, key=lambda r: r["concurrency"])
            style = "--" if layout.startswith("colocated") else "-"
            ax.plot([r["concurrency"] for r in rows], [r[metric]["p50"] for r in rows], style, marker="o", label=layout)
        if crossover is not None:
            ax.axvline(crossover, color="grey", linestyle=":", label=f"crossover c={crossover:g}")
        _concurrency_axis(ax, loads)
        ax.set_yscale("log")
        ax.set_ylabel(f"predicted {name}, ms")
        ax.set_title(name)
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def validity_plot(rows: Sequence[dict[str, Any]], train: Sequence[str], path: Path) -> Path:
    """Left: measured (dots) and predicted (lines) e2e p50 per mode; right: predicted vs measured."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    by_mode: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_mode[row["mode"]].append(row)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (mode, mode_rows) in enumerate(by_mode.items()):
        mode_rows.sort(key=lambda r: r["concurrency"])
        x = [r["concurrency"] for r in mode_rows]
        color = colors[i % len(colors)]
        left.plot(x, [r["predicted_e2e_p50_ms"] for r in mode_rows], "-", color=color, label=f"{mode} predicted")
        left.plot(x, [r["measured_e2e_p50_ms"] for r in mode_rows], "o", color=color, label=f"{mode} measured")
        for r in mode_rows:
            marker = "s" if r.get("used_for_fit") else "o"
            right.plot(r["measured_e2e_p50_ms"], r["predicted_e2e_p50_ms"], marker, color=color)
        right.plot([], [], "o", color=color, label=mode)
    _concurrency_axis(left, sorted({r["concurrency"] for r in rows}))
    left.set_ylabel("e2e p50, ms")
    left.set_title("e2e p50 vs concurrency")
    left.legend(fontsize=7)
    top = max(max(r["measured_e2e_p50_ms"], r["predicted_e2e_p50_ms"]) for r in rows) * 1.1
    right.plot([0, top], [0, top], "k-", linewidth=0.8)
    right.fill_between([0, top], [0, top * 0.8], [0, top * 1.2], color="grey", alpha=0.15, label="+-20%")
    right.set_xlim(0, top)
    right.set_ylim(0, top)
    right.set_xlabel("measured e2e p50, ms")
    right.set_ylabel("predicted e2e p50, ms")
    right.set_title(f"squares: used by the fit ({' '.join(train)}), dots: predicted")
    right.legend(fontsize=7)
    right.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

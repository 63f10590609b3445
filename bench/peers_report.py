"""What ``bench peers`` concludes and writes: the comparisons (ratios against the best peer,
the goals of docs/benchmarks/peers.md, validity warnings, sweep-time token agreement) and the outputs: the usual
files (summary.json, raw.json, results.csv, plots) plus peers.csv and a results.md that starts
with what the peer comparison is for: the goals, the ratios against the best peer and output
equality."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.metrics import RequestRecord
from bench.peer_servers import COLOCATED, PEER_MODELS
from bench.report import markdown, write_outputs
from bench.sweep import RATIO_METRICS

PEER_SHORT = {"vllm-colocated": "C", "vllm-colocated:repeated": "C", "vllm-epd": "E", "vllm-epd:repeated": "E"}
RATIO_COLUMNS = (
    ("ttft_ms_p50", "TTFT p50"),
    ("ttft_ms_p90", "TTFT p90"),
    ("tpot_ms_p50", "TPOT p50"),
    ("e2e_ms_p50", "E2E p50"),
    ("e2e_ms_p90", "E2E p90"),
    ("request_throughput", "req/s"),
    ("output_token_throughput", "tok/s"),
)


THROUGHPUT_METRICS = ("request_throughput", "output_token_throughput")
# The peer comparison's goals (ours, CPU; docs/benchmarks/peers.md).
E2E_GOAL_FACTOR = 1.15


# ---------------------------------------------------------------------------------------------
# Comparison against the best peer
# ---------------------------------------------------------------------------------------------


def policy_of(label: str) -> str:
    """Media policy class of a mode label: repeated vs unique (default counts as unique
    when the plain modes use no reuse, which is how bench-peers runs)."""
    return "repeated" if label.endswith(":repeated") else "unique"


def model_of(label: str) -> str:
    return label.partition(":")[0]


def _value(point: dict[str, Any], metric: str, stat: str | None) -> float | None:
    value = point["summary"].get(metric)
    return value.get(stat) if stat and isinstance(value, dict) else value


def best_peer_ratios(
    points: Sequence[dict[str, Any]], peer_models: Sequence[str] = PEER_MODELS
) -> list[dict[str, Any]]:
    """For each of our modes and load point: per metric, ours / the best peer's value among
    the peer modes with the same media policy at the same load point (best = lowest latency,
    highest throughput), and which peer that was."""
    ran = [p for p in points if p.get("status") == "ran"]
    peers = [p for p in ran if model_of(p["mode"]) in peer_models]
    rows = []
    for point in ran:
        if model_of(point["mode"]) in peer_models:
            continue
        candidates = [
            p
            for p in peers
            if p["load_label"] == point["load_label"] and policy_of(p["mode"]) == policy_of(point["mode"])
        ]
        if not candidates:
            continue
        row: dict[str, Any] = {"mode": point["mode"], "load_label": point["load_label"], "best_peer": {}}
        for metric, stat in RATIO_METRICS:
            name = f"{metric}_{stat}" if stat else metric
            values = [(v, p["mode"]) for p in candidates if (v := _value(p, metric, stat)) is not None]
            ours = _value(point, metric, stat)
            if not values or ours is None:
                row[name] = None
                continue
            best, who = (max if metric in THROUGHPUT_METRICS else min)(values)
            row[name] = ours / best if best else None
            row["best_peer"][name] = who
        rows.append(row)
    return rows


def _point(points: Sequence[dict[str, Any]], mode: str, load_label: str) -> dict[str, Any] | None:
    ran = (p for p in points if p.get("status") == "ran")
    return next((p for p in ran if p["mode"] == mode and p["load_label"] == load_label), None)


def _top_stages(point: dict[str, Any], count: int = 3) -> str:
    ms = point.get("stages", {}).get("ms", {})
    top = sorted(ms.items(), key=lambda kv: -kv[1])[:count]
    return ", ".join(f"{name} {value:.0f} ms" for name, value in top) or "no stage timings"


def goal_checks(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The peer comparison's goals at every load point both modes ran: ``epd:repeated`` beats
    ``vllm-epd:repeated`` on TTFT p50 and p90; ``epd`` e2e p50 within 1.15x ``vllm-colocated``'s."""
    checks = []
    labels = list(dict.fromkeys(p["load_label"] for p in points if p.get("status") == "ran"))
    for label in labels:
        ours, peer = _point(points, "epd:repeated", label), _point(points, "vllm-epd:repeated", label)
        if ours and peer:
            for stat in ("p50", "p90"):
                a, b = ours["summary"]["ttft_ms"][stat], peer["summary"]["ttft_ms"][stat]
                if a is None or b is None:
                    continue
                checks.append(
                    {
                        "goal": f"epd:repeated TTFT {stat} < vllm-epd:repeated",
                        "load_label": label,
                        "ours_ms": a,
                        "peer_ms": b,
                        "ratio": a / b,
                        "met": a < b,
                        "ours_stages": _top_stages(ours),
                        "peer_stages": _top_stages(peer),
                    }
                )
        ours, peer = _point(points, "epd", label), _point(points, COLOCATED, label)
        if ours and peer:
            a, b = ours["summary"]["e2e_ms"]["p50"], peer["summary"]["e2e_ms"]["p50"]
            if a is not None and b is not None:
                checks.append(
                    {
                        "goal": f"epd e2e p50 <= {E2E_GOAL_FACTOR}x vllm-colocated",
                        "load_label": label,
                        "ours_ms": a,
                        "peer_ms": b,
                        "ratio": a / b,
                        "met": a <= E2E_GOAL_FACTOR * b,
                        "ours_stages": _top_stages(ours),
                        "peer_stages": _top_stages(peer),
                    }
                )
    return checks


def validity_warnings(points: Sequence[dict[str, Any]]) -> list[str]:
    """Measurements that do not mean what their mode says: a unique-media point whose images
    were served from our store (an earlier run's images, or another server's), a point
    with errors."""
    warnings = []
    for p in points:
        if p.get("status") != "ran":
            continue
        s = p["summary"]
        if policy_of(p["mode"]) == "unique" and (s.get("cache_hits") or 0) > 0:
            warnings.append(
                f"{p['mode']} {p['load_label']}: {s['cache_hits']:.0f} store hits with unique images "
                "(the images were not new to the store: use a fresh --media-salt)"
            )
        if s.get("errors"):
            warnings.append(f"{p['mode']} {p['load_label']}: {s['errors']:.0f} failed requests")
    return warnings


def agreement_by_policy(
    records: dict[tuple[str, str], list[RequestRecord]], baseline_model: str = "llm"
) -> dict[str, float | None]:
    """Sweep-time token agreement: each mode against the baseline model run with the same
    media policy at the same load point, request by request (the workload is the same).
    Under concurrency the batches differ between servers, so a random-weight model's
    near-tied logits may flip a token here; the equality pass (one request at a time) is
    the test of equal outputs."""
    agreement: dict[str, float | None] = {}
    for (label, load), recs in records.items():
        if model_of(label) == baseline_model:
            continue
        base_label = baseline_model if policy_of(label) == "unique" else f"{baseline_model}:repeated"
        base = records.get((base_label, load))
        if base is None:
            continue
        base_tokens = {r.key: r.output_token_ids for r in base if r.ok}
        pairs = [(r.output_token_ids, base_tokens[r.key]) for r in recs if r.ok and r.key in base_tokens]
        agreement[f"{label} {load} vs {base_label}"] = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
    return agreement


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def write_peer_outputs(out: Path, summary: dict[str, Any], raw: list[dict[str, Any]], plots: bool = True) -> list[Path]:
    written = write_outputs(out, summary, raw, plots=plots)
    rows = summary["peers"]["ratios_vs_best_peer"]
    with open(out / "peers.csv", "w", newline="") as handle:
        fields = ["mode", "load_label", *(k for k, _ in RATIO_COLUMNS), *(f"best_peer_{k}" for k, _ in RATIO_COLUMNS)]
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {
                    "mode": row["mode"],
                    "load_label": row["load_label"],
                    **{k: row.get(k) for k, _ in RATIO_COLUMNS},
                    **{f"best_peer_{k}": row["best_peer"].get(k) for k, _ in RATIO_COLUMNS},
                }
            )
    written.append(out / "peers.csv")
    if plots and summary["points"]:
        from bench.plots import write_peer_plots  # matplotlib is slow to import

        written.extend(write_peer_plots(summary, out))
    names = [p.name for p in written if p.suffix == ".png"]
    (out / "results.md").write_text(peers_markdown(summary, names))
    return written


def peers_markdown(summary: dict[str, Any], plot_names: list[str] | None = None) -> str:
    """report.markdown's document with the peer sections after its header."""
    servers = "- Servers: one group at a time, each started and stopped by the harness (below)"
    base = "\n".join(
        servers if line.startswith("- Server: ") else line for line in markdown(summary, plot_names).split("\n")
    )
    head, sep, rest = base.partition("\n## Latency and throughput")
    return head.rstrip("\n") + "\n" + "\n".join(_peer_lines(summary)) + "\n" + sep + rest


def _peer_lines(summary: dict[str, Any]) -> list[str]:
    peers = summary["peers"]
    warnings = [f"- **{w}**" for w in peers.get("warnings", [])]
    return (
        (["", "## Warnings", "", *warnings] if warnings else [])
        + _group_lines(peers)
        + _goal_lines(peers)
        + _best_peer_lines(peers)
        + _equality_lines(peers)
        + _proof_lines(peers)
    )


def _proof_lines(peers: dict[str, Any]) -> list[str]:
    proof = peers.get("ec_load_proof")
    if not proof:
        return []
    lines = [
        "",
        "## Does vLLM-EPD's consumer use the stored encoder cache?",
        "",
        "Equal tokens cannot tell (a consumer that encodes the image itself gives the same tokens). For a fresh "
        "image the router's encoder step ran, the stored tensor "
        f"{proof.get('stored_shape', '')} was replaced by zeros, then the request went to the consumer.",
    ]
    if "tokens_with_zeroed_cache" in proof:
        lines += [
            "",
            f"- consumer with zeroed cache: `{proof['tokens_with_zeroed_cache'][:12]}`",
            *(f"- {model}: `{tokens[:12]}`" for model, tokens in proof["reference_tokens"].items()),
        ]
    lines += ["", f"Result: {'**proved**' if proof['proved'] else '**not proved**'}: {proof['reason']}."]
    return lines


def _group_lines(peers: dict[str, Any]) -> list[str]:
    lines = ["", "## Server groups (one at a time, started and stopped by the harness)", ""]
    for group in peers["groups"]:
        quiet = group.get("quiet")
        if quiet:
            lines.append(
                f"- before {group['group']}: waited {quiet['waited_s']:.0f} s for other work to leave the "
                f"CPUs (busy {quiet['busy_share_at_start']:.0%} when it started)"
            )
        if "error" in group:
            lines.append(
                f"- **{group['group']}** ({', '.join(group['modes'])}): did not start: {group['error'].splitlines()[0]}"
            )
            continue
        processes = group.get("processes")
        what = ("processes: " + ", ".join(processes)) if processes else "one tritonserver"
        lines.append(
            f"- **{group['group']}** ({', '.join(group['modes'])}): {group['server'].get('name')} "
            f"{group['server'].get('version')}; {what}; ready in {group['ready_s']:.0f} s, "
            f"sweep {group['sweep_s']:.0f} s, "
            f"equality pass {group['equality_s']:.0f} s, {group.get('wall_s', 0):.0f} s in all"
        )
    settings = peers["settings"]
    lines += [
        "",
        f"Peer engines get our `cpu` target's engine args {settings['engine_args']} and environment "
        f"{settings['vllm_env']}, as each of our engines does. Exact command lines: `summary.json` -> `peers.groups`.",
    ]
    return lines


def _goal_lines(peers: dict[str, Any]) -> list[str]:
    goals = peers["goals"]
    if not goals:
        return []
    lines = [
        "",
        "## Goals (ours, CPU)",
        "",
        "| goal | load | ours ms | peer ms | ratio | met | ours: top stages (mean) | peer: top stages (mean) |",
        "|---|---|---:|---:|---:|---|---|---|",
    ]
    for g in goals:
        lines.append(
            f"| {g['goal']} | {g['load_label']} | {_num(g['ours_ms'])} | {_num(g['peer_ms'])} | {g['ratio']:.2f} | "
            f"{'yes' if g['met'] else '**no**'} | {g['ours_stages']} | {g['peer_stages']} |"
        )
    return lines


def _best_peer_lines(peers: dict[str, Any]) -> list[str]:
    rows = peers["ratios_vs_best_peer"]
    if not rows:
        return []
    lines = [
        "",
        "## Ratios vs the best peer (same load point, same media policy; < 1 is faster for latencies, > 1 is more "
        "for throughput; C = vllm-colocated, E = vllm-epd was the best peer for that metric)",
        "",
        "| mode | load | " + " | ".join(title for _, title in RATIO_COLUMNS) + " |",
        "|---|---|" + "---:|" * len(RATIO_COLUMNS),
    ]
    for row in rows:
        cells = [
            f"{_num(row.get(key), 2)} {PEER_SHORT.get(row['best_peer'].get(key, ''), '')}".strip()
            for key, _ in RATIO_COLUMNS
        ]
        lines.append(f"| {row['mode']} | {row['load_label']} | " + " | ".join(cells) + " |")
    return lines


def _equality_lines(peers: dict[str, Any]) -> list[str]:
    eq = peers["equality"]
    if not eq["requests"]:
        return ["", "## Output equality", "", "No equality pass ran."]
    modes, models = eq["modes"], eq["models"]
    verdict = "identical" if eq["all_equal"] else "**not identical**"
    lines = [
        "",
        "## Output equality (greedy token ids, one request at a time, after the sweep)",
        "",
        f"{len(eq['requests'])} requests (fresh images, then images from the `:repeated` pool, cached by now where "
        f"the mode caches), each sent to every served model: output tokens {verdict} to `{eq['reference']}`'s across "
        f"{', '.join(f'`{m}`' for m in modes)}; prompt lengths "
        + ("identical" if eq["all_same_input_tokens"] else "**not identical**")
        + f" across modes; the peers' rendered chat prompt equal to ours in {eq['prompt_text_checked']} checks: "
        + ("yes" if eq["prompt_text_all_equal"] else "**no**")
        + ".",
        "",
        "Columns are the served models; a `repeated` row is that model's `:repeated` mode. `=`: the same token ids "
        f"as `{eq['reference']}`; `hits`: images served from our embedding store.",
        "",
        "| request | media | prompt tokens | " + " | ".join(models) + " |",
        "|---|---|---:|" + "---|" * len(models),
    ]
    for row in eq["requests"]:
        counts = sorted({c["num_input_tokens"] for c in row["models"].values() if not c["error"]})
        cells = []
        for model in models:
            cell = row["models"].get(model)
            if cell is None:
                cells.append("")
                continue
            if cell["error"]:
                text = f"error: {cell['error'][:60]}"
            else:
                text = "=" if cell["verdict"] == "equal" else cell["verdict"]
            if cell["cache_hits"]:
                text += f" (hits {cell['cache_hits']})"
            cells.append(text)
        counted = "/".join(str(c) for c in counts)
        lines.append(f"| {row['key']} | {row['policy']} | {counted} | " + " | ".join(cells) + " |")
    return lines

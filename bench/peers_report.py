"""Outputs of ``bench peers``: the usual files (summary.json, raw.json, results.csv, plots)
plus peers.csv (ratios against the best peer) and a results.md that starts with what the
peer comparison is for: the goals, the ratios against the best peer and output equality."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from bench.report import markdown, write_outputs

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
            writer.writerow({
                "mode": row["mode"], "load_label": row["load_label"],
                **{k: row.get(k) for k, _ in RATIO_COLUMNS},
                **{f"best_peer_{k}": row["best_peer"].get(k) for k, _ in RATIO_COLUMNS},
            })
    written.append(out / "peers.csv")
    if plots and summary["points"]:
        from bench.plots import write_peer_plots  # noqa: PLC0415 - matplotlib is slow to import

        written.extend(write_peer_plots(summary, out))
    names = [p.name for p in written if p.suffix == ".png"]
    (out / "results.md").write_text(peers_markdown(summary, names))
    return written


def peers_markdown(summary: dict[str, Any], plot_names: list[str] | None = None) -> str:
    """report.markdown's document with the peer sections after its header."""
    base = "\n".join(
        "- Servers: one group at a time, each started and stopped by the harness (below)" if line.startswith("- Server: ") else line
        for line in markdown(summary, plot_names).split("\n")
    )
    head, sep, rest = base.partition("\n## Latency and throughput")
    return head.rstrip("\n") + "\n" + "\n".join(_peer_lines(summary)) + "\n" + sep + rest


def _peer_lines(summary: dict[str, Any]) -> list[str]:
    peers = summary["peers"]
    warnings = [f"- **{w}**" for w in peers.get("warnings", [])]
    return (
        (["", "## Warnings", "", *warnings] if warnings else [])
        + _group_lines(peers) + _goal_lines(peers) + _best_peer_lines(peers) + _equality_lines(peers) + _proof_lines(peers)
    )


def _proof_lines(peers: dict[str, Any]) -> list[str]:
    proof = peers.get("ec_load_proof")
    if not proof:
        return []
    lines = ["", "## Does vLLM-EPD's consumer use the stored encoder cache?", "",
             "Equal tokens cannot tell (a consumer that encodes the image itself gives the same tokens). For a fresh "
             "image the router's encoder step ran, the stored tensor "
             f"{proof.get('stored_shape', '')} was replaced by zeros, then the request went to the consumer."]
    if "tokens_with_zeroed_cache" in proof:
        lines += ["", f"- consumer with zeroed cache: `{proof['tokens_with_zeroed_cache'][:12]}`",
                  *(f"- {model}: `{tokens[:12]}`" for model, tokens in proof["reference_tokens"].items())]
    lines += ["", f"Result: {'**proved**' if proof['proved'] else '**not proved**'}: {proof['reason']}."]
    return lines


def _group_lines(peers: dict[str, Any]) -> list[str]:
    lines = ["", "## Server groups (one at a time, started and stopped by the harness)", ""]
    for group in peers["groups"]:
        quiet = group.get("quiet")
        if quiet:
            lines.append(f"- before {group['group']}: waited {quiet['waited_s']:.0f} s for other work to leave the CPUs "
                         f"(busy {quiet['busy_share_at_start']:.0%} when it started)")
        if "error" in group:
            lines.append(f"- **{group['group']}** ({', '.join(group['modes'])}): did not start: {group['error'].splitlines()[0]}")
            continue
        processes = group.get("processes")
        what = ("processes: " + ", ".join(processes)) if processes else "one tritonserver"
        lines.append(
            f"- **{group['group']}** ({', '.join(group['modes'])}): {group['server'].get('name')} "
            f"{group['server'].get('version')}; {what}; ready in {group['ready_s']:.0f} s, sweep {group['sweep_s']:.0f} s, "
            f"equality pass {group['equality_s']:.0f} s, {group.get('wall_s', 0):.0f} s in all"
        )
    settings = peers["settings"]
    lines += [
        "",
        f"Peer engines get our `cpu` target's engine args {settings['engine_args']} and environment "
        f"{settings['vllm_env']}; vLLM-EPD's encoder {settings['encoder_env'] or 'default binding'} (our prefill's core), "
        f"its consumer {settings['consumer_env'] or 'default binding'} (our decode's core); the colocated engine keeps "
        "vLLM's default binding, as our `llm` does. Exact command lines: `summary.json` -> `peers.groups`.",
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
        + ("yes" if eq["prompt_text_all_equal"] else "**no**") + ".",
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
            text = "=" if cell["verdict"] == "equal" else cell["verdict"] if not cell["error"] else f"error: {cell['error'][:60]}"
            if cell["cache_hits"]:
                text += f" (hits {cell['cache_hits']})"
            cells.append(text)
        lines.append(f"| {row['key']} | {row['policy']} | {'/'.join(str(c) for c in counts)} | " + " | ".join(cells) + " |")
    return lines

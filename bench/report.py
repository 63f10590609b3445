"""Write a run's outputs: summary.json, raw.json, results.csv, results.md (+ plots)."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.metrics import PERCENTILES
from bench.path_choice import choice_lines
from builders.machine import one_line

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
STATS = ("mean", *(f"p{p}" for p in PERCENTILES))
SCALARS = (
    "requests",
    "errors",
    "not_sent",
    "request_throughput",
    "output_token_throughput",
    "goodput",
    "goodput_fraction",
    "request_throughput_per_instance",
    "output_token_throughput_per_instance",
    "mean_input_tokens",
    "mean_output_tokens",
    "cache_hits",
    "encodes",
    "cache_hits_reported",
    "max_dispatch_lag_ms",
)


def ran_points(summary: dict[str, Any]) -> Iterator[dict[str, Any]]:
    return (p for p in summary["points"] if p.get("status") == "ran")


def csv_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for point in ran_points(summary):
        s = point["summary"]
        row: dict[str, Any] = {k: point[k] for k in ("mode", "model", "load_kind", "load", "load_label")}
        row.update({k: s.get(k) for k in SCALARS})
        for latency in LATENCIES:
            row.update({f"{latency}_{stat}": s[latency][stat] for stat in STATS})
        row["client_cpu_ms_per_request"] = s["cpu"]["client_cpu_ms_per_request"]
        row["server_cpu_ms_per_request"] = s["cpu"]["server_cpu_ms_per_request"]
        row["other_processes_cpu_share"] = s["cpu"].get("other_processes_cpu_share")
        row["load_average_1m"] = s.get("load_average_1m")
        rows.append(row)
    return rows


def write_outputs(out: Path, summary: dict[str, Any], raw: list[dict[str, Any]], plots: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "summary.json", out / "raw.json", out / "results.csv", out / "results.md"]
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "raw.json").write_text(json.dumps({"records": raw}) + "\n")
    rows = csv_rows(summary)
    with open(out / "results.csv", "w", newline="") as handle:
        fields = list(rows[0]) if rows else ["mode"]
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    if plots and rows:
        from bench.plots import write_plots  # matplotlib is slow to import

        written.extend(write_plots(summary, out))
    (out / "results.md").write_text(markdown(summary, [p.name for p in written if p.suffix == ".png"]))
    return written


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _triple(dist: dict[str, float | None], keys: tuple[str, ...] = ("p50", "p90", "p99")) -> str:
    return " / ".join(_num(dist.get(k)) for k in keys)


def markdown(summary: dict[str, Any], plot_names: list[str] | None = None) -> str:
    meta = summary.get("meta", {})
    config = summary["config"]
    reps = config["reps"]
    lines = [f"# {meta.get('title', 'Benchmark')}", ""]
    if "machine" in meta:
        machine = meta["machine"]
        lines += [
            f"- Machine: {one_line(machine)}; load average at start {machine['load_average_1_5_15']}"
            + (f", at end {meta['load_average_end']}" if "load_average_end" in meta else "")
            + (" (shared machine: other work ran beside this)" if meta.get("shared_machine") else ""),
            f"- Packages: {', '.join(f'{k} {v}' for k, v in machine['packages'].items() if v)}; commit "
            f"{machine.get('git_commit')}",
        ]
    server = summary["server"]
    lines += [
        f"- Server: {server.get('name')} {server.get('version')} at {server['url']}"
        + (f", {meta['server_origin']}" if "server_origin" in meta else ""),
        f"- Command: `{meta['command']}`" if "command" in meta else "",
        f"- Workload: {_workload_text(config['workload'])}",
        f"- Per point: {config['warmup_requests']} warm-up requests (excluded"
        + ("; modes with reuse first send one per pool image" if config.get("prime_pool") else "")
        + f"), then {config['requests_per_point']} "
        f"measured requests x {reps} repetition(s), median reported; bounded by {config['max_seconds_per_point']:g} s "
        f"per point; run took {summary['run_wall_s']:.0f} s",
        _noise_line(summary),
        f"- **Halted**: {summary['halted']}; what was left is under Not measured" if summary.get("halted") else None,
        "",
        f"## Latency and throughput (median of {reps})",
        "",
        "| mode | load | ok / err | req/s | out tok/s | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 ms | "
        "ITL p50 / p99 ms | E2E p50 / p90 / p99 ms | goodput req/s | tok/s per instance | cache hits | encodes |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for point in ran_points(summary):
        s = point["summary"]
        lines.append(
            f"| {point['mode']} | {point['load_label']} | {_num(s['requests'])} / {_num(s['errors'])} | "
            f"{_num(s['request_throughput'], 2)} | {_num(s['output_token_throughput'], 1)} | {_triple(s['ttft_ms'])} | "
            f"{_triple(s['tpot_ms'], ('p50', 'p90'))} | {_triple(s['itl_ms'], ('p50', 'p99'))} | "
            f"{_triple(s['e2e_ms'])} | "
            f"{_num(s['goodput'], 2)} | {_num(s['output_token_throughput_per_instance'], 1)} | "
            f"{_num(s['cache_hits'])} | {_num(s['encodes'])} |"
        )
    choices = choice_lines(summary.get("adaptive_choices") or [])
    lines += _ratio_lines(summary) + choices + _stage_lines(summary) + _skipped_lines(summary) + _cost_lines(summary)
    if plot_names:
        lines += ["", "## Plots", "", *(f"![{name}]({name})" for name in plot_names)]
    return "\n".join(line for line in lines if line is not None) + "\n"


def _noise_line(summary: dict[str, Any]) -> str | None:
    limit = summary["config"].get("max_noise")
    if limit is None:
        return None
    redone = sum(
        int(rep.get("noisy_attempts_discarded") or 0) for p in ran_points(summary) for rep in p.get("reps", [])
    )
    return (
        f"- Noise guard: a repetition during which other processes took more than {limit:.0%} of the CPUs was measured "
        f"again with fresh requests (at most {summary['config'].get('noise_retries')} times); {redone} "
        "re-measurement(s) "
        "in this run; what was kept is in results.csv (`other_processes_cpu_share`)"
    )


def _workload_text(w: dict[str, Any]) -> str:
    media = (
        f"images from {w['image_dir']}"
        if w["image_dir"]
        else f"synthetic {w['image_format']} {', '.join(w['image_sizes'])}"
    )
    return (
        f"seed {w['seed']}; prompt {w['prompt_tokens']} tokens of text; output {w['output_tokens']} tokens "
        f"(ignore_eos={w['ignore_eos']}, temperature {w['temperature']}); {w['images_per_request']} image(s) per "
        "request, "
        f"{media}; reuse ratio {w['reuse_ratio']} (`:repeated` modes {w['repeated_reuse_ratio']}, pool of "
        f"{w['media_pool_size']})"
        + (
            f"; media salt `{w['media_salt']}` (repeat with `--media-salt {w['media_salt']}`)"
            if w.get("media_salt")
            else ""
        )
    )


def _ratio_lines(summary: dict[str, Any]) -> list[str]:
    ratios = summary.get("ratios_vs_baseline") or []
    if not ratios:
        return []
    base = summary["config"]["baseline"]
    lines = [
        "",
        f"## Ratios vs `{base}` (same load point; < 1 is faster for latencies, > 1 is more for throughput)",
        "",
        "| mode | load | TTFT p50 | TTFT p90 | TPOT p50 | E2E p50 | E2E p90 | req/s | tok/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in ratios:
        cells = [
            r[k]
            for k in (
                "ttft_ms_p50",
                "ttft_ms_p90",
                "tpot_ms_p50",
                "e2e_ms_p50",
                "e2e_ms_p90",
                "request_throughput",
                "output_token_throughput",
            )
        ]
        lines.append(f"| {r['mode']} | {r['load_label']} | " + " | ".join(_num(c, 2) for c in cells) + " |")
    agreement = summary.get("token_agreement_vs_baseline") or {}
    if agreement:
        lines += [
            "",
            f"Greedy output tokens equal to `{base}` for the same request: "
            + ", ".join(f"{k}: {_num(v * 100 if v is not None else None)}%" for k, v in agreement.items()),
        ]
    return lines


def _stage_lines(summary: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Stage breakdown (mean ms per request, share of request time)",
        "",
        "| mode | load | source | stages |",
        "|---|---|---|---|",
    ]
    for point in ran_points(summary):
        stages = point["stages"]
        cells = ", ".join(
            f"{name} {ms:.0f}" + (f" ({stages['share'][name]:.0%})" if name in stages.get("share", {}) else "")
            for name, ms in stages["ms"].items()
        )
        lines.append(f"| {point['mode']} | {point['load_label']} | {stages['source']} | {cells} |")
    readings = [m["reading"] for m in summary["modes"] if m.get("reading")]
    if readings:
        lines += ["", "Disaggregate or not:", "", *(f"- {r}" for r in readings)]
    return lines


def _skipped_lines(summary: dict[str, Any]) -> list[str]:
    skipped = [m for m in summary["modes"] if m["status"] == "skipped"]
    not_run = [p for p in summary["points"] if p.get("status", "").startswith("not run")]
    if not skipped and not not_run:
        return []
    return [
        "",
        "## Not measured",
        "",
        *(f"- mode `{m['label']}`: {m['reason']}" for m in skipped),
        *(f"- `{p['mode']}` {p['load_label']}: {p['status']}" for p in not_run),
    ]


def _cost_lines(summary: dict[str, Any]) -> list[str]:
    cost = summary["harness_cost"]
    server = cost["server_cpu_ms_per_request"]
    verdict = (
        f"{cost['client_share_of_server_cpu']:.1%} of the server's"
        if cost.get("client_share_of_server_cpu") is not None
        else "server CPU not measured (no server pid)"
    )
    lines = [
        "",
        "## Harness cost (is the load generator the bottleneck?)",
        "",
        f"Over {cost['requests']} measured requests the load generator used {cost['client_cpu_ms_per_request']:.2f} ms "
        f"of CPU per request, the server process tree {_num(server, 1)} ms: {verdict}.",
    ]
    if cost.get("other_processes_cpu_share_mean") is not None:
        lines += [
            "",
            f"Noise: other processes on this machine took {cost['other_processes_cpu_share_mean']:.0%} of its CPU on "
            f"average during the measured windows (worst window {cost['other_processes_cpu_share_max']:.0%}); "
            "per-point values are in results.csv (`other_processes_cpu_share`).",
        ]
    return lines

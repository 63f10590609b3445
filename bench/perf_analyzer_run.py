"""perf_analyzer against a running server, next to our harness on the same requests.

    python -m bench.perf_analyzer_run --url localhost:8001 --out results/latest/perf-analyzer
    python -m bench.perf_analyzer_run --out results/latest/perf-analyzer   (make bench-perf-analyzer)

Without ``--url`` it starts its own tritonserver (cpu target, the default repository, free ports;
log: ``OUT/server.log``) and stops it at the end.

One set of seeded requests (``bench.workload``) is written as perf_analyzer ``--input-data``
(``bench.perf_analyzer``) and also sent by our harness (``bench.triton_target``), so both play
the same entries. Per (model, concurrency, shared memory): perf_analyzer (the build ``make
tools`` installs) with ``-i grpc --streaming`` and count windows; its CSV (throughput, p50
latency), its profile export (requests recorded, each with its response times) and Triton's
success/failure counters around the run.

Then the comparison on ``--compare-model`` at concurrency 1, like with like: after one untimed
pass of every entry (so that neither client meets a cold entry), ``--compare-rounds`` rounds that
each run perf_analyzer and then the harness on the same entries (the order alternates from round
to round), so that both see the same load on a shared machine, and the first-response times of
perf_analyzer's exports are pooled against the harness's TTFTs (and last response against e2e).
:func:`comparison` says which is compared with which, and why.

Writes ``results.json`` and ``results.md`` (with the command) under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import shlex
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.perf_analyzer import write_inputs
from bench.perf_analyzer_tool import PerfAnalyzer, locate, version_of
from bench.server_stats import scrape
from builders.tritonserver import REPO_ROOT

# A shared, noisy machine rarely gives perf_analyzer three windows within its default 10%: keep its
# numbers (reported with their spread) instead of failing the run.
STABILITY_PERCENT = 1000
# perf_analyzer 2.41's shared memory refuses a model with an optional input the data leaves out:
# ``llm`` declares ``image_embeds``/``image_grid_thw`` (by-value embeddings), which an image request
# cannot also carry. ``epd``: its ``errors_as_outputs`` is filled with ``false``
# (bench.perf_analyzer.data_entry), but since e681360 it also declares ``video``, which an image
# request leaves out (refused again at 07:40 on 2026-12-01; see tests/server/test_perf_analyzer.py).
SHM_MODELS: tuple[str, ...] = ()


def counters(metrics_url: str, model: str) -> dict[str, float]:
    snapshot = scrape(metrics_url)
    counts = {"success": 0.0, "failure": 0.0}
    for (name, labels), value in (snapshot.counters if snapshot else {}).items():
        if dict(labels).get("model") != model:
            continue
        if name == "nv_inference_request_success":
            counts["success"] += value
        elif name == "nv_inference_request_failure":
            counts["failure"] += value
    return counts


def perf_analyzer_command(
    tool: PerfAnalyzer, model: str, url: str, inputs: Path, concurrency: int, shared_memory: bool, out: Path, count: int
) -> list[str]:
    command = [
        str(tool.binary), "-m", model, "-i", "grpc", "-u", url, "--streaming", "--input-data", str(inputs),
        "--concurrency-range", str(concurrency), "--measurement-mode", "count_windows",
        "--measurement-request-count", str(count), "--max-trials", "3",
        "--stability-percentage", str(STABILITY_PERCENT),
        "-f", str(out / "report.csv"), "--profile-export-file", str(out / "profile.json"),
    ]  # fmt: skip
    if shared_memory:  # BYTES outputs have no fixed size: a region size per output
        command += ["--shared-memory", "system", "--output-shared-memory-size", "65536"]
    return command


def read_run(out: Path) -> dict[str, Any]:
    """perf_analyzer's CSV row and what its profile export recorded."""
    rows = list(csv.DictReader((out / "report.csv").open()))
    exported = json.loads((out / "profile.json").read_text())
    requests = [r for experiment in exported["experiments"] for r in experiment["requests"]]
    first_ms = [(r["response_timestamps"][0] - r["timestamp"]) / 1e6 for r in requests if r["response_timestamps"]]
    last_ms = [(r["response_timestamps"][-1] - r["timestamp"]) / 1e6 for r in requests if r["response_timestamps"]]
    row = rows[-1]
    return {
        "infer_per_s": float(row["Inferences/Second"]),
        "p50_latency_ms": float(row["p50 latency"]) / 1000.0,
        "requests_recorded": len(requests),
        "requests_without_response": sum(1 for r in requests if not r["response_timestamps"]),
        "export_first_response_p50_ms": statistics.median(first_ms) if first_ms else None,
        "export_last_response_p50_ms": statistics.median(last_ms) if last_ms else None,
        "export_first_response_ms": [round(x, 3) for x in first_ms],
        "export_last_response_ms": [round(x, 3) for x in last_ms],
    }


def run_perf_analyzer(
    tool: PerfAnalyzer,
    args: argparse.Namespace,
    model: str,
    inputs: Path,
    concurrency: int,
    shm: bool,
    name: str | None = None,
) -> dict[str, Any]:
    out = args.out / "runs" / (name or f"{model}-c{concurrency}{'-shm' if shm else ''}")
    out.mkdir(parents=True, exist_ok=True)
    command = perf_analyzer_command(tool, model, args.url, inputs, concurrency, shm, out, args.window_requests)
    before = counters(args.metrics_url, model)
    done = subprocess.run(command, env=tool.env(), capture_output=True, text=True, timeout=args.timeout_s)
    after = counters(args.metrics_url, model)
    (out / "stdout.txt").write_text(done.stdout + done.stderr)
    result: dict[str, Any] = {
        "model": model, "concurrency": concurrency, "shared_memory": "system" if shm else "none",
        "exit_code": done.returncode, "command": shlex.join(command),
        "server_success": after["success"] - before["success"],
        "server_failure": after["failure"] - before["failure"],
    }  # fmt: skip
    if done.returncode == 0:
        result.update(read_run(out))
    else:
        result["error"] = (done.stdout + done.stderr)[-1500:]
    return result


async def harness_pass(url: str, model: str, requests: Sequence[Any], reps: int) -> dict[str, Any]:
    """Our harness on ``requests`` at concurrency 1, ``reps`` times: its TTFT and e2e per request
    (``bench.metrics``: from the call that opens the request's stream to its first / last response
    with output)."""
    from bench.loadgen import closed_loop
    from bench.metrics import e2e_s, ttft_s
    from bench.triton_target import TritonGrpcTarget

    target = TritonGrpcTarget(url)
    try:
        prepared = [target.prepare(r, model) for r in requests]
        records = []
        for _ in range(reps):
            records += (await closed_loop(lambda p: target.send(model, p, 600), prepared, 1, 600, lambda: None)).records
    finally:
        await target.close()
    ok = [r for r in records if r.ok]
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "ttft_ms": [round(ttft_s(r) * 1000.0, 3) for r in ok],
        "e2e_ms": [round(e2e_s(r) * 1000.0, 3) for r in ok],
    }


def compare_rounds(
    tool: PerfAnalyzer, args: argparse.Namespace, model: str, inputs: Path, requests: Sequence[Any]
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """perf_analyzer and the harness on ``model`` at c=1, interleaved (see the module docstring):
    the rounds, perf_analyzer's pooled numbers (shaped like a run) and the harness's."""
    asyncio.run(harness_pass(args.url, model, requests, 1))  # every entry once, untimed
    rounds = []
    for i in range(args.compare_rounds):
        print(f"[compare] {model} round {i}", file=sys.stderr, flush=True)
        steps = ["perf_analyzer", "harness"] if i % 2 == 0 else ["harness", "perf_analyzer"]
        row: dict[str, Any] = {"round": i, "order": steps}
        for step in steps:
            if step == "perf_analyzer":
                row["perf_analyzer"] = run_perf_analyzer(tool, args, model, inputs, 1, False, f"compare-{model}-r{i}")
            else:
                row["harness"] = asyncio.run(harness_pass(args.url, model, requests, args.harness_reps))
        rounds.append(row)
    ran = [r["perf_analyzer"] for r in rounds if not r["perf_analyzer"]["exit_code"]]
    first = [x for run in ran for x in run["export_first_response_ms"]]
    last = [x for run in ran for x in run["export_last_response_ms"]]
    pooled_pa = {
        "p50_latency_ms": statistics.median(run["p50_latency_ms"] for run in ran) if ran else None,
        "export_first_response_p50_ms": statistics.median(first) if first else None,
        "export_last_response_p50_ms": statistics.median(last) if last else None,
        "requests_recorded": len(first),
    }
    ttft = [x for r in rounds for x in r["harness"]["ttft_ms"]]
    e2e = [x for r in rounds for x in r["harness"]["e2e_ms"]]
    pooled_harness = {
        "requests": sum(r["harness"]["requests"] for r in rounds),
        "errors": sum(r["harness"]["errors"] for r in rounds),
        "ttft_p50_ms": statistics.median(ttft) if ttft else None,
        "e2e_p50_ms": statistics.median(e2e) if e2e else None,
    }
    return rounds, pooled_pa, pooled_harness


def round_ratios(rounds: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per round: perf_analyzer's first/last-response p50 over the harness's TTFT/e2e p50."""
    out = []
    for r in rounds:
        pa, h = r["perf_analyzer"], r["harness"]
        if pa["exit_code"] or not h["ttft_ms"]:
            continue
        ttft, e2e = statistics.median(h["ttft_ms"]), statistics.median(h["e2e_ms"])
        first, last = pa["export_first_response_p50_ms"], pa["export_last_response_p50_ms"]
        out.append({
            "round": r["round"], "order": " then ".join(r["order"]),
            "perf_analyzer_first_p50_ms": first, "harness_ttft_p50_ms": ttft, "first_vs_ttft": first / ttft,
            "perf_analyzer_last_p50_ms": last, "harness_e2e_p50_ms": e2e, "last_vs_e2e": last / e2e,
        })  # fmt: skip
    return out


def comparison(model: str, base: dict[str, Any], harness: dict[str, Any]) -> dict[str, Any]:
    """perf_analyzer's numbers next to the harness's, like with like.

    perf_analyzer 2.41 prints "using the first response for measuring latency" for a decoupled
    model, but which response its CSV percentiles measure is read off its own export here: the
    export's first- and last-response p50 of the same requests, whichever the CSV p50 is closer to.
    Then the first-response p50 is compared with our TTFT p50 and the last-response p50 with our
    end-to-end p50 (15% is the agreement asked for)."""
    p50, first, last = base["p50_latency_ms"], base["export_first_response_p50_ms"], base["export_last_response_p50_ms"]
    measures = "last response" if abs(p50 / last - 1) < abs(p50 / first - 1) else "first response"
    first_vs_ttft = first / harness["ttft_p50_ms"]
    last_vs_e2e = last / harness["e2e_p50_ms"]

    def verdict(ratio: float) -> str:
        return "within" if abs(ratio - 1) <= 0.15 else "outside"

    return {
        "model": model,
        "perf_analyzer_p50_ms": p50,
        "export_first_response_p50_ms": first,
        "export_last_response_p50_ms": last,
        "csv_p50_measures": measures,
        "harness": harness,
        "harness_ttft_p50_ms": harness["ttft_p50_ms"],
        "harness_e2e_p50_ms": harness["e2e_p50_ms"],
        "ratio_vs_ttft": p50 / harness["ttft_p50_ms"],
        "ratio_vs_e2e": p50 / harness["e2e_p50_ms"],
        "ratio_first_response_vs_ttft": first_vs_ttft,
        "ratio_last_response_vs_e2e": last_vs_e2e,
        "reading": (
            f"perf_analyzer's CSV p50 ({p50:.1f} ms) is its {measures} latency (export: first {first:.1f}, last "
            f"{last:.1f} ms). Like with like: first response / our TTFT p50 = {first_vs_ttft:.2f} "
            f"({verdict(first_vs_ttft)} 15%); last response / our e2e p50 = {last_vs_e2e:.2f} "
            f"({verdict(last_vs_e2e)} 15%)."
        ),
    }


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        "# perf_analyzer against triton-epd", "", f"Command: `{summary['command']}`", "",
        f"perf_analyzer: {summary['perf_analyzer']} (`make tools`); gRPC streaming, count windows of "
        f"{summary['window_requests']} requests (stability check off: shared 2-core machine); inputs: "
        f"{summary['inputs']}. No run uses `--shared-memory system`: perf_analyzer 2.41 refuses shared "
        "memory for a model with an optional input the data leaves out (`llm`: `image_embeds`; `epd`: "
        "`video`).", "",
        "| model | c | shm | exit | infer/s | p50 latency ms | recorded | no response | server ok | server failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in summary["runs"]:
        lines.append(
            f"| {r['model']} | {r['concurrency']} | {r['shared_memory']} | {r['exit_code']} | "
            f"{r.get('infer_per_s', 0):.2f} | {r.get('p50_latency_ms', 0):.1f} | {r.get('requests_recorded', '-')} | "
            f"{r.get('requests_without_response', '-')} | {r['server_success']:.0f} | {r['server_failure']:.0f} |"
        )
    c = summary.get("comparison")
    if c:
        lines += [
            "", f"## `{c['model']}`, concurrency 1: perf_analyzer vs our harness, same requests, interleaved", "",
            f"{len(c['rounds'])} rounds, each perf_analyzer (count windows) and the harness ({c['harness_reps']} "
            "passes over the entries) one after the other, the order alternating; one untimed pass of every entry "
            f"before. Pooled: perf_analyzer {c['perf_analyzer_requests']} requests recorded, harness "
            f"{c['harness']['requests']} requests ({c['harness']['errors']} errors).", "",
            "| measure | ms | perf_analyzer CSV p50 / this |", "|---|---|---|",
            f"| perf_analyzer CSV p50 latency (median of the rounds) | {c['perf_analyzer_p50_ms']:.1f} | 1.00 |",
            f"| perf_analyzer export, first response p50 | {c['export_first_response_p50_ms']:.1f} | "
            f"{c['perf_analyzer_p50_ms'] / c['export_first_response_p50_ms']:.3f} |",
            f"| perf_analyzer export, last response p50 | {c['export_last_response_p50_ms']:.1f} | "
            f"{c['perf_analyzer_p50_ms'] / c['export_last_response_p50_ms']:.3f} |",
            f"| harness TTFT p50 | {c['harness_ttft_p50_ms']:.1f} | {c['ratio_vs_ttft']:.3f} |",
            f"| harness e2e p50 | {c['harness_e2e_p50_ms']:.1f} | {c['ratio_vs_e2e']:.3f} |",
            "", "| like with like (pooled) | perf_analyzer ms | harness ms | ratio |", "|---|---|---|---|",
            f"| first response vs TTFT p50 | {c['export_first_response_p50_ms']:.1f} | "
            f"{c['harness_ttft_p50_ms']:.1f} | {c['ratio_first_response_vs_ttft']:.3f} |",
            f"| last response vs e2e p50 | {c['export_last_response_p50_ms']:.1f} | "
            f"{c['harness_e2e_p50_ms']:.1f} | {c['ratio_last_response_vs_e2e']:.3f} |",
            "", "| round | order | PA first p50 | harness TTFT p50 | ratio | PA last p50 | harness e2e p50 | ratio |",
            "|---|---|---|---|---|---|---|---|",
        ]  # fmt: skip
        for r in c["rounds"]:
            lines.append(
                f"| {r['round']} | {r['order']} | {r['perf_analyzer_first_p50_ms']:.1f} | "
                f"{r['harness_ttft_p50_ms']:.1f} | {r['first_vs_ttft']:.3f} | {r['perf_analyzer_last_p50_ms']:.1f} | "
                f"{r['harness_e2e_p50_ms']:.1f} | {r['last_vs_e2e']:.3f} |"
            )
        lines += ["", c["reading"]]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    from bench.cli_args import workload_arguments

    parser = argparse.ArgumentParser(prog="python -m bench.perf_analyzer_run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="Triton gRPC HOST:PORT (default: start a server here)")
    parser.add_argument("--metrics-url", help="default: http://HOST:8002/metrics")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "latest" / "perf-analyzer")
    parser.add_argument("--count", type=int, default=8, help="data entries (perf_analyzer plays them round robin)")
    parser.add_argument("--runs", nargs="+", default=["llm:1", "llm:2", "epd:1", "epd:2", "epd:4"],
                        help="MODEL:CONCURRENCY, also with system shared memory where perf_analyzer can")  # fmt: skip
    parser.add_argument("--window-requests", type=int, default=16)
    parser.add_argument("--compare-model", default="llm")
    parser.add_argument(
        "--compare-rounds",
        type=int,
        default=4,
        help="interleaved perf_analyzer/harness rounds on --compare-model at c=1 (0: none)",
    )
    parser.add_argument("--harness-reps", type=int, default=3, help="harness passes over the entries per round")
    parser.add_argument("--timeout-s", type=float, default=600)
    workload_arguments(parser)
    args = parser.parse_args(argv)
    if args.url:
        args.metrics_url = args.metrics_url or f"http://{args.url.rpartition(':')[0]}:8002/metrics"
    return args


@contextlib.contextmanager
def server_for(args: argparse.Namespace, timeout_s: float = 900, start_attempts: int = 2) -> Iterator[None]:
    """``args.url``'s server, or one started here (and stopped afterwards) when none was given."""
    if args.url:
        yield
        return
    from builders.launcher import prepare
    from builders.processes import StartError
    from builders.tritonserver import Ports, ServerOptions, TritonServer

    repository = REPO_ROOT / "model_repository"
    prepare("cpu", None, repository)
    args.out.mkdir(parents=True, exist_ok=True)
    for attempt in range(start_attempts):
        # A loaded shared machine sometimes fails a model's load (a python-backend stub launch that
        # TritonServer gives up on after 60 s, d36e5fe); one more start, on new ports, before giving up.
        log = args.out / ("server.log" if attempt == 0 else f"server-{attempt + 1}.log")
        server = TritonServer(ServerOptions(repository, Ports.free()), log)
        try:
            server.start()
            server.wait_ready(timeout_s=timeout_s)
        except StartError as exc:
            server.stop()
            if attempt + 1 == start_attempts:
                raise
            print(f"[server] start {attempt + 1} failed, starting again: {str(exc)[:300]}", file=sys.stderr)
            continue
        try:
            args.url, args.metrics_url = server.grpc_url, server.metrics_url
            yield
        finally:
            server.stop()
        return


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    tool, reason = locate()
    if tool is None:
        print(reason, file=sys.stderr)
        return 2
    with server_for(args):
        return measure(args, argv, tool)


def measure(args: argparse.Namespace, argv: Sequence[str], tool: PerfAnalyzer) -> int:
    from bench.cli import _declared_inputs
    from bench.cli_args import workload_spec
    from bench.workload import WorkloadBuilder

    spec = workload_spec(args)
    requests = WorkloadBuilder(spec).build(args.count, spec.reuse_ratio, phase="perf_analyzer")
    models = sorted({run.split(":")[0] for run in args.runs} | {args.compare_model})
    # Only the inputs each model declares, ``epd``'s ``errors_as_outputs`` filled in (shared memory).
    declared = asyncio.run(_declared_inputs(args.url, models))
    write_inputs(requests, args.out / "inputs", models, "binary", declared, args.url)
    runs = []
    for run in args.runs:
        model, concurrency = run.split(":")
        for shm in (False, True) if model in SHM_MODELS else (False,):
            print(f"[perf_analyzer] {model} c={concurrency} shm={shm}", file=sys.stderr, flush=True)
            inputs = args.out / "inputs" / f"{model}.json"
            runs.append(run_perf_analyzer(tool, args, model, inputs, int(concurrency), shm))
    summary: dict[str, Any] = {
        "command": "python -m bench.perf_analyzer_run " + shlex.join(argv),
        "perf_analyzer": version_of(tool),
        "window_requests": args.window_requests,
        "inputs": f"{args.count} requests, seed {args.seed}, images {' '.join(args.image_size)}, "
        f"output tokens {args.output_tokens}",
        "runs": runs,
    }
    if args.compare_rounds:
        model = args.compare_model
        rounds, pooled_pa, pooled_harness = compare_rounds(
            tool, args, model, args.out / "inputs" / f"{model}.json", requests
        )
        if pooled_pa["requests_recorded"] and pooled_harness["ttft_p50_ms"] is not None:
            summary["comparison"] = {
                **comparison(model, pooled_pa, pooled_harness),
                "perf_analyzer_requests": pooled_pa["requests_recorded"],
                "rounds": round_ratios(rounds),
                "harness_reps": args.harness_reps,
            }
        summary["compare_rounds"] = rounds
    (args.out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown(summary))
    print((args.out / "results.md").read_text())
    compared = [r["perf_analyzer"] for r in summary.get("compare_rounds", [])]
    failed = [
        r for r in runs + compared if r["exit_code"] != 0 or r["server_failure"] or r.get("requests_without_response")
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

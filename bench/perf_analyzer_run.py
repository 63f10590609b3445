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
success/failure counters around the run. Right after perf_analyzer's run of ``--compare-model``
at concurrency 1, the harness on the same requests at concurrency 1: its TTFT and e2e p50 next to
perf_analyzer's p50 and the first- and last-response p50 of perf_analyzer's own export
(:func:`comparison` says which is compared with which, and why).

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
# cannot also carry, and ``epd`` declares ``errors_as_outputs`` (for BLS callers), which these
# inputs leave out (2026-12-01: perf_analyzer stopped with "does not support optional inputs").
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
    }


def run_perf_analyzer(
    tool: PerfAnalyzer, args: argparse.Namespace, model: str, inputs: Path, concurrency: int, shm: bool
) -> dict[str, Any]:
    out = args.out / "runs" / f"{model}-c{concurrency}{'-shm' if shm else ''}"
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


async def harness_ttft(url: str, model: str, requests: Sequence[Any], reps: int) -> dict[str, Any]:
    from bench.loadgen import closed_loop
    from bench.metrics import e2e_s, ttft_s
    from bench.triton_target import TritonGrpcTarget

    target = TritonGrpcTarget(url)
    try:
        prepared = [target.prepare(r, model) for r in requests]
        await closed_loop(lambda p: target.send(model, p, 600), prepared[:2], 1, 600, lambda: None)  # warm-up
        records = []
        for _ in range(reps):
            records += (await closed_loop(lambda p: target.send(model, p, 600), prepared, 1, 600, lambda: None)).records
    finally:
        await target.close()
    ok = [r for r in records if r.ok]
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "ttft_p50_ms": statistics.median(ttft_s(r) for r in ok) * 1000.0,
        "e2e_p50_ms": statistics.median(e2e_s(r) for r in ok) * 1000.0,
    }


def is_base(run: dict[str, Any], model: str) -> bool:
    """The run the harness is compared with: ``model`` at concurrency 1, no shared memory, exit 0."""
    return run["model"] == model and run["concurrency"] == 1 and run["shared_memory"] == "none" and not run["exit_code"]


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
        "`errors_as_outputs`).", "",
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
            "", f"## `{c['model']}`, concurrency 1: perf_analyzer vs our harness, same requests", "",
            "| measure | ms | perf_analyzer p50 / this |", "|---|---|---|",
            f"| perf_analyzer p50 latency | {c['perf_analyzer_p50_ms']:.1f} | 1.00 |",
            f"| harness TTFT p50 | {c['harness_ttft_p50_ms']:.1f} | {c['ratio_vs_ttft']:.3f} |",
            f"| harness e2e p50 | {c['harness_e2e_p50_ms']:.1f} | {c['ratio_vs_e2e']:.3f} |",
            f"| perf_analyzer export, first response p50 | {c['export_first_response_p50_ms']:.1f} | "
            f"{c['perf_analyzer_p50_ms'] / c['export_first_response_p50_ms']:.3f} |",
            f"| perf_analyzer export, last response p50 | {c['export_last_response_p50_ms']:.1f} | "
            f"{c['perf_analyzer_p50_ms'] / c['export_last_response_p50_ms']:.3f} |",
            "", "| like with like | perf_analyzer ms | harness ms | ratio |", "|---|---|---|---|",
            f"| first response vs TTFT p50 | {c['export_first_response_p50_ms']:.1f} | "
            f"{c['harness_ttft_p50_ms']:.1f} | {c['ratio_first_response_vs_ttft']:.3f} |",
            f"| last response vs e2e p50 | {c['export_last_response_p50_ms']:.1f} | "
            f"{c['harness_e2e_p50_ms']:.1f} | {c['ratio_last_response_vs_e2e']:.3f} |",
            "", c["reading"],
        ]  # fmt: skip
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    from bench.cli import _workload_arguments

    parser = argparse.ArgumentParser(prog="python -m bench.perf_analyzer_run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="Triton gRPC HOST:PORT (default: start a server here)")
    parser.add_argument("--metrics-url", help="default: http://HOST:8002/metrics")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "latest" / "perf-analyzer")
    parser.add_argument("--count", type=int, default=8, help="data entries (perf_analyzer plays them round robin)")
    parser.add_argument("--runs", nargs="+", default=["llm:1", "llm:2", "epd:1", "epd:2", "epd:4"],
                        help="MODEL:CONCURRENCY, also with system shared memory where perf_analyzer can")  # fmt: skip
    parser.add_argument("--window-requests", type=int, default=16)
    parser.add_argument("--compare-model", default="llm")
    parser.add_argument("--harness-reps", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=600)
    _workload_arguments(parser)
    args = parser.parse_args(argv)
    if args.url:
        args.metrics_url = args.metrics_url or f"http://{args.url.rpartition(':')[0]}:8002/metrics"
    return args


@contextlib.contextmanager
def server_for(args: argparse.Namespace, timeout_s: float = 900) -> Iterator[None]:
    """``args.url``'s server, or one started here (and stopped afterwards) when none was given."""
    if args.url:
        yield
        return
    from builders.launcher import prepare
    from builders.tritonserver import Ports, ServerOptions, TritonServer

    repository = REPO_ROOT / "model_repository"
    prepare("cpu", None, repository)
    args.out.mkdir(parents=True, exist_ok=True)
    with TritonServer(ServerOptions(repository, Ports.free()), args.out / "server.log") as server:
        server.wait_ready(timeout_s=timeout_s)
        args.url, args.metrics_url = server.grpc_url, server.metrics_url
        yield


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
    from bench.cli import _workload_spec
    from bench.workload import WorkloadBuilder

    spec = _workload_spec(args)
    requests = WorkloadBuilder(spec).build(args.count, spec.reuse_ratio, phase="perf_analyzer")
    models = sorted({run.split(":")[0] for run in args.runs} | {args.compare_model})
    write_inputs(requests, args.out / "inputs", models, "binary", None, args.url)
    runs = []
    harness: dict[str, Any] | None = None
    for run in args.runs:
        model, concurrency = run.split(":")
        for shm in (False, True) if model in SHM_MODELS else (False,):
            print(f"[perf_analyzer] {model} c={concurrency} shm={shm}", file=sys.stderr, flush=True)
            inputs = args.out / "inputs" / f"{model}.json"
            runs.append(run_perf_analyzer(tool, args, model, inputs, int(concurrency), shm))
            if harness is None and is_base(runs[-1], args.compare_model):
                # At once, so that both see the same load on a shared machine.
                harness = asyncio.run(harness_ttft(args.url, args.compare_model, requests, args.harness_reps))
    summary: dict[str, Any] = {
        "command": "python -m bench.perf_analyzer_run " + shlex.join(argv),
        "perf_analyzer": version_of(tool),
        "window_requests": args.window_requests,
        "inputs": f"{args.count} requests, seed {args.seed}, images {' '.join(args.image_size)}, "
        f"output tokens {args.output_tokens}",
        "runs": runs,
    }
    base = next((r for r in runs if is_base(r, args.compare_model)), None)
    if base is not None and harness is not None:
        summary["comparison"] = comparison(args.compare_model, base, harness)
    (args.out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown(summary))
    print((args.out / "results.md").read_text())
    failed = [r for r in runs if r["exit_code"] != 0 or r["server_failure"] or r.get("requests_without_response")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""AIPerf, our harness and perf_analyzer on the same requests, one run on one machine.

    python -m bench.aiperf_run --out results/latest/aiperf   (make bench-aiperf)

Starts our server (tritonserver + ``client.openai_server``, as ``bench.vllm_bench_serve`` does),
builds one seeded set of image requests (``bench.workload``), sends every one of them once,
untimed, so that no client meets a cold image (``epd``'s embedding store and vLLM's caches then
hold them for all clients alike), and then, per model and concurrency, one client after the other
on those same requests (closed loop, each request once):

* ``aiperf`` -> our OpenAI API (``/v1/chat/completions``): AIPerf 0.13.0 (``make aiperf-tools``)
  sending our harness's chat bodies verbatim (``bench.aiperf``);
* ``harness`` -> our OpenAI API: ``bench.openai_target``, as ``python -m bench run`` does for an
  OpenAI server;
* ``aiperf`` -> Triton HTTP (``/v2/models/<model>/generate_stream``): AIPerf's ``raw`` endpoint,
  perf_analyzer's entries as JSON bodies (AIPerf has no Triton endpoint type of its own);
* ``harness`` -> Triton gRPC: ``bench.triton_target`` (streaming);
* ``perf_analyzer`` -> Triton gRPC (streaming): ``make tools``'s build, count windows whose
  three together are the requests once (its request timestamps read from its own export).

``--reps`` times, the clients' order rotated each time; the table gives the median of the
repetitions. Beside each client's numbers, the CPU it and the server took within its measured
window (``bench.cpu_sampler``): on a small machine a client's own CPU slows the server it measures.

Writes ``results.json`` (every repetition too), ``results.md`` and ``COMMAND.md`` under ``--out``;
each client's raw output under ``OUT/raw/<client>-<endpoint>-<model>-c<N>-r<rep>/``.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.aiperf import (
    EXPORT_FILE,
    chat_payloads,
    generate_payloads,
    locate,
    profile_command,
    read_export,
    write_inputs_json,
    write_raw_payloads,
)
from bench.cpu_sampler import CLIENT, SERVER, CpuSampler
from builders.tritonserver import REPO_ROOT

MODELS = ("epd", "llm")
# (client, endpoint) in the order they run at each point.
CLIENTS = (
    ("aiperf", "openai"),
    ("harness", "openai"),
    ("aiperf", "triton-http"),
    ("harness", "triton-grpc"),
    ("perf_analyzer", "triton-grpc"),
)
COLUMNS = (  # row key -> header
    ("req_per_s", "req/s"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("itl_p50_ms", "ITL/TPOT p50 ms"),
    ("e2e_p50_ms", "E2E p50 ms"),
    ("output_tokens_mean", "out tok/req"),
    ("cpu_s", "client CPU s"),
    ("client_cores", "client cores"),
    ("server_cores", "server cores"),
    ("wall_s", "wall s"),
)


def client_name(client: str, endpoint: str) -> str:
    return f"{client}-{endpoint}"


def harness_row(summary: dict[str, Any]) -> dict[str, Any]:
    """Our row from ``bench.metrics.summarize`` (TPOT: (e2e - TTFT) / (tokens - 1), as AIPerf's ITL)."""
    return {
        "completed": summary["requests"],
        "failed": summary["errors"],
        "req_per_s": summary["request_throughput"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "itl_p50_ms": summary["tpot_ms"]["p50"],
        "e2e_p50_ms": summary["e2e_ms"]["p50"],
        "output_tokens_mean": summary["mean_output_tokens"],
    }


def perf_analyzer_row(run_dir: Path) -> dict[str, Any]:
    """Our row from perf_analyzer's CSV (throughput) and profile export (per request: first and
    last response after the send; the gap per response between them, perf_analyzer's nearest
    to a TPOT: it sees responses, not tokens)."""
    throughput = float(list(csv.DictReader((run_dir / "report.csv").open()))[-1]["Inferences/Second"])
    exported = json.loads((run_dir / "profile.json").read_text())
    requests = [r for experiment in exported["experiments"] for r in experiment["requests"]]
    answered = [r for r in requests if r["response_timestamps"]]
    first = [(r["response_timestamps"][0] - r["timestamp"]) / 1e6 for r in answered]
    last = [(r["response_timestamps"][-1] - r["timestamp"]) / 1e6 for r in answered]
    per_response = [
        (r["response_timestamps"][-1] - r["response_timestamps"][0]) / 1e6 / (len(r["response_timestamps"]) - 1)
        for r in answered
        if len(r["response_timestamps"]) > 1
    ]
    return {
        "completed": len(answered),
        "failed": len(requests) - len(answered),
        "req_per_s": throughput,
        "ttft_p50_ms": statistics.median(first) if first else None,
        "itl_p50_ms": statistics.median(per_response) if per_response else None,
        "e2e_p50_ms": statistics.median(last) if last else None,
        "output_tokens_mean": statistics.mean(len(r["response_timestamps"]) for r in answered) if answered else None,
    }


def markdown(rows: Sequence[dict[str, Any]], title: str, command: str, notes: Sequence[str] = ()) -> str:
    header = ["model", "c", "client", "endpoint", "done", "failed", *(name for _, name in COLUMNS), "load"]
    lines = [f"# {title}", "", f"Command: `{command}`", "", *notes, "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]  # fmt: skip
    errors = []
    for row in rows:
        cells = [row["model"], str(row["concurrency"]), row["client"], row["endpoint"]]
        if row.get("error"):
            errors.append(
                f"- {row['client']} -> {row['endpoint']}, {row['model']} c={row['concurrency']}: {row['error']}"
            )
            cells += ["error", "-", *("-" for _ in COLUMNS)]
        else:
            cells += [str(row["completed"]), str(row["failed"])]
            cells += ["-" if row.get(key) is None else f"{row[key]:.2f}" for key, _ in COLUMNS]
        cells.append(f"{row['load']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    if errors:
        lines += ["", "Errors:", "", *errors]
    return "\n".join(lines) + "\n"


def failed_rows(rows: Sequence[dict[str, Any]], requests: int) -> list[dict[str, Any]]:
    """Rows with an error, a failed request or a request missing (perf_analyzer's windows may send
    a few more than the requests at c > 1: only its failures count)."""
    return [
        row
        for row in rows
        if row.get("error") or row["failed"] or (row["client"] != "perf_analyzer" and row["completed"] != requests)
    ]


def median_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, c, client, endpoint) over its repetitions: requests summed, every other
    number the median of the repetitions' values; a repetition's error stays the row's error."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["concurrency"], row["client"], row["endpoint"]), []).append(row)
    merged = []
    for (model, concurrency, client, endpoint), reps in groups.items():
        row: dict[str, Any] = {"model": model, "concurrency": concurrency, "client": client, "endpoint": endpoint}
        row["reps"] = len(reps)
        row["load"] = statistics.median(r["load"] for r in reps)
        errors = [r["error"] for r in reps if r.get("error")]
        if errors:
            row["error"] = f"{len(errors)} of {len(reps)} repetitions: {errors[0]}"
            merged.append(row)
            continue
        row["completed"] = sum(r["completed"] for r in reps)
        row["failed"] = sum(r["failed"] for r in reps)
        for key, _ in COLUMNS:
            values = [r[key] for r in reps if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        merged.append(row)
    return merged


def run_logged(
    command: list[str], log_path: Path, timeout_s: float, sampler: CpuSampler, env: dict[str, str] | None = None
) -> int:
    """``command`` with its output in ``log_path``; its process tree is the sampler's client meanwhile."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(command) + "\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
        sampler.set_client(process.pid)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        finally:
            sampler.set_client(None)


def run_aiperf(command: list[str], artifact_dir: Path, timeout_s: float, sampler: CpuSampler) -> dict[str, Any]:
    code = run_logged(command, artifact_dir / "aiperf.log", timeout_s, sampler)
    exports = sorted(artifact_dir.rglob(EXPORT_FILE))
    if code != 0 or not exports:
        tail = (artifact_dir / "aiperf.log").read_text()[-1500:]
        return {"error": f"aiperf exit {code}, no {EXPORT_FILE}" if not exports else f"aiperf exit {code}", "log": tail}
    return read_export(exports[0])


async def run_harness(
    make_target: Callable[[], Any], model: str, requests: Sequence[Any], concurrency: int, timeout_s: float
) -> Any:
    """Our harness's closed loop on ``requests``: their ``RequestRecord`` s. The target is made
    inside the event loop (a gRPC aio channel binds to the loop it is made in)."""
    from bench.loadgen import closed_loop

    target = make_target()
    try:
        prepared = [target.prepare(r, model) for r in requests]
        result = await closed_loop(lambda p: target.send(model, p, timeout_s), prepared, concurrency, 1e9, lambda: None)
    finally:
        await target.close()
    return result.records


def openai_target(url: str, model: str) -> Any:
    from bench.openai_target import OpenAIChatTarget, PeerServerInfo

    return OpenAIChatTarget(url, model, model, PeerServerInfo("triton-epd openai", "", {}))


def triton_target(grpc_url: str) -> Any:
    from bench.triton_target import TritonGrpcTarget

    return TritonGrpcTarget(grpc_url)


class Run:
    """One point's clients against one started server group."""

    def __init__(
        self, args: argparse.Namespace, openai_url: str, server: Any, requests: Sequence[Any], sampler: CpuSampler
    ) -> None:
        self.args, self.openai_url, self.server, self.requests = args, openai_url, server, requests
        self.sampler = sampler
        self.raw: Path = args.out / "raw"
        self.commands: list[str] = []
        self.aiperf, _ = locate()

    def warm(self, model: str) -> None:
        """Every request once, untimed, through the OpenAI API: no client meets a cold image."""
        from bench.metrics import summarize

        records = asyncio.run(run_harness(lambda: openai_target(self.openai_url, model), model, self.requests, 4, 600))
        summary = summarize(records)
        if summary["errors"]:
            raise RuntimeError(f"warm-up of {model}: {summary['errors']} errors, e.g. {records[0].error}")

    def client(self, client: str, endpoint: str, model: str, concurrency: int, rep: int) -> dict[str, Any]:
        """One client's run, with its wall time and CPU time (the harness's own process; AIPerf's and
        perf_analyzer's processes and their children, once waited for)."""
        name = f"{client_name(client, endpoint)}-{model}-c{concurrency}-r{rep}"
        out = self.raw / name
        out.mkdir(parents=True, exist_ok=True)
        print(f"[aiperf-run] {name}", file=sys.stderr, flush=True)
        started, wall, cpu = time.perf_counter(), time.time(), time.process_time() - self.sampler.own_cpu_s
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        row = self._client(client, endpoint, model, concurrency, out)
        ended, after = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
        own_cpu_s = time.process_time() - self.sampler.own_cpu_s - cpu  # the harness runs in this process
        cpu_s = own_cpu_s + (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
        # The measured window: AIPerf's profiling phase; the harness's and perf_analyzer's whole run.
        start, end = row.pop("window_start", None) or wall, row.pop("window_end", None) or ended
        self.sampler.sample()
        window_client = own_cpu_s if client == "harness" else self.sampler.used(CLIENT, start, end)
        window_server = self.sampler.used(SERVER, start, end)
        cores = {
            "client_cores": None if window_client is None else window_client / (end - start),
            "server_cores": None if window_server is None else window_server / (end - start),
        }
        return {**row, **cores, "rep": rep, "wall_s": time.perf_counter() - started, "cpu_s": cpu_s}

    def _client(self, client: str, endpoint: str, model: str, concurrency: int, out: Path) -> dict[str, Any]:
        if client == "aiperf":
            return self._aiperf(endpoint, model, concurrency, out)
        if client == "harness":
            from bench.metrics import summarize

            grpc_url = self.server.grpc_url

            def make_target() -> Any:
                return openai_target(self.openai_url, model) if endpoint == "openai" else triton_target(grpc_url)

            records = asyncio.run(run_harness(make_target, model, self.requests, concurrency, 600))
            (out / "records.json").write_text(json.dumps([r.to_json() for r in records]) + "\n")
            return harness_row(summarize(records))
        return self._perf_analyzer(model, concurrency, out)

    def _aiperf(self, endpoint: str, model: str, concurrency: int, out: Path) -> dict[str, Any]:
        if self.aiperf is None:
            return {"error": locate()[1]}
        inputs = self.raw.parent / "inputs"
        common = dict(model=model, concurrency=concurrency, requests=len(self.requests),
                      tokenizer=self.args.model_dir, artifact_dir=out / "artifacts")  # fmt: skip
        if endpoint == "openai":
            path = write_raw_payloads(chat_payloads(self.requests, model), inputs / f"aiperf-chat-{model}.jsonl")
            command = profile_command(
                self.aiperf, url=self.openai_url, input_file=path, dataset_type="raw_payload", **common
            )
        else:
            path = write_inputs_json(generate_payloads(self.requests), inputs / "aiperf-generate.json")
            url = f"http://{self.server.http_url}/v2/models/{model}/generate_stream"
            command = profile_command(
                self.aiperf, url=url, input_file=path, dataset_type="inputs_json", endpoint_type="raw",
                server_token_count=False, extra_inputs=["response_field:text_output"], **common,
            )  # fmt: skip
        self.commands.append(shlex.join(command))
        return run_aiperf(command, out / "artifacts", self.args.timeout_s, self.sampler)

    def _perf_analyzer(self, model: str, concurrency: int, out: Path) -> dict[str, Any]:
        from bench.perf_analyzer import write_inputs
        from bench.perf_analyzer_run import perf_analyzer_command
        from bench.perf_analyzer_tool import locate as locate_perf_analyzer

        tool, reason = locate_perf_analyzer()
        if tool is None:
            return {"error": reason}
        inputs = self.raw.parent / "inputs" / "perf_analyzer"
        if not (inputs / f"{model}.json").is_file():
            from bench.cli import _declared_inputs

            declared = asyncio.run(_declared_inputs(self.server.grpc_url, [model]))
            write_inputs(self.requests, inputs, [model], "binary", declared, self.server.grpc_url)
        # Count windows: three windows (the trials it compares) cover the requests once.
        window = math.ceil(len(self.requests) / 3)
        command = perf_analyzer_command(
            tool, model, self.server.grpc_url, inputs / f"{model}.json", concurrency, False, out, window
        )
        self.commands.append(shlex.join(command))
        code = run_logged(command, out / "stdout.txt", self.args.timeout_s, self.sampler, tool.env())
        if code != 0:
            return {"error": f"perf_analyzer exit {code}", "log": (out / "stdout.txt").read_text()[-1500:]}
        return perf_analyzer_row(out)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    from bench.cli_args import DEFAULT_MODEL_DIR, workload_arguments

    parser = argparse.ArgumentParser(prog="python -m bench.aiperf_run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "latest" / "aiperf")
    parser.add_argument("--model", type=Path, help="checkpoint (default: the tiny built-in one)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests", type=int, default=24, help="requests per client and point (each sent once)")
    parser.add_argument(
        "--clients",
        nargs="+",
        default=[client_name(*c) for c in CLIENTS],
        choices=[client_name(*c) for c in CLIENTS],
    )
    parser.add_argument(
        "--reps", type=int, default=3, help="repetitions of every point, the clients' order rotated each time"
    )
    parser.add_argument("--timeout-s", type=float, default=900, help="per AIPerf or perf_analyzer run")
    workload_arguments(parser)
    args = parser.parse_args(argv)
    args.model_dir = args.model or DEFAULT_MODEL_DIR
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    from bench.cli_args import workload_spec
    from bench.vllm_bench_serve import our_servers
    from bench.workload import WorkloadBuilder

    spec = workload_spec(args)
    requests = WorkloadBuilder(spec).build(args.requests, spec.reuse_ratio)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    rows: list[dict[str, Any]] = []
    with our_servers(args.model, args.out / "logs") as (openai_url, server), CpuSampler() as sampler:
        run = Run(args, openai_url, server, requests, sampler)
        clients = [c for c in CLIENTS if client_name(*c) in args.clients]
        for model in args.models:
            run.warm(model)
            for concurrency in args.concurrency:
                for rep in range(args.reps):
                    # Rotated, so that no client always runs first (or right after AIPerf's start-up).
                    for client, endpoint in clients[rep % len(clients) :] + clients[: rep % len(clients)]:
                        load = os.getloadavg()[0]
                        row = run.client(client, endpoint, model, concurrency, rep)
                        rows.append({"model": model, "concurrency": concurrency, "client": client,
                                     "endpoint": endpoint, "load": load, **row})  # fmt: skip
    command = "python -m bench.aiperf_run " + shlex.join(argv)
    from builders.machine import describe_machine

    summary = {
        "command": command,
        "workload": spec.describe(),
        "requests": args.requests,
        "machine": describe_machine(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": round(time.time() - started, 1),
        "rows": median_rows(rows),
        "repetitions": rows,
    }
    (args.out / "results.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    notes = [f"{args.requests} requests per repetition, each once, {args.reps} repetitions (clients rotated); "
             "done/failed: summed; every other number: the median of the repetitions' values. Workload: "
             f"{json.dumps(spec.describe())}; load: the 1-minute load average when a repetition started."]  # fmt: skip
    title = "AIPerf, our harness and perf_analyzer on the same requests"
    (args.out / "results.md").write_text(markdown(summary["rows"], title, command, notes))
    (args.out / "COMMAND.md").write_text(
        f"# Reproduce\n\n```bash\n{command}\n```\n\nEach AIPerf and perf_analyzer run:\n\n```bash\n"
        + "\n".join(run.commands)
        + "\n```\n"
    )
    print((args.out / "results.md").read_text())
    return 1 if failed_rows(rows, args.requests) else 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m bench {run,peers,compare,perf-analyzer-inputs}``: see each ``--help``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.cli_args import build_parser, workload_spec
from builders.tritonserver import REPO_ROOT

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


@contextlib.contextmanager
def _watched(
    pid: int | None,
    heartbeats: Path | None = None,
    on_failure: Callable[[list[str], list[str]], object] | None = None,
    stacks_dir: Path | None = None,
) -> Iterator[Callable[[], str | None]]:
    """While the sweep runs: a stage of the server at ``pid`` that dies or hangs (``heartbeats``:
    the stubs' heartbeat folder; a hung stub's stacks go to ``stacks_dir``) halts the sweep, whose
    remaining points are reported as not run, instead of filling the run with errors (or, for a
    hung stub, with request timeouts)."""
    from builders.stage_watch import StageWatch, StageWatchThread

    if pid is None:
        yield lambda: None
        return
    watch = StageWatchThread(StageWatch(pid, heartbeats), on_failure, stacks_dir=stacks_dir).start()
    try:
        yield lambda: watch.reason
    finally:
        watch.stop()


@contextlib.contextmanager
def _server_for(args: argparse.Namespace, log_dir: Path) -> Iterator[dict[str, Any]]:
    """The server to measure: the one at --url, or one started here and stopped after (at once
    when it lost a stage: Triton does not recover one, see builders/stage_watch.py)."""
    if args.url:
        host, _, port = args.url.rpartition(":")
        pid = args.server_pid
        if pid is None and host in LOCAL_HOSTS:
            from bench.server_stats import find_listening_pid

            pid = find_listening_pid(int(port))
        with _watched(pid) as halted:
            yield {
                "grpc_url": args.url,
                "metrics_url": args.metrics_url or f"http://{host}:8002/metrics",
                "pid": pid,
                "origin": "given with --url" + ("" if pid else " (server CPU not measured: no pid)"),
                "halted": halted,
            }
        return
    import shutil

    from builders.launcher import prepare, stop_after_stage_crash
    from builders.roles import server_cpus
    from builders.tritonserver import Ports, ServerOptions, TritonServer
    from python_backends.runtime.heartbeat import HEARTBEAT_DIR_ENV

    repository = REPO_ROOT / "model_repository"
    prepare("cpu", args.model, repository, cpus=args.cpus, colocated_encodes=args.colocated_encodes)
    heartbeats = log_dir / "heartbeats"
    shutil.rmtree(heartbeats, ignore_errors=True)
    heartbeats.mkdir(parents=True)
    options = ServerOptions(
        repository, Ports.free(), extra_env={HEARTBEAT_DIR_ENV: str(heartbeats)}, cpus=server_cpus(args.cpus)
    )
    started = time.perf_counter()
    with TritonServer(options, log_dir / "server.log") as server:
        server.wait_ready(timeout_s=900)
        ready_s = time.perf_counter() - started
        print(f"[bench] tritonserver ready in {ready_s:.0f} s (log: {log_dir / 'server.log'})", file=sys.stderr)
        pid = server.process.pid if server.process else None
        stop = functools.partial(stop_after_stage_crash, server)
        with _watched(pid, heartbeats, stop, log_dir) as halted:
            yield {
                "grpc_url": server.grpc_url,
                "metrics_url": args.metrics_url or server.metrics_url,
                "pid": pid,
                "origin": f"started by the harness, ready in {ready_s:.0f} s",
                "halted": halted,
            }
    if server.stop_report is not None:  # how it ended: a crash or forced stop is worth knowing next to results
        print(f"[bench] {server.stop_report.describe()}", file=sys.stderr)


def _sweep_config(args: argparse.Namespace) -> Any:
    """The SweepConfig the options describe; None (after a message) when there is no load point."""
    from bench.loadgen import LoadPoint
    from bench.metrics import Slo
    from bench.server_stats import (
        DEFAULT_CACHE_HIT_METRIC,
        DEFAULT_ENCODE_METRIC,
    )
    from bench.sweep import ModeSpec, SweepConfig

    points = [LoadPoint("concurrency", c) for c in args.concurrency]
    points += [LoadPoint("rate", r, args.arrival, args.burst_size) for r in args.request_rate]
    if not points:
        print("error: give --concurrency and/or --request-rate values", file=sys.stderr)
        return None
    return SweepConfig(
        modes=[ModeSpec.parse(m) for m in args.modes],
        points=points,
        workload=workload_spec(args),
        requests_per_point=args.requests,
        warmup_requests=args.warmup,
        reps=args.reps,
        max_seconds_per_point=args.max_seconds_per_point,
        request_timeout_s=args.request_timeout,
        time_budget_s=args.time_budget,
        interleave=args.interleave,
        slo=Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms),
        baseline=args.baseline,
        max_inflight=args.max_inflight,
        cache_hit_metric=args.cache_hit_metric or DEFAULT_CACHE_HIT_METRIC,
        encode_metric=args.encode_metric or DEFAULT_ENCODE_METRIC,
        progress=not args.no_progress,
        max_noise=args.max_noise,
        noise_retries=args.noise_retries,
        prime_pool=args.prime_pool,
    )


def _meta(args: argparse.Namespace, machine: dict[str, Any], started: float, origin: str) -> dict[str, Any]:
    return {
        "title": args.title,
        "command": "python -m bench " + shlex.join(args.argv),
        "machine": machine,
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "server_origin": origin,
        "wall_s_with_server_start": time.perf_counter() - started,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def command_run(args: argparse.Namespace) -> int:
    from bench.report import markdown, write_outputs
    from bench.sweep import Sweep
    from builders.machine import describe_machine

    config = _sweep_config(args)
    if config is None:
        return 2
    machine = describe_machine()
    wall_started = time.perf_counter()
    with _server_for(args, REPO_ROOT / "build" / "bench") as server:
        sweep = Sweep(config, server["grpc_url"], server["metrics_url"], server["pid"], server["halted"])
        output = asyncio.run(sweep.run())
    output.summary["meta"] = _meta(args, machine, wall_started, server["origin"])
    written = write_outputs(args.out, output.summary, output.raw, plots=not args.no_plots)
    print(markdown(output.summary, []))
    print("wrote: " + ", ".join(str(p) for p in written), file=sys.stderr)
    if output.summary["halted"] is not None:
        from builders.launcher import STAGE_CRASHED  # the launcher's exit code for the same event

        print(f"[bench] halted: {output.summary['halted']}", file=sys.stderr)
        return STAGE_CRASHED
    return 0


def command_peers(args: argparse.Namespace) -> int:
    from bench.peer_servers import PeerSettings
    from bench.peers import PeerRun, PeerRunConfig
    from bench.peers_report import peers_markdown, write_peer_outputs
    from builders.default_model import build_default_model, resolve_model
    from builders.machine import describe_machine

    config = _sweep_config(args)
    if config is None:
        return 2
    model_dir = resolve_model(args.model) if args.model else build_default_model()
    settings = dataclasses.replace(
        PeerSettings.from_target(model_dir, args.logs, args.ec_storage), start_timeout_s=args.peer_start_timeout
    )
    machine = describe_machine()
    wall_started = time.perf_counter()
    unique, repeated = args.equality_requests
    run = PeerRun(
        PeerRunConfig(config, settings, unique, repeated, wait_quiet_s=args.wait_quiet),
        lambda: _server_for(args, args.logs),
    )
    output = run.run()
    output.summary["meta"] = _meta(args, machine, wall_started, "each server group started and stopped by the harness")
    written = write_peer_outputs(args.out, output.summary, output.raw, plots=not args.no_plots)
    print(peers_markdown(output.summary))
    print("wrote: " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


def command_compare(args: argparse.Namespace) -> int:
    from bench.compare import diff, load_summary, render

    changes, only_old, only_new = diff(load_summary(args.old), load_summary(args.new))
    text = render(changes, only_old, only_new, args.threshold, (str(args.old), str(args.new)))
    print(text)
    if args.out:
        args.out.write_text(text)
    regressed = any(c.is_regression(args.threshold) for c in changes)
    return 1 if args.fail_on_regression and regressed else 0


async def _declared_inputs(url: str, models: list[str]) -> dict[str, set[str]]:
    import tritonclient.grpc.aio as grpcaio

    client = grpcaio.InferenceServerClient(url)
    declared = {}
    try:
        for model in models:
            if await client.is_model_ready(model):
                metadata = await client.get_model_metadata(model, as_json=True)
                declared[model] = {i["name"] for i in metadata.get("inputs", [])}
    finally:
        await client.close()
    return declared


def command_perf_analyzer_inputs(args: argparse.Namespace) -> int:
    from bench.perf_analyzer import write_inputs
    from bench.workload import WorkloadBuilder

    spec = workload_spec(args)
    requests = WorkloadBuilder(spec).build(args.count, spec.reuse_ratio, phase="perf_analyzer")
    declared = asyncio.run(_declared_inputs(args.url, args.models)) if args.url else None
    written = write_inputs(requests, args.out, args.models, args.image_encoding, declared, args.url or "localhost:8001")
    for path in written:
        print(path)
    return 0


# The crash and soak harnesses are stress tests now (tests/stress/), not bench commands.
MOVED_COMMANDS = {"crash": "make crash", "soak": "make soak"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in MOVED_COMMANDS:
        print(f"python -m bench {argv[0]} is gone: run `{MOVED_COMMANDS[argv[0]]}` "
              f"(python -m tests.stress.{argv[0]} ...)", file=sys.stderr)  # fmt: skip
        return 2
    args = build_parser().parse_args(argv)
    args.argv = argv  # recorded in the results: the exact command that produced them
    handlers = {
        "run": command_run,
        "peers": command_peers,
        "compare": command_compare,
        "perf-analyzer-inputs": command_perf_analyzer_inputs,
    }
    return handlers[args.command](args)

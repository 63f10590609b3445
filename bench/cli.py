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

from builders.tritonserver import REPO_ROOT

DEFAULT_MODES = ("llm", "ensemble", "epd", "epd:repeated")
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32)
DEFAULT_MODEL_DIR = REPO_ROOT / "build" / "models" / "tiny-qwen2-vl"
DEFAULT_TOKENIZER = DEFAULT_MODEL_DIR / "tokenizer.json"
# bench-peers: ours and the two vLLM peers, each with unique and with repeated media.
DEFAULT_PEER_MODES = (
    "llm",
    "llm:repeated",
    "epd",
    "epd:repeated",
    "vllm-colocated",
    "vllm-colocated:repeated",
    "vllm-epd",
    "vllm-epd:repeated",
)
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def _workload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload (seeded: the same options give the same requests)")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--prompt-tokens", default="32", help="text tokens per prompt: N, uniform:LO:HI, normal:MEAN:STD, choice:A,B"
    )
    group.add_argument(
        "--output-tokens", default="32", help="max_tokens per request (same forms); exact with ignore_eos"
    )
    group.add_argument("--images-per-request", default="1", help="images per request (same forms), e.g. choice:0,1,2")
    group.add_argument(
        "--image-size", nargs="+", default=["640x480"], help="synthetic image sizes WxH, drawn uniformly"
    )
    group.add_argument("--image-format", default="JPEG", choices=("JPEG", "PNG", "WEBP"))
    group.add_argument("--image-dir", type=Path, help="use real image files from this folder instead of synthetic ones")
    group.add_argument(
        "--reuse-ratio", type=float, default=0.0, help="share of images drawn from the reused pool (plain modes)"
    )
    group.add_argument("--repeated-reuse-ratio", type=float, default=1.0, help="the same for MODEL:repeated modes")
    group.add_argument("--media-pool", type=int, default=4, help="distinct images in the reused pool")
    group.add_argument(
        "--no-ignore-eos", action="store_true", help="let requests stop at EOS (output lengths then vary)"
    )
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument(
        "--tokenizer",
        type=Path,
        help=f"tokenizer.json for exact prompt lengths (default: {DEFAULT_TOKENIZER} if present)",
    )
    group.add_argument(
        "--media-salt",
        default=None,
        help="mixed into synthetic image content; 'auto' = a new one per run, so images are new to caches that "
        "outlive a server (the embedding store in /dev/shm); give a run's salt to repeat it exactly",
    )


def _workload_spec(args: argparse.Namespace) -> Any:
    from bench.workload import LengthDist, WorkloadSpec, parse_sizes

    tokenizer = args.tokenizer or (DEFAULT_TOKENIZER if DEFAULT_TOKENIZER.is_file() else None)
    return WorkloadSpec(
        seed=args.seed,
        prompt_tokens=LengthDist.parse(args.prompt_tokens, minimum=1),
        output_tokens=LengthDist.parse(args.output_tokens, minimum=1),
        images_per_request=LengthDist.parse(args.images_per_request),
        image_sizes=parse_sizes(args.image_size),
        image_format=args.image_format,
        image_dir=args.image_dir,
        reuse_ratio=args.reuse_ratio,
        repeated_reuse_ratio=args.repeated_reuse_ratio,
        media_pool_size=args.media_pool,
        ignore_eos=not args.no_ignore_eos,
        temperature=args.temperature,
        tokenizer=tokenizer,
        media_salt=_media_salt(getattr(args, "media_salt", None), getattr(args, "default_media_salt", "")),
    )


def _media_salt(given: str | None, default: str) -> str:
    value = default if given is None else given
    return time.strftime("%Y%m%dT%H%M%S") if value == "auto" else value


def _sweep_arguments(
    parser: argparse.ArgumentParser, default_out: Path, default_title: str, default_prime_pool: bool = False
) -> None:
    """Load points, repetitions, bounds, SLOs, outputs and the workload: shared by run and peers."""
    parser.add_argument("--baseline", default="llm", help="mode the ratios are taken against")
    parser.add_argument(
        "--concurrency", nargs="*", type=int, default=list(DEFAULT_CONCURRENCY), help="closed-loop points"
    )
    parser.add_argument("--request-rate", nargs="*", type=float, default=[], help="open-loop points, req/s")
    parser.add_argument("--arrival", choices=("poisson", "burst"), default="poisson", help="open-loop arrival pattern")
    parser.add_argument("--burst-size", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32, help="measured requests per point and repetition")
    parser.add_argument("--warmup", type=int, default=4, help="warm-up requests per point (excluded)")
    parser.add_argument("--reps", type=int, default=1, help="repetitions per point; the median is reported")
    parser.add_argument("--max-seconds-per-point", type=float, default=120.0, help="stop issuing requests after this")
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument(
        "--time-budget",
        type=float,
        help="seconds for the whole sweep, shared evenly by the modes that run; points past a mode's share are "
        "reported as not run",
    )
    parser.add_argument("--max-inflight", type=int, default=256, help="open-loop cap on requests in flight")
    parser.add_argument(
        "--max-noise",
        type=float,
        metavar="SHARE",
        help="measure a repetition again (fresh requests) when other processes took more than this share "
        "of the CPUs during it, e.g. 0.25 on a shared machine",
    )
    parser.add_argument("--noise-retries", type=int, default=2, help="at most this many re-measurements per repetition")
    parser.add_argument(
        "--prime-pool",
        action=argparse.BooleanOptionalAction,
        default=default_prime_pool,
        help="warm-up of modes with reuse starts with one request per pool image, so their measured "
        "requests find all their repeated media cached",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="run point by point (every mode at a load point, then the next point) and at a point repetition by "
        "repetition (round r: every mode's repetition r, in an order drawn per round) instead of mode by mode: "
        "on a machine whose load drifts, the modes compared at a point then run seconds apart, not a sweep apart",
    )
    parser.add_argument("--slo-ttft-ms", type=float)
    parser.add_argument("--slo-tpot-ms", type=float)
    parser.add_argument("--slo-e2e-ms", type=float)
    parser.add_argument("--cache-hit-metric", default=None, help="counter on /metrics counting cache hits")
    parser.add_argument("--encode-metric", default=None, help="counter on /metrics counting media encodes")
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--title", default=default_title)
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    _workload_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description="triton-epd benchmark harness")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="sweep modes x load points against a server (started here unless --url)")
    run.add_argument("--url", help="gRPC HOST:PORT of a running server (default: start one on free ports)")
    run.add_argument(
        "--metrics-url", help="Prometheus endpoint (default: the started server's, or http://HOST:8002/metrics)"
    )
    run.add_argument(
        "--server-pid", type=int, help="server pid for CPU accounting (default: found from the port when local)"
    )
    run.add_argument(
        "--model", type=Path, help="checkpoint for the server started here (default: the tiny built-in model)"
    )
    run.add_argument(
        "--modes",
        nargs="+",
        default=list(DEFAULT_MODES),
        help="MODEL[:PATH][:unique|:repeated|:identical][:again] ...; PATH (epd): adaptive, disaggregated, "
        "colocated; again: the same mode once more on requests of its own (a control); missing models are skipped",
    )
    _sweep_arguments(run, REPO_ROOT / "results" / "latest" / "bench", "triton-epd benchmark")

    peers = commands.add_parser(
        "peers",
        help="our modes vs vLLM's native EPD and colocated vLLM, same model/machine/workload, one server group at a "
        "time",
    )
    peers.add_argument("--model", type=Path, help=f"checkpoint for every server (default: {DEFAULT_MODEL_DIR})")
    peers.add_argument(
        "--modes",
        nargs="+",
        default=list(DEFAULT_PEER_MODES),
        help="MODEL[:unique|:repeated]; MODEL is one of ours (llm, epd, ensemble) or vllm-colocated, vllm-epd",
    )
    peers.add_argument(
        "--equality-requests",
        type=int,
        nargs=2,
        default=[8, 8],
        metavar=("UNIQUE", "REPEATED"),
        help="requests of the equality pass (sent one at a time to every served model)",
    )
    peers.add_argument(
        "--peer-start-timeout", type=float, default=600.0, help="seconds for a vllm serve to become healthy"
    )
    peers.add_argument(
        "--ec-storage",
        type=Path,
        default=Path("/dev/shm/triton-epd-bench-vllm-ec"),
        help="vLLM-EPD's EC connector storage (emptied before and after)",
    )
    peers.add_argument("--logs", type=Path, default=REPO_ROOT / "build" / "bench" / "peers", help="server logs")
    peers.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each server group, wait up to this long until other processes use < 25%% of the CPUs",
    )
    _sweep_arguments(
        peers,
        REPO_ROOT / "results" / "latest" / "peers",
        "Peers: triton-epd vs vLLM native EPD vs colocated vLLM",
        default_prime_pool=True,
    )
    # Fresh images every run: our store keeps the last run's, vLLM's caches die with the process.
    peers.set_defaults(url=None, metrics_url=None, server_pid=None, default_media_salt="auto")

    compare = commands.add_parser("compare", help="diff two results (summary.json files or their folders)")
    compare.add_argument("old", type=Path)
    compare.add_argument("new", type=Path)
    compare.add_argument("--threshold", type=float, default=0.10, help="relative change counted as a regression")
    compare.add_argument("--out", type=Path, help="also write the markdown here")
    compare.add_argument("--fail-on-regression", action="store_true", help="exit 1 when any value regressed")

    pa = commands.add_parser("perf-analyzer-inputs", help="write perf_analyzer --input-data JSON per user-facing model")
    pa.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "perf_analyzer")
    pa.add_argument("--models", nargs="+", default=["llm", "ensemble", "epd"])
    pa.add_argument("--count", type=int, default=8, help="data entries (perf_analyzer plays them round robin)")
    pa.add_argument("--image-encoding", choices=("binary", "b64"), default="binary")
    pa.add_argument("--url", help="gRPC HOST:PORT: keep only the inputs each loaded model declares")
    _workload_arguments(pa)
    return parser


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
    from builders.tritonserver import Ports, ServerOptions, TritonServer
    from python_backends.runtime.heartbeat import HEARTBEAT_DIR_ENV

    repository = REPO_ROOT / "model_repository"
    prepare("cpu", args.model, repository)
    heartbeats = log_dir / "heartbeats"
    shutil.rmtree(heartbeats, ignore_errors=True)
    heartbeats.mkdir(parents=True)
    options = ServerOptions(repository, Ports.free(), extra_env={HEARTBEAT_DIR_ENV: str(heartbeats)})
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
        workload=_workload_spec(args),
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

    spec = _workload_spec(args)
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

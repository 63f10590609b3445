"""``python -m bench``'s arguments: the subcommands' options, their defaults, and the workload
they describe (bench/cli.py runs the subcommands)."""

from __future__ import annotations

import argparse
import time
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


def workload_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.workload import WORKLOADS

    group = parser.add_argument_group("workload (seeded: the same options give the same requests)")
    group.add_argument(
        "--workload", choices=sorted(WORKLOADS), help="a named workload: its defaults for the options below, each "
        "still given its own way (bench/workload.py WORKLOADS)",
    )  # fmt: skip
    group.add_argument("--seed", type=int, default=0)
    # The options a named workload sets default to None here; workload_spec fills them in.
    group.add_argument("--prompt-tokens", help="text tokens per prompt: N, uniform:LO:HI, normal:MEAN:STD, choice:A,B")
    group.add_argument("--output-tokens", help="max_tokens per request (same forms); exact with ignore_eos")
    group.add_argument("--images-per-request", help="images per request (same forms), e.g. choice:0,1,2")
    group.add_argument("--image-size", nargs="+", help="synthetic image sizes WxH, drawn uniformly")
    group.add_argument("--image-format", default="JPEG", choices=("JPEG", "PNG", "WEBP"))
    group.add_argument("--image-dir", type=Path, help="use real image files from this folder instead of synthetic ones")
    group.add_argument("--reuse-ratio", type=float, help="share of images drawn from the reused pool (plain modes)")
    group.add_argument("--repeated-reuse-ratio", type=float, default=1.0, help="the same for MODEL:repeated modes")
    group.add_argument("--media-pool", type=int, help="distinct images in the reused pool")
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


def workload_spec(args: argparse.Namespace) -> Any:
    """The workload of ``args`` (the options a named workload sets are filled into ``args``)."""
    from bench.workload import WORKLOAD_DEFAULTS, WORKLOADS, LengthDist, WorkloadSpec, parse_sizes

    named = WORKLOADS[args.workload] if getattr(args, "workload", None) else {}
    for option, default in WORKLOAD_DEFAULTS.items():
        if getattr(args, option, None) is None:
            setattr(args, option, named.get(option, default))
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
        media_salt=media_salt(getattr(args, "media_salt", None), getattr(args, "defaultmedia_salt", "")),
    )


def media_salt(given: str | None, default: str) -> str:
    value = default if given is None else given
    return time.strftime("%Y%m%dT%H%M%S") if value == "auto" else value


def sweep_arguments(
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
    workload_arguments(parser)


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
    from builders.repository import add_colocated_encodes_argument, add_cpus_argument  # light, no torch

    add_cpus_argument(run)  # the server started here: CPU sets per model group (E|PD on cores of its own)
    add_colocated_encodes_argument(run)
    run.add_argument(
        "--modes",
        nargs="+",
        default=list(DEFAULT_MODES),
        help="MODEL[:PATH][:unique|:repeated|:identical][:again][:stream-decode] ...; PATH (epd): adaptive, "
        "disaggregated, colocated; again: the same mode once more on requests of its own (a control); "
        "stream-decode: epd reads decode as a stream, the pattern polls replaced (the server must be started "
        "with TRITON_EPD_ALLOW_STREAMED_DECODE=1); missing models are skipped",
    )
    sweep_arguments(run, REPO_ROOT / "results" / "latest" / "bench", "triton-epd benchmark")

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
    sweep_arguments(
        peers,
        REPO_ROOT / "results" / "latest" / "peers",
        "Peers: triton-epd vs vLLM native EPD vs colocated vLLM",
        default_prime_pool=True,
    )
    # Fresh images every run: our store keeps the last run's, vLLM's caches die with the process.
    peers.set_defaults(url=None, metrics_url=None, server_pid=None, defaultmedia_salt="auto")

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
    workload_arguments(pa)
    return parser

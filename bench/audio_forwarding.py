"""The article's audio experiment (issue 34): metadata-only forwarding against re-processing downstream.

On an audio checkpoint's server (its own, started here), ``epd`` serves every request
disaggregated: its encoders decode each clip (FFmpeg), make Whisper's features (DALI) and embed
them (ONNX Runtime) into the store. Two ways to reach prefill, one request parameter apart:

- ``metadata`` (ours): prefill gets references only (the clip's token count, where its
  embeddings are); the clip never goes past the encoders;
- ``raw`` (the baseline, ``forward_media=raw``; the server allows it with
  ``TRITON_EPD_ALLOW_RAW_FORWARDING=1``): the clip goes on to prefill too, which decodes it again
  and re-extracts its features (transformers' extractor, what vLLM's processor runs on a raw clip)
  to learn the layout the reference already carries; the embeddings still come from the store.

Every request carries a clip no request sent before (the encoders work every time in both arms),
in rotating containers (MP3, FLAC, Ogg Vorbis, WAV), made before its round starts. Closed loop at
one concurrency, rounds interleaved ``metadata, raw, control`` (control: ``metadata`` again, the
noise of the same run).
Reported: req/s and mean latency per arm (median of rounds), the ratio to ``metadata``, and
what crossed into prefill per request (its ``epd_prefill_input_bytes`` counters).

``python -m bench.audio_forwarding --out DIR`` (raw output: ``summary.json``, the server's log, a
plot of every round).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import os
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.audio_clips import encoded, tone, wav
from bench.cache import private_repository, ready_server
from bench.server_stats import scrape_required
from builders.machine import describe_machine, one_line
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions
from client.epd_client import GrpcClient, chat_prompt
from python_backends import contract

ARMS = ("metadata", "raw", "control")
WORK_DIR = REPO_ROOT / "build" / "bench-audio-forwarding"
STORE_PATH = "/dev/shm/triton-epd-bench-audio-forwarding"
CONTAINERS = (("mp3", "libmp3lame"), ("flac", "flac"), ("ogg", "libvorbis"), ("wav", ""))


def clips(seconds: float) -> Iterator[bytes]:
    """Clips no one sent before: a new tone and noise seed each, the containers in turn."""
    index = 0
    while True:
        samples = tone(seconds, 200.0 + 7.0 * (index % 500), seed=10_000 + index)
        container, codec = CONTAINERS[index % len(CONTAINERS)]
        yield wav(samples) if container == "wav" else encoded(samples, container, codec)
        index += 1


class ClipPool:
    """Thread-safe: each call, the next unsent clip. Filled between rounds (:meth:`fill`), so the
    clients do not encode clips while a round is measured (on 2 cores that competes with the
    server); a round that outruns its pool makes its clips as it goes."""

    def __init__(self, seconds: float) -> None:
        self._source = clips(seconds)
        self._ready: collections.deque[bytes] = collections.deque()
        self._lock = threading.Lock()

    def fill(self, count: int) -> None:
        with self._lock:
            while len(self._ready) < count:
                self._ready.append(next(self._source))

    def next(self) -> bytes:
        with self._lock:
            return self._ready.popleft() if self._ready else next(self._source)


@dataclasses.dataclass
class Round:
    arm: str
    seconds: float
    latencies_s: list[float]
    errors: int
    prefill_media_bytes: float
    prefill_reference_bytes: float

    @property
    def requests_per_s(self) -> float:
        return len(self.latencies_s) / self.seconds


def prefill_bytes(metrics_url: str) -> dict[str, float]:
    snapshot = scrape_required(metrics_url)
    found = {"media": 0.0, "reference": 0.0}
    for (name, labels), value in snapshot.counters.items():
        if name == "epd_prefill_input_bytes":
            found[dict(labels).get("kind", "")] = found.get(dict(labels).get("kind", ""), 0.0) + value
    return found


def run_round(url: str, metrics_url: str, arm: str, source: ClipPool, concurrency: int, seconds: float,
              max_tokens: int) -> Round:  # fmt: skip
    """``concurrency`` clients, each one request after another, for ``seconds``."""
    # Both arms on the disaggregated path (prefill is where the baseline re-processes).
    parameters = {"forward_media": "raw" if arm == "raw" else "metadata", "path": contract.DISAGGREGATED_PATH}
    prompt = chat_prompt("What is it?", 0, num_audios=1)
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    before = prefill_bytes(metrics_url)
    deadline = time.monotonic() + seconds
    latencies: list[float] = []
    errors = 0
    lock = threading.Lock()

    def client() -> None:
        nonlocal errors
        grpc = GrpcClient(url, contract.EPD_MODEL)
        try:
            while time.monotonic() < deadline:
                clip = source.next()
                started = time.perf_counter()
                try:
                    grpc.generate(prompt, sampling=sampling, audios=[clip], parameters=parameters)
                except Exception:  # counted: an arm that errs is not faster
                    with lock:
                        errors += 1
                    continue
                with lock:
                    latencies.append(time.perf_counter() - started)
        finally:
            grpc.close()

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(client) for _ in range(concurrency)]:
            future.result()
    elapsed = time.monotonic() - started  # the last requests end after the deadline: counted in full
    after = prefill_bytes(metrics_url)
    done = max(len(latencies) + errors, 1)
    return Round(
        arm, elapsed, latencies, errors,
        (after["media"] - before["media"]) / done, (after["reference"] - before["reference"]) / done,
    )  # fmt: skip


def summarize(rounds: list[Round]) -> dict[str, Any]:
    arms: dict[str, Any] = {}
    for arm in ARMS:
        mine = [r for r in rounds if r.arm == arm]
        arms[arm] = {
            "requests_per_s": statistics.median(r.requests_per_s for r in mine),
            "requests_per_s_rounds": [round(r.requests_per_s, 3) for r in mine],
            "mean_latency_s": statistics.median(statistics.fmean(r.latencies_s) for r in mine if r.latencies_s),
            "requests": sum(len(r.latencies_s) for r in mine),
            "errors": sum(r.errors for r in mine),
            "prefill_media_bytes_per_request": statistics.fmean(r.prefill_media_bytes for r in mine),
            "prefill_reference_bytes_per_request": statistics.fmean(r.prefill_reference_bytes for r in mine),
        }
    base = arms["metadata"]
    for arm in ARMS:
        arms[arm]["throughput_vs_metadata"] = arms[arm]["requests_per_s"] / base["requests_per_s"]
        arms[arm]["latency_vs_metadata"] = arms[arm]["mean_latency_s"] / base["mean_latency_s"]
    return arms


def table(arms: dict[str, Any]) -> str:
    lines = [
        "| arm | req/s (median of rounds) | vs metadata | mean latency (s) | vs metadata | requests | errors "
        "| bytes into prefill per request (media / references) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for arm, row in arms.items():
        lines.append(
            f"| {arm} | {row['requests_per_s']:.2f} | {row['throughput_vs_metadata']:.3f} | "
            f"{row['mean_latency_s']:.3f} | {row['latency_vs_metadata']:.3f} | {row['requests']} | {row['errors']} | "
            f"{row['prefill_media_bytes_per_request']:.0f} / {row['prefill_reference_bytes_per_request']:.0f} |"
        )
    return "\n".join(lines)


def write_plot(result: dict[str, Any], path: Path) -> Path:
    """req/s and mean latency of every round, per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for arm in ARMS:
        mine = [r for r in result["rounds"] if r["arm"] == arm]
        rounds = range(1, len(mine) + 1)
        left.plot(rounds, [r["requests_per_s"] for r in mine], marker="o", label=arm)
        right.plot(rounds, [statistics.fmean(r["latencies_s"]) for r in mine], marker="o", label=arm)
    left.set(xlabel="round", ylabel="req/s", title="throughput")
    right.set(xlabel="round", ylabel="mean latency (s)", title="latency")
    for ax in (left, right):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    left.legend()
    fig.suptitle("metadata-only forwarding (ours) vs re-processing the clip on prefill (raw)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def serve_and_measure(args: argparse.Namespace) -> dict[str, Any]:
    from builders.default_model import DEFAULT_AUDIO_MODEL_DIR, build_default_model
    from builders.launcher import prepare
    from builders.repository import TARGETS

    model_dir = build_default_model(DEFAULT_AUDIO_MODEL_DIR, recipe="qwen2-audio")
    repo = private_repository(WORK_DIR / "repository")
    prepare("cpu", model_dir, repo, dataclasses.replace(TARGETS["cpu"].cache, path=STORE_PATH))
    options = ServerOptions(repo, Ports.free(), extra_env={contract.ALLOW_RAW_FORWARDING_ENV: "1"})
    args.out.mkdir(parents=True, exist_ok=True)
    pool = ClipPool(args.clip_seconds)
    with ready_server(options, args.out / "server.log") as (server, ready_s):
        metrics_url = f"http://127.0.0.1:{options.ports.metrics}/metrics"
        print(f"server ready in {ready_s:.1f} s; warming up", flush=True)
        warm_up = run_round(server.grpc_url, metrics_url, "metadata", pool, args.concurrency, 5.0, args.max_tokens)
        expected = len(warm_up.latencies_s) * args.round_s / 5.0
        rounds = []
        for index in range(args.rounds):
            for arm in ARMS:
                pool.fill(int(1.5 * expected) + args.concurrency)
                done = run_round(server.grpc_url, metrics_url, arm, pool, args.concurrency, args.round_s,
                                 args.max_tokens)  # fmt: skip
                rounds.append(done)
                expected = max(expected, len(done.latencies_s))
                print(f"round {index + 1} {arm}: {done.requests_per_s:.2f} req/s, "
                      f"{len(done.latencies_s)} ok, {done.errors} errors", flush=True)  # fmt: skip
    return {
        "arms": summarize(rounds),
        "rounds": [dataclasses.asdict(r) | {"requests_per_s": r.requests_per_s} for r in rounds],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.audio_forwarding", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "latest" / "audio-forwarding")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--round-s", type=float, default=30.0, help="seconds per arm per round")
    parser.add_argument("--clip-seconds", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    result = serve_and_measure(args)
    result["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result["machine"] = one_line(describe_machine())
    (args.out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    write_plot(result, args.out / "audio-forwarding.png")
    print(table(result["arms"]))
    print(f"machine: {result['machine']}; pid {os.getpid()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``epd`` vs ``llm`` TTFT with a 10 s video clip (issue 16), in one run (not a test).

One tritonserver on a private copy of the cpu repository (its own embedding store), loading
``llm`` and ``epd`` with its stages. For each model, concurrency (1, 4) and pattern:

- ``unique``: ``--requests`` distinct 10 s clips (same size and rate, different pixels), each sent
  once: every ``epd`` request decodes and encodes its video (a store miss), every ``llm`` request
  loads it with vLLM's loader;
- ``repeated``: one clip, sent once to warm up, then ``--requests`` times: ``epd`` serves it from
  the embedding store (0 encodes: counted on /metrics, ``epd_cache_encodes`` of the encoders, and
  from ``cache_hits``); ``llm`` may use vLLM's own multimodal caches.

TTFT is the first streamed response, measured on the client (gRPC streaming); ratios are
epd / llm in the same run (the machine is shared and noisy). ``epd`` runs with its default
(adaptive) path policy. Greedy tokens of epd and llm are compared per request.

    python -m bench.video_ttft [--requests 8] [--out results/latest/video-ttft]

Starts vLLM engines: run it through the machine's server slot.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

from bench.machine import describe_machine, one_line
from bench.metrics import distribution
from bench.server_stats import counter_deltas, scrape_required, sum_counter
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer
from client.epd_client import SYSTEM_PROMPT, GrpcClient

DEFAULT_OUT = REPO_ROOT / "results" / "latest" / "video-ttft"
WORK_DIR = REPO_ROOT / "build" / "bench-video-ttft"
STORE_PATH = "/dev/shm/triton-epd-bench-video-ttft"
MODELS = ("preprocess", "vit_encoder", "encode", "encoder_0", "encoder_1", "prefill", "decode", "epd", "llm")
SAMPLING = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
CLIP = {"codec": "vp9", "width": 320, "height": 240, "fps": 10, "seconds": 10.0}
PROMPT = (
    f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What happens?<|im_end|>\n<|im_start|>assistant\n"
)


def clip(seed: int) -> bytes:
    from tests.videos import ClipSpec, make_clip

    return make_clip(ClipSpec(seed=seed, **CLIP))  # type: ignore[arg-type]


def _repository() -> Path:
    from builders.launcher import prepare
    from builders.repository import TARGETS

    repo = WORK_DIR / "repo"
    shutil.rmtree(repo, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "encoder_*")
    shutil.copytree(REPO_ROOT / "model_repository", repo, ignore=ignore)
    cache = dataclasses.replace(TARGETS["cpu"].cache, path=STORE_PATH)
    prepare("cpu", None, repo, cache)
    shutil.rmtree(STORE_PATH, ignore_errors=True)  # a cold store
    return repo


def _phase(url: str, model: str, videos: list[bytes], concurrency: int) -> list[dict[str, Any]]:
    def one(video: bytes) -> dict[str, Any]:
        client = GrpcClient(url, model)
        try:
            result = client.generate(PROMPT, [], SAMPLING, videos=[video])
        finally:
            client.close()
        return result.summary()

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, videos))


def run(requests: int) -> dict[str, Any]:
    repo = _repository()
    args = ("--model-control-mode=explicit", *(f"--load-model={m}" for m in MODELS))
    options = ServerOptions(repo, Ports.free(), extra_args=args)
    seeds = iter(range(1000, 100_000))
    phases: list[dict[str, Any]] = []
    with TritonServer(options, WORK_DIR / "server.log") as server:
        ready_s = server.wait_ready(timeout_s=1200)
        for concurrency in (1, 4):
            for pattern in ("unique", "repeated"):
                if pattern == "unique":
                    videos = [clip(next(seeds)) for _ in range(requests)]
                else:
                    videos = [clip(next(seeds))] * requests
                for model in ("llm", "epd"):
                    if pattern == "repeated":  # warm-up: the clip is then stored (epd) / cached (llm)
                        _phase(server.grpc_url, model, videos[:1], 1)
                    before = scrape_required(server.metrics_url)
                    records = _phase(server.grpc_url, model, videos, concurrency)
                    deltas = counter_deltas(before, scrape_required(server.metrics_url))
                    phases.append({
                        "model": model,
                        "concurrency": concurrency,
                        "pattern": pattern,
                        "requests": len(records),
                        "encodes": sum_counter(deltas, "epd_cache_encodes") or 0,
                        "cache_hits": sum(r["cache_hits"] or 0 for r in records),
                        "ttft_ms": distribution((r["ttft_s"] for r in records), 1000.0),
                        "e2e_ms": distribution((r["e2e_s"] for r in records), 1000.0),
                        "token_ids": [r["token_ids"] for r in records],
                    })
                    print(json.dumps({k: v for k, v in phases[-1].items() if k != "token_ids"}), flush=True)
    return {"server_ready_s": ready_s, "phases": phases}


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        "# Video: epd vs llm TTFT with a 10 s clip (issue 16)",
        "",
        f"`{summary['command']}`; clip {summary['clip']}; {summary['requests']} requests per phase; "
        f"machine: {one_line(summary['machine'])}.",
        "",
        "| concurrency | pattern | llm TTFT p50 / p90 ms | epd TTFT p50 / p90 ms | epd / llm p50 | epd encodes "
        "| epd cache hits | tokens equal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(p["model"], p["concurrency"], p["pattern"]): p for p in summary["phases"]}
    for concurrency in (1, 4):
        for pattern in ("unique", "repeated"):
            llm, epd = by_key[("llm", concurrency, pattern)], by_key[("epd", concurrency, pattern)]
            lines.append(
                f"| {concurrency} | {pattern} | {llm['ttft_ms']['p50']:.0f} / {llm['ttft_ms']['p90']:.0f} "
                f"| {epd['ttft_ms']['p50']:.0f} / {epd['ttft_ms']['p90']:.0f} "
                f"| {epd['ttft_ms']['p50'] / llm['ttft_ms']['p50']:.2f} | {epd['encodes']:.0f} "
                f"| {epd['cache_hits']} | {summary['tokens_equal'][f'{concurrency}-{pattern}']} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    started = time.monotonic()
    result = run(args.requests)
    by_key = {(p["model"], p["concurrency"], p["pattern"]): p for p in result["phases"]}
    summary = {
        "command": f"python -m bench.video_ttft --requests {args.requests}",
        "machine": describe_machine(),
        "clip": CLIP,
        "requests": args.requests,
        "wall_s": time.monotonic() - started,
        **result,
        "tokens_equal": {
            f"{c}-{p}": by_key[("llm", c, p)]["token_ids"] == by_key[("epd", c, p)]["token_ids"]
            for c in (1, 4)
            for p in ("unique", "repeated")
        },
    }
    for phase in summary["phases"]:
        phase.pop("token_ids")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (args.out / "results.md").write_text(markdown(summary))
    print(markdown(summary))
    shutil.rmtree(STORE_PATH, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

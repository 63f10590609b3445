"""The redistribution experiment: one shared embedding store vs a cache per encoder (not a test).

For each cache scope (``node``: every encoder shares the node store; ``instance``: each
encoder its own key space -- the baseline), in one run:

1. start a tritonserver on a copy of the repository generated with that scope;
2. phase A: ``--images`` distinct images through ``epd``, pinned to ``encoder_0``;
3. phase B: the same images again, pinned to ``encoder_1`` (as after a rebalance or scale-out);
4. count the encodes of phase B from /metrics (``nv_inference_request_success`` of ``encode``
   and each encoder's ``epd_cache_encodes``) and measure TTFT per request on the client.

Writes ``results.json``, ``results.md`` and ``ttft.png`` under ``--out``.

    python -m bench.cache [--images 128] [--concurrency 4] [--out results/latest/cache]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.metrics import distribution
from bench.server_stats import counter_deltas, scrape_required, sum_counter
from builders.machine import describe_machine, one_line
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer
from client.epd_client import GrpcClient, chat_prompt

DEFAULT_OUT = REPO_ROOT / "results" / "latest" / "cache"
WORK_DIR = REPO_ROOT / "build" / "bench-cache"
# Its own store, so a server started from the checkout (tests, make serve) is not disturbed.
STORE_PATH = "/dev/shm/triton-epd-bench-cache"
MODELS = ("preprocess", "vit_encoder", "encode", "encoder_0", "encoder_1", "prefill", "decode", "epd")
SAMPLING = {"max_tokens": 2, "temperature": 0.0}  # TTFT is the point; decode is not


def photo_like_jpeg(width: int, height: int, seed: int) -> bytes:
    """Smooth gradients, shapes and mild noise, JPEG q90: close enough to a photo's cost."""
    import io

    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :, None]
    colors = rng.uniform(0, 255, (2, 2, 3)).astype(np.float32)
    base = (1 - y) * ((1 - x) * colors[0, 0] + x * colors[0, 1]) + y * ((1 - x) * colors[1, 0] + x * colors[1, 1])
    base += rng.normal(0, 4, base.shape).astype(np.float32)
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        radius = int(rng.integers(10, max(11, min(width, height) // 4)))
        draw.ellipse((x0, y0, x0 + radius, y0 + radius), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def images(count: int) -> list[bytes]:
    return [photo_like_jpeg(448, 336, seed=10_000 + i) for i in range(count)]


def private_repository(repo: Path) -> Path:
    """An empty folder at ``repo`` for a benchmark's own server; the caller generates it (the
    builders copy model_repository/'s model code)."""
    shutil.rmtree(repo, ignore_errors=True)
    return repo


@contextmanager
def ready_server(
    options: ServerOptions, log_path: Path, timeout_s: float = 900
) -> Iterator[tuple[TritonServer, float]]:
    """A started server once it is ready, with the seconds that took; stopped on the way out."""
    with TritonServer(options, log_path) as server:
        yield server, server.wait_ready(timeout_s=timeout_s)


def _repository(scope: str) -> Path:
    """A private copy of the repository, generated with ``scope``."""
    from builders.launcher import prepare
    from builders.repository import TARGETS

    repo = private_repository(WORK_DIR / f"repo-{scope}")
    cache = dataclasses.replace(TARGETS["cpu"].cache, scope=scope, path=STORE_PATH, encoders=2)
    prepare("cpu", None, repo, cache)
    shutil.rmtree(STORE_PATH, ignore_errors=True)  # both scopes start cold
    return repo


def _phase(url: str, batch: list[bytes], encoder: str, concurrency: int) -> list[dict[str, Any]]:
    prompt = chat_prompt("Describe the product.", 1)

    def one(image: bytes) -> dict[str, Any]:
        client = GrpcClient(url, "epd")
        try:
            result = client.generate(prompt, [image], SAMPLING, parameters={"encoder": encoder})
        finally:
            client.close()
        return result.summary()

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, batch))


def _of_model(deltas: dict[str, float], model: str) -> dict[str, float]:
    return {name: value for name, value in deltas.items() if f'model="{model}"' in name}


def run_scope(scope: str, batch: list[bytes], concurrency: int) -> dict[str, Any]:
    repo = _repository(scope)
    args = ("--model-control-mode=explicit", *(f"--load-model={m}" for m in MODELS))
    options = ServerOptions(repo, Ports.free(), extra_args=args)
    with ready_server(options, WORK_DIR / f"server-{scope}.log") as (server, started):
        metrics_url = server.metrics_url
        phases: dict[str, Any] = {}
        for phase, encoder in (("A", "encoder_0"), ("B", "encoder_1")):
            before = scrape_required(metrics_url)
            records = _phase(server.grpc_url, batch, encoder, concurrency)
            deltas = counter_deltas(before, scrape_required(metrics_url))
            phases[phase] = {
                "encoder": encoder,
                "requests": len(records),
                "encode_requests": sum_counter(_of_model(deltas, "encode"), "nv_inference_request_success") or 0,
                "encoder_encodes": sum_counter(deltas, "epd_cache_encodes") or 0,
                "cache_hits": sum(r["cache_hits"] or 0 for r in records),
                "ttft_ms": distribution((r["ttft_s"] for r in records), 1000.0),
                "e2e_ms": distribution((r["e2e_s"] for r in records), 1000.0),
                "token_ids": [r["token_ids"] for r in records],
            }
    return {"scope": scope, "server_ready_s": started, "phases": phases}


def markdown(summary: dict[str, Any]) -> str:
    rows = []
    for run in summary["runs"]:
        for phase, data in run["phases"].items():
            ttft = data["ttft_ms"]
            rows.append(
                f"| {run['scope']} | {phase} ({data['encoder']}) | {data['requests']} | "
                f"{data['encode_requests']:.0f} | "
                f"{data['cache_hits']} | {ttft['p50']:.0f} | {ttft['p90']:.0f} | {data['e2e_ms']['p50']:.0f} |"
            )
    ratios = summary["ratios"]
    return "\n".join(
        [
            "# Redistribution: shared embedding store vs a cache per encoder",
            "",
            f"Machine: {one_line(summary['machine'])}",
            "",
            f"Command: `{summary['command']}`",
            "",
            f"{summary['images']} distinct {summary['image_size']} JPEG images through `epd` pinned to `encoder_0` "
            f"(phase A), then the same images pinned to `encoder_1` (phase B), {summary['concurrency']} requests "
            f"in flight, max_tokens={SAMPLING['max_tokens']}. `node`: one store for every encoder (the product's "
            "default); `instance`: each encoder its own key space (the baseline). Encodes are counted on the server "
            '(`nv_inference_request_success{model="encode"}`), TTFT on the client.',
            "",
            "| cache scope | phase | requests | encodes | cache hits | TTFT p50 ms | TTFT p90 ms | e2e p50 ms |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"Phase B repeated encodes: shared {ratios['repeated_encodes_shared']:.0f}, per-instance "
            f"{ratios['repeated_encodes_per_instance']:.0f}.",
            f"Phase B TTFT shared / per-instance: p50 {ratios['ttft_p50_shared_over_per_instance']:.2f}x, "
            f"p90 {ratios['ttft_p90_shared_over_per_instance']:.2f}x.",
            f"Greedy tokens of phase B equal across scopes: {ratios['tokens_equal']}.",
            "",
        ]
    )


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels, p50, p90 = [], [], []
    for run in summary["runs"]:
        phase = run["phases"]["B"]
        labels.append(f"{run['scope']}\n({phase['encode_requests']:.0f} re-encodes)")
        p50.append(phase["ttft_ms"]["p50"])
        p90.append(phase["ttft_ms"]["p90"])
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], p50, 0.4, label="TTFT p50")
    ax.bar([i + 0.2 for i in x], p90, 0.4, label="TTFT p90")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms")
    ax.set_title("Phase B (images moved to encoder_1)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    batch = images(args.images)
    started = time.monotonic()
    runs = [run_scope(scope, batch, args.concurrency) for scope in ("node", "instance")]
    shared, per_instance = (run["phases"]["B"] for run in runs)
    summary = {
        "command": f"python -m bench.cache --images {args.images} --concurrency {args.concurrency}",
        "machine": describe_machine(),
        "images": args.images,
        "image_size": "448x336",
        "concurrency": args.concurrency,
        "wall_s": time.monotonic() - started,
        "runs": runs,
        "ratios": {
            "repeated_encodes_shared": shared["encode_requests"],
            "repeated_encodes_per_instance": per_instance["encode_requests"],
            "ttft_p50_shared_over_per_instance": shared["ttft_ms"]["p50"] / per_instance["ttft_ms"]["p50"],
            "ttft_p90_shared_over_per_instance": shared["ttft_ms"]["p90"] / per_instance["ttft_ms"]["p90"],
            "tokens_equal": shared["token_ids"] == per_instance["token_ids"],
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for run in runs:  # token ids were for the equality check; keep the results file small
        for phase in run["phases"].values():
            phase.pop("token_ids")
    (args.out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown(summary))
    plot(summary, args.out / "ttft.png")
    print(markdown(summary))
    shutil.rmtree(STORE_PATH, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark the encode stage's pieces on this machine, in one run (not a test):

- preprocess: the DALI pipeline (CPU, ``python_backends.preprocess.images``) vs transformers'
  ``Qwen2VLImageProcessor`` (torchvision, the default) and ``Qwen2VLImageProcessorPil``, each
  from encoded bytes to ``pixel_values``, at batch 1 and 8;
- vision encoder: ONNX Runtime (``python_backends.encode.vit_onnx``) vs torch eager (transformers'
  module) on the same preprocessed batches.

Writes ``results.json`` and ``results.md`` under ``--results`` (default results/latest/encode).

    python -m bench.encode [--model DIR] [--images 16] [--repeats 3] [--results DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS = REPO_ROOT / "results" / "latest" / "encode"
# Typical photo/screenshot sizes, cycled over the image set.
IMAGE_SIZES: tuple[tuple[int, int], ...] = ((640, 480), (1280, 720), (1024, 768), (1920, 1080), (800, 600), (720, 1280))


@dataclass(frozen=True)
class Timing:
    stage: str
    implementation: str
    batch_size: int
    images: int
    seconds_per_image: float  # best of the repeats: the machine is shared, noise only adds
    median_seconds_per_image: float
    images_per_second: float


def summarize(stage: str, implementation: str, batch_size: int, images: int, samples: list[float]) -> Timing:
    best = min(samples)
    return Timing(stage, implementation, batch_size, images, best, statistics.median(samples), 1 / best)


def photo_like_jpeg(width: int, height: int, seed: int) -> bytes:
    """Smooth gradients, shapes and mild noise, JPEG q90: close enough to a photo's cost."""
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


def batches(items: Sequence[bytes], batch_size: int) -> list[Sequence[bytes]]:
    return [items[i : i + batch_size] for i in range(0, len(items), batch_size)]


def interleaved_samples(
    runners: dict[str, Callable[[object], object]], work: Sequence[object], images: int, repeats: int
) -> dict[str, list[float]]:
    """Seconds per image per repeat; implementations alternate so load drift hits all alike."""
    for run in runners.values():
        run(work[0])  # warm-up: first-call allocations, thread pools
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            started = time.perf_counter()
            for item in work:
                run(item)
            samples[name].append((time.perf_counter() - started) / images)
    return samples


def bench_preprocess(
    model_dir: Path, images: list[bytes], batch_sizes: Sequence[int], repeats: int, threads: int
) -> list[Timing]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    from python_backends.preprocess.image_pipeline import ImageTransformConfig
    from python_backends.preprocess.images import DaliImagePreprocessor
    from python_backends.request.images import ImageLimits

    config = ImageTransformConfig.from_file(model_dir)
    limits = ImageLimits(max_images=max(batch_sizes), max_image_bytes=64 << 20)
    dali = DaliImagePreprocessor.for_config(config, limits=limits, max_batch_size=max(batch_sizes), num_threads=threads)
    processors = {
        "transformers Qwen2VLImageProcessor (torchvision)": Qwen2VLImageProcessor.from_pretrained(str(model_dir)),
        "transformers Qwen2VLImageProcessorPil": Qwen2VLImageProcessorPil.from_pretrained(str(model_dir)),
    }

    def with_processor(processor: Callable[..., object]) -> Callable[[Sequence[bytes]], object]:
        # Same starting point as DALI: encoded bytes in, pixel_values out (decode included).
        return lambda batch: processor(
            images=[Image.open(io.BytesIO(b)).convert("RGB") for b in batch], return_tensors="np"
        )

    runners: dict[str, Callable[[Sequence[bytes]], object]] = {"DALI pipeline (CPU)": dali.preprocess}
    runners.update({name: with_processor(p) for name, p in processors.items()})
    timings = []
    for batch_size in batch_sizes:
        samples = interleaved_samples(runners, batches(images, batch_size), len(images), repeats)  # type: ignore[arg-type]
        timings += [summarize("preprocess", name, batch_size, len(images), s) for name, s in samples.items()]
    return timings


def bench_encoder(model_dir: Path, images: list[bytes], batch_sizes: Sequence[int], repeats: int) -> list[Timing]:
    from builders.encoder import export_onnx, load_vision_tower, torch_reference
    from python_backends.encode.vit_onnx import OnnxVisionEncoder
    from python_backends.preprocess.image_pipeline import ImageTransformConfig
    from python_backends.preprocess.images import DaliImagePreprocessor
    from python_backends.request.images import ImageLimits

    config = ImageTransformConfig.from_file(model_dir)
    dali = DaliImagePreprocessor.for_config(
        config, limits=ImageLimits(max_images=len(images), max_image_bytes=64 << 20)
    )
    tower = load_vision_tower(model_dir)
    with tempfile.TemporaryDirectory() as scratch:
        encoder = OnnxVisionEncoder(export_onnx(tower, scratch))
    timings = []
    for batch_size in batch_sizes:
        # Preprocess once, outside the timed region: only the encoders are compared here.
        prepared = [dali.preprocess(batch) for batch in batches(images, batch_size)]
        runners = {
            "ONNX Runtime": lambda p: encoder.encode_concatenated(p.pixel_values, p.image_grid_thw),
            "torch eager (transformers)": lambda p: torch_reference(tower, p.pixel_values, p.image_grid_thw),
        }
        samples = interleaved_samples(runners, prepared, len(images), repeats)  # type: ignore[arg-type]
        timings += [summarize("vision encoder", name, batch_size, len(images), s) for name, s in samples.items()]
    return timings


def ratios(timings: list[Timing]) -> dict[str, float]:
    """Speed-ups per image (higher is better for the first named implementation)."""
    by_key = {(t.stage, t.implementation, t.batch_size): t.seconds_per_image for t in timings}
    out = {}
    for batch_size in sorted({t.batch_size for t in timings}):
        dali = by_key.get(("preprocess", "DALI pipeline (CPU)", batch_size))
        for name in ("transformers Qwen2VLImageProcessor (torchvision)", "transformers Qwen2VLImageProcessorPil"):
            other = by_key.get(("preprocess", name, batch_size))
            if dali and other:
                out[f"DALI vs {name}, batch {batch_size}"] = other / dali
        ort = by_key.get(("vision encoder", "ONNX Runtime", batch_size))
        eager = by_key.get(("vision encoder", "torch eager (transformers)", batch_size))
        if ort and eager:
            out[f"ONNX Runtime vs torch eager, batch {batch_size}"] = eager / ort
    return out


def markdown(timings: list[Timing], speedups: dict[str, float], environment: dict[str, object]) -> str:
    lines = [
        "# Encode stage on CPU",
        "",
        f"Environment: {environment}",
        "",
        "| stage | implementation | batch | ms / image (best) | ms / image (median) | images / s (best) |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {t.stage} | {t.implementation} | {t.batch_size} | {t.seconds_per_image * 1e3:.2f} "
        f"| {t.median_seconds_per_image * 1e3:.2f} | {t.images_per_second:.1f} |"
        for t in timings
    ]
    lines += ["", "| speed-up (per image, best of repeats) | ratio |", "| --- | ---: |"]
    lines += [f"| {name} | {value:.2f}x |" for name, value in speedups.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark DALI preprocess and the ONNX vision encoder on CPU")
    parser.add_argument("--model", type=Path, default=None, help="Qwen2-VL checkpoint (default: the built tiny model)")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--images", type=int, default=16, help="distinct images (multiple of the largest batch)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="DALI worker threads")
    args = parser.parse_args(argv)

    from builders.default_model import build_default_model

    model_dir = args.model or build_default_model()
    images = [photo_like_jpeg(*IMAGE_SIZES[i % len(IMAGE_SIZES)], seed=i) for i in range(args.images)]
    timings = bench_preprocess(model_dir, images, args.batch_sizes, args.repeats, args.threads)
    timings += bench_encoder(model_dir, images, args.batch_sizes, args.repeats)
    speedups = ratios(timings)
    environment = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "model": str(model_dir),
        "images": args.images,
        "image_sizes": [f"{w}x{h}" for w, h in IMAGE_SIZES],
        "repeats": args.repeats,
    }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "results.json").write_text(
        json.dumps(
            {"environment": environment, "timings": [asdict(t) for t in timings], "speedups": speedups}, indent=2
        )
        + "\n"
    )
    report = markdown(timings, speedups, environment)
    (args.results / "results.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

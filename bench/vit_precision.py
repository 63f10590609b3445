"""Benchmark: the vision tower under ONNX Runtime fp32 vs OpenVINO f32 vs OpenVINO bf16
(python_backends/encode/vit_openvino.py), one thread per call, on the same images.

    taskset -c 1 python -m bench.vit_precision                       (tiny checkpoint, exported to a tmp dir)
    taskset -c 1 python -m bench.vit_precision --onnx DIR/model.onnx --json out.json

Not a test. Each round encodes the batch (default: the 4 images of docs/benchmarks/encode.md,
grids 1x32x32, 1x26x36, 1x26x36, 1x32x32, folded rows of seeded standard-normal values) once per
runner, runners interleaved, after one warm-up round (OpenVINO builds its kernels per new shape
there). Per runner: median wall ms and process CPU ms of a round, and the embeddings' max-abs
difference and minimum row cosine against ONNX Runtime fp32. Pin it to one core (``taskset``)
so the numbers do not depend on the machine's other load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from python_backends.encode.vit_onnx import OnnxVisionEncoder
from python_backends.encode.vit_openvino import OpenVinoVisionEncoder, bf16_flags, cpu_flags

ARTICLE_GRIDS: tuple[tuple[int, int, int], ...] = ((1, 32, 32), (1, 26, 36), (1, 26, 36), (1, 32, 32))
DEFAULT_MODEL = Path("build/models/tiny-qwen2-vl")

Encode = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _export(model_dir: Path, out_dir: Path) -> Path:
    from builders.encoder import export_onnx, load_vision_tower

    return export_onnx(load_vision_tower(model_dir), out_dir)


def _min_cosine(actual: np.ndarray, expected: np.ndarray) -> float:
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    return float(((a * e).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(e, axis=1))).min())


def measure(onnx_path: Path, grids: tuple[tuple[int, int, int], ...], rounds: int, seed: int = 0) -> dict:
    runners: dict[str, Encode] = {"ort_fp32": OnnxVisionEncoder(onnx_path, threads=1).encode_concatenated}
    runners["openvino_f32"] = OpenVinoVisionEncoder(onnx_path, threads=1, precision="f32").encode_concatenated
    if bf16_flags(cpu_flags()):
        runners["openvino_bf16"] = OpenVinoVisionEncoder(onnx_path, threads=1, precision="bf16").encode_concatenated
    grid = np.asarray(grids, dtype=np.int64)
    rows = int(np.prod(grid, axis=1).sum())
    width = OnnxVisionEncoder(onnx_path, threads=1).shape.folded_patch_dim
    pixels = np.random.default_rng(seed).standard_normal((rows, width), dtype=np.float32)

    first_ms, outputs = {}, {}
    for name, encode in runners.items():
        started = time.perf_counter()
        outputs[name] = encode(pixels, grid)
        first_ms[name] = (time.perf_counter() - started) * 1e3
    wall: dict[str, list[float]] = {name: [] for name in runners}
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, encode in runners.items():
            wall_0, cpu_0 = time.perf_counter(), time.process_time()
            out = encode(pixels, grid)
            wall[name].append((time.perf_counter() - wall_0) * 1e3)
            cpu[name].append((time.process_time() - cpu_0) * 1e3)
            assert np.array_equal(out, outputs[name]), f"{name}: a round changed the embeddings"
    reference = outputs["ort_fp32"]
    results = {
        name: {
            "median_ms": statistics.median(wall[name]),
            "median_cpu_ms": statistics.median(cpu[name]),
            "first_round_ms": first_ms[name],
            "max_abs_vs_ort": float(np.abs(outputs[name] - reference).max()),
            "min_cosine_vs_ort": _min_cosine(outputs[name], reference),
        }
        for name in runners
    }
    return {
        "onnx": str(onnx_path),
        "grids": [list(g) for g in grids],
        "rounds": rounds,
        "cpus": sorted(os.sched_getaffinity(0)),
        "bf16_flags": list(bf16_flags(cpu_flags())),
        "output_max_abs": float(np.abs(reference).max()),
        "results": results,
    }


def table(report: dict) -> str:
    base = report["results"]["ort_fp32"]["median_ms"]
    lines = [
        "| runner | median ms | CPU ms | speed-up | first round ms | max-abs vs ORT | min cosine vs ORT |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["results"].items():
        lines.append(
            f"| {name} | {r['median_ms']:.1f} | {r['median_cpu_ms']:.1f} | {base / r['median_ms']:.2f}x | "
            f"{r['first_round_ms']:.1f} | {r['max_abs_vs_ort']:.3g} | {r['min_cosine_vs_ort']:.7f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--onnx", type=Path, help="an exported model.onnx (default: export --model)")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint to export")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vit_precision_") as tmp:
        onnx_path = args.onnx or _export(args.model, Path(tmp))
        report = measure(onnx_path, ARTICLE_GRIDS, args.rounds)
    print(f"cpus {report['cpus']}, bf16 flags {report['bf16_flags']}, |embeds| max {report['output_max_abs']:.3g}")
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The GPU embedding store on a GPU machine: what a reader process pays to get an embedding
another process wrote, by reference (CUDA IPC view) vs by value (through host memory).

For each embedding size the writer (this process) stores a CUDA tensor; a reader process
(spawned, as a Triton model instance would be) then times, median of ``--reps``:

- ``view``: ``store.open_view(reference)`` + ``torch.as_tensor(view, device="cuda")``: the
  reference lookup, lease checks and a zero-copy wrap of the writer's device bytes;
- ``by_value``: the least that passing the same tensor by value through host memory costs
  (device -> host, host -> device, as Triton's CPU tensors would carry it), no serialization.

The ratio is view / by_value in the same run. Also: the writer's ``put`` (one device-to-device
copy + the LMDB transaction) and the reference's size. Writes results.json and results.md.

    python -m bench.gpu_store --out results/latest/gpu_store
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from python_backends.store import EmbeddingStore, StoreConfig, content_key

SIZES = ((256, 1536), (1024, 3584), (4096, 3584), (16384, 3584))  # [tokens, hidden] fp16


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 4)


def _reader(config: StoreConfig, references: list[bytes], reps: int, queue) -> None:
    import torch

    rows = []
    with EmbeddingStore(config) as store:
        for raw in references:
            views, copies = [], []
            for _ in range(reps):
                start = time.perf_counter()
                with store.open_view(raw) as view:
                    tensor = torch.as_tensor(view, device="cuda")
                    views.append(time.perf_counter() - start)
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    copied = tensor.cpu().cuda()
                    torch.cuda.synchronize()
                    copies.append(time.perf_counter() - start)
                    assert torch.equal(copied, tensor)
            rows.append({"view_ms": _median_ms(views), "by_value_ms": _median_ms(copies)})
    queue.put(rows)


def measure(reps: int) -> list[dict[str, Any]]:
    import torch

    capacity = 2 * sum(rows * hidden * 2 for rows, hidden in SIZES)  # the kept entries + churn
    with tempfile.TemporaryDirectory(prefix="epd-gpu-bench-", dir="/dev/shm") as path:
        config = StoreConfig(path=path, capacity_bytes=capacity, device="cuda:0")
        with EmbeddingStore(config) as store:
            results, references = [], []
            for rows, hidden in SIZES:
                tensor = torch.randn((rows, hidden), device="cuda", dtype=torch.float16)
                puts = []
                for rep in range(reps):
                    key = content_key(f"{rows}x{hidden}:{rep}".encode(), {}, "bench")
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    reference = store.put(key, tensor)
                    puts.append(time.perf_counter() - start)
                    if rep < reps - 1:
                        store.release(reference)  # the last one stays leased for the reader
                references.append(reference.to_bytes())
                results.append(
                    {
                        "tokens": rows,
                        "hidden": hidden,
                        "embedding_bytes": rows * hidden * 2,
                        "reference_bytes": len(references[-1]),
                        "put_ms": _median_ms(puts),
                    }
                )
            queue = multiprocessing.get_context("spawn").Queue()
            reader = multiprocessing.get_context("spawn").Process(
                target=_reader, args=(config, references, reps, queue)
            )
            reader.start()
            for row, timings in zip(results, queue.get(timeout=600), strict=True):
                row.update(timings)
                row["view_vs_by_value"] = round(row["view_ms"] / row["by_value_ms"], 4)
            reader.join(timeout=60)
    return results


def write(results: list[dict[str, Any]], out: Path, gpu: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"gpu": gpu, "rows": results}, indent=2) + "\n")
    lines = [
        "# GPU embedding store: reader cost by reference (CUDA IPC view) vs by value",
        "",
        f"GPU: {gpu}. Command: `python -m bench.gpu_store`. Medians; ratios from this run.",
        "",
        "| embedding [tokens, hidden] fp16 | bytes | reference bytes | put ms | view ms | by-value ms | view / "
        "by-value |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results:
        lines.append(
            f"| [{row['tokens']}, {row['hidden']}] | {row['embedding_bytes']:,} | {row['reference_bytes']} | "
            f"{row['put_ms']} | {row['view_ms']} | {row['by_value_ms']} | {row['view_vs_by_value']} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/latest/gpu_store"))
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    import torch

    gpu = torch.cuda.get_device_name(0)
    results = measure(args.reps)
    write(results, args.out, gpu)
    print((args.out / "results.md").read_text())


if __name__ == "__main__":
    main()

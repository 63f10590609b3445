"""Bytes that cross Triton per image between the encoder and the LLM: `epd` (a reference)
vs the by-value `ensemble` (the embeddings), measured on a running server (not a test).

For each image size: one `epd` request, and the server's counters of what `prefill` received
(``epd_prefill_input_bytes{kind="reference"}`` / ``epd_prefill_references``); one `encode`
request for the same image, whose ``image_embeds`` are exactly what `ensemble` hands `llm`.
The last column projects the by-value size for Qwen2-VL-2B/7B (merger output 1536/3584,
bf16) from the same token count: the reference does not grow.

Writes ``results.json`` and ``results.md`` under ``--out``.

    python -m bench.reference_bytes [--out results/latest/reference_bytes]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.machine import describe_machine, one_line
from bench.server_stats import scrape
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer
from client.epd_client import GrpcClient, chat_prompt

DEFAULT_OUT = REPO_ROOT / "results" / "latest" / "reference_bytes"
SIZES = ((64, 64), (448, 336), (640, 480), (1280, 720), (1920, 1080), (3840, 2160))
MODELS = ("preprocess", "vit_encoder", "encode", "encoder_0", "encoder_1", "prefill", "decode", "epd")
REAL_MODELS = {"Qwen2-VL-2B": 1536, "Qwen2-VL-7B": 3584}  # merger output width


def _counter(url: str, name: str) -> float:
    snapshot = scrape(url)
    assert snapshot is not None, f"no metrics at {url}"
    return sum(
        v for (metric, labels), v in snapshot.counters.items() if metric == name and ("kind", "media") not in labels
    )


def _encode_bytes(url: str, image: bytes) -> tuple[int, int]:
    """(bytes of image_embeds, tokens) that `encode` returns for ``image``."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        tensor = grpcclient.InferInput("image", [1, len(image)], "UINT8")
        tensor.set_data_from_numpy(np.frombuffer(image, dtype=np.uint8)[None])
        result = client.infer("encode", [tensor])
        embeds = result.as_numpy("image_embeds")
        return int(embeds.nbytes), int(embeds.shape[-2])
    finally:
        client.close()


def measure(server: TritonServer) -> list[dict[str, Any]]:
    from bench.encode import photo_like_jpeg

    epd = GrpcClient(server.grpc_url, "epd")
    rows = []
    try:
        for i, (width, height) in enumerate(SIZES):
            image = photo_like_jpeg(width, height, seed=20_000 + i)
            bytes_before = _counter(server.metrics_url, "epd_prefill_input_bytes")
            refs_before = _counter(server.metrics_url, "epd_prefill_references")
            epd.generate(chat_prompt("How big?", 1), [image], {"max_tokens": 1, "temperature": 0.0})
            sent = _counter(server.metrics_url, "epd_prefill_input_bytes") - bytes_before
            refs = _counter(server.metrics_url, "epd_prefill_references") - refs_before
            by_value, tokens = _encode_bytes(server.grpc_url, image)
            rows.append(
                {
                    "image": f"{width}x{height}",
                    "tokens": tokens,
                    "reference_bytes": sent / refs,
                    "by_value_bytes": by_value,
                    "by_value_over_reference": by_value / (sent / refs),
                    **{f"by_value_bytes_{name}_bf16": tokens * width_ * 2 for name, width_ in REAL_MODELS.items()},
                }
            )
    finally:
        epd.close()
    return rows


def report_head(title: str, machine: dict[str, Any], command: str) -> list[str]:
    """A results.md's first lines: the title, the machine and the command that made it."""
    return [f"# {title}", "", f"Machine: {one_line(machine)}", "", f"Command: `{command}`", ""]


def table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A Markdown table: a header row, its rule and one line per row (cells already formatted)."""
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def markdown(summary: dict[str, Any]) -> str:
    columns = ("image", "tokens", "reference bytes", "by-value bytes (tiny, fp32)", "ratio", "Qwen2-VL-2B bf16",
               "Qwen2-VL-7B bf16")  # fmt: skip
    rows = [
        (row["image"], row["tokens"], f"{row['reference_bytes']:.0f}", f"{row['by_value_bytes']:,}",
         f"{row['by_value_over_reference']:.0f}x", f"{row['by_value_bytes_Qwen2-VL-2B_bf16']:,}",
         f"{row['by_value_bytes_Qwen2-VL-7B_bf16']:,}")  # fmt: skip
        for row in summary["rows"]
    ]
    lines = [
        *report_head(
            "Bytes per image between the encoder and the LLM: reference (`epd`) vs by value (`ensemble`)",
            summary["machine"],
            summary["command"],
        ),
        "`epd`: what `prefill` received per image, from the server's counters "
        '(`epd_prefill_input_bytes{kind="reference"}` / `epd_prefill_references`; `kind="media"` stays 0). '
        "By value: the `image_embeds` that `encode` returns and `ensemble` passes to `llm` (fp32, tiny model, "
        "hidden 128); the last two columns are the same token count at Qwen2-VL-2B/7B width in bf16.",
        "",
        *table(columns, rows),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    from builders.launcher import prepare

    prepare("cpu", None, REPO_ROOT / "model_repository")
    extra = ("--model-control-mode=explicit", *(f"--load-model={m}" for m in MODELS))
    options = ServerOptions(REPO_ROOT / "model_repository", Ports.free(), extra_args=extra)
    with TritonServer(options, REPO_ROOT / "build" / "bench-reference-bytes.log") as server:
        server.wait_ready(timeout_s=900)
        rows = measure(server)
    summary = {"command": "python -m bench.reference_bytes", "machine": describe_machine(), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown(summary))
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

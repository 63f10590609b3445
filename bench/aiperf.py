"""AIPerf (NVIDIA's LLM benchmark client, ``make aiperf-tools``): its input files, its command
line and its results, for the same requests our harness and perf_analyzer send.

AIPerf 0.13.0 lives in a venv of its own (``.venv-aiperf``): its pins clash with vLLM's. We give
it our requests verbatim instead of letting it write its own:

* Against our OpenAI API: ``--custom-dataset-type raw_payload``, one JSON line per request, each
  the chat-completions body our harness sends (``bench.openai_target.chat_body``: system message,
  the images as ``data:`` URIs before the text, ``max_tokens``, greedy, ``ignore_eos``,
  ``stream`` with usage). AIPerf sends each line as it is; ``--endpoint-type chat`` reads the
  SSE answers.
* Against Triton itself: AIPerf 0.13.0 has no Triton/KServe endpoint type (no gRPC client at
  all: its only transport is HTTP), but its ``raw`` endpoint posts a body as it is to a URL, so
  it can call Triton's HTTP generate extension (``/v2/models/<model>/generate_stream``, SSE).
  The bodies are perf_analyzer's data entries in JSON (``bench.perf_analyzer.data_entry``,
  images as base64 strings), read by AIPerf's ``inputs_json`` dataset type, and
  ``response_field:text_output`` tells it where the text is. Triton's events carry no OpenAI
  ``usage``, so AIPerf counts output tokens by tokenizing the text it got back.

:func:`read_export` reads AIPerf's ``profile_export_aiperf.json`` (a top-level object per metric
tag, each with ``unit``, ``avg`` and percentiles ``p1``..``p99``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.openai_target import chat_body
from bench.perf_analyzer import data_entry
from bench.workload import BenchRequest
from builders.tritonserver import REPO_ROOT

AIPERF_VERSION = "0.13.0"
AIPERF_VENV = REPO_ROOT / ".venv-aiperf"
EXPORT_FILE = "profile_export_aiperf.json"
# AIPerf's metric tags -> the names our rows use (milliseconds for latencies, as AIPerf exports them).
EXPORT_METRICS = {
    "request_throughput": ("avg", "req_per_s"),
    "time_to_first_token": ("p50", "ttft_p50_ms"),
    "inter_token_latency": ("p50", "itl_p50_ms"),
    "inter_chunk_latency": ("p50", "chunk_gap_p50_ms"),
    "request_latency": ("p50", "e2e_p50_ms"),
    "output_sequence_length": ("avg", "output_tokens_mean"),
    "request_count": ("avg", "completed"),
    "error_request_count": ("avg", "failed"),
}


def locate(venv: Path = AIPERF_VENV) -> tuple[Path | None, str]:
    """The ``aiperf`` executable of ``make aiperf-tools``, or None and why not."""
    binary = venv / "bin" / "aiperf"
    if not binary.is_file():
        return None, f"AIPerf is not installed in {venv}: run `make aiperf-tools`"
    if not list(venv.glob(f"lib/python*/site-packages/aiperf-{AIPERF_VERSION}.dist-info")):
        return None, f"{venv} holds another AIPerf than {AIPERF_VERSION}: remove it and run `make aiperf-tools`"
    return binary, ""


def chat_payloads(requests: Sequence[BenchRequest], model: str) -> list[dict[str, Any]]:
    """Our harness's chat-completions body for each request (AIPerf's ``raw_payload`` lines)."""
    return [chat_body(request, model) for request in requests]


def generate_payloads(requests: Sequence[BenchRequest]) -> list[dict[str, Any]]:
    """Triton generate-extension bodies: perf_analyzer's entries with JSON values (one element
    per input, images as base64 strings), streaming on."""
    bodies = []
    for request in requests:
        entry = data_entry(request, "b64")
        body: dict[str, Any] = {name: value[0] for name, value in entry.items() if name != "image"}
        if "image" in entry:
            body["image"] = entry["image"]["content"]
        bodies.append(body)
    return bodies


def write_raw_payloads(payloads: Sequence[dict[str, Any]], path: Path) -> Path:
    """``raw_payload`` JSONL: one request body per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(p) + "\n" for p in payloads))
    return path


def write_inputs_json(payloads: Sequence[dict[str, Any]], path: Path) -> Path:
    """``inputs_json``: AIPerf's inputs-file shape, one single-turn session per request."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = [{"session_id": f"request-{i}", "payloads": [p]} for i, p in enumerate(payloads)]
    path.write_text(json.dumps({"data": data}) + "\n")
    return path


def profile_command(
    aiperf: Path,
    *,
    model: str,
    url: str,
    input_file: Path,
    dataset_type: str,
    concurrency: int,
    requests: int,
    tokenizer: Path,
    artifact_dir: Path,
    endpoint_type: str = "chat",
    server_token_count: bool = True,
    extra_inputs: Sequence[str] = (),
) -> list[str]:
    """``aiperf profile``, closed loop at ``concurrency``, every line of ``input_file`` once in
    order (sequential sampling), streaming, no live UI. No warm-up of its own (no
    ``--warmup-request-count``: AIPerf's default is none; the run warms the server before any client)."""
    command = [
        str(aiperf), "profile", "--model", model, "--url", url, "--endpoint-type", endpoint_type, "--streaming",
        "--input-file", str(input_file), "--custom-dataset-type", dataset_type,
        "--dataset-sampling-strategy", "sequential",
        "--concurrency", str(concurrency), "--request-count", str(requests),
        "--tokenizer", str(tokenizer), "--artifact-dir", str(artifact_dir), "--ui-type", "none",
        "--no-gpu-telemetry", "--no-server-metrics",
    ]  # fmt: skip
    if server_token_count:  # usage.completion_tokens instead of re-tokenizing the text
        command.append("--use-server-token-count")
    for extra in extra_inputs:
        command += ["--extra-inputs", extra]
    return command


def read_export(path: Path) -> dict[str, Any]:
    """Our row's fields from ``profile_export_aiperf.json``; a metric AIPerf did not export is None."""
    exported = json.loads(path.read_text())
    row: dict[str, Any] = {}
    for tag, (stat, name) in EXPORT_METRICS.items():
        metric = exported.get(tag)
        row[name] = metric.get(stat) if isinstance(metric, dict) else None
    row["completed"] = int(row["completed"]) if row["completed"] is not None else 0
    row["failed"] = int(row["failed"]) if row["failed"] is not None else 0
    row["aiperf_version"] = exported.get("aiperf_version")
    # The profiling phase's start and end (local time, as this machine's clock): the measured window.
    for key in ("start_time", "end_time"):
        row[f"window_{key.split('_')[0]}"] = (
            datetime.fromisoformat(exported[key]).timestamp() if exported.get(key) else None
        )
    errors = exported.get("error_summary") or []
    row["errors"] = [str(e)[:300] for e in errors][:5]
    return row

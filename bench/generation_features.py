"""What do structured outputs and logprobs cost on each serving path, against plain requests?

Per path (``llm``; ``epd`` with ``path`` = ``colocated``; ``epd`` with ``path`` = ``disaggregated``:
prefill -> KV transfer -> decode, the grammar compiled on both sides) and mode:

- ``plain``: greedy, 32 tokens at most; ``plain-control``: the same again, the noise;
- ``json_schema``: a small bounded schema (tests/server/test_generation_features.py's), with a
  logit_bias of -100 on the tokenizer's whitespace-only tokens so that the random-weight model ends
  its JSON (greedy, it would write whitespace, which JSON allows without end), 128 tokens at most;
- ``regex``: ``[a-z]+( [a-z]+)*``, words until the 32-token limit: a plain request's length under a
  grammar;
- ``logprobs-5``, ``logprobs-20``: the top 5 / 20 alternatives of every output token;
  ``prompt-logprobs-5``: the top 5 of every prompt token (vLLM then skips reading the prefix cache).

One request at a time on its own gRPC stream, every (path, mode) once per round in a seeded shuffle
of its own, so that the requests compared ran seconds apart. Round r's requests share one prompt
and one image from a pool of ``--images`` pictures; a warm-up round (not counted) sends every pool
image on every path first, so the measured requests find their image in the embedding store and
vLLM's prefix cache (on for ``llm`` and prefill, off on decode by design): encoding is not what is
measured, the feature is.

    python -m bench.generation_features --requests 20 --out results/generation-features/latest
    python -m bench.generation_features --url 127.0.0.1:8001 --requests 20    (a server already running)

Without ``--url`` it writes ``build/repo-generation-features`` (the default tiny model, the cpu
target, a store and KV folder of its own) and serves it on free ports for the run. Outputs in
``--out``: ``requests.jsonl`` (one line per request), ``summary.json``, ``README.md`` (the table).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import queue
import random
import re
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Path name -> (model, the ``path`` request parameter).
PATHS: dict[str, tuple[str, str | None]] = {
    "llm": ("llm", None),
    "epd colocated": ("epd", "colocated"),
    "epd disaggregated": ("epd", "disaggregated"),
}
MODES = ("plain", "plain-control", "json_schema", "regex", "logprobs-5", "prompt-logprobs-5", "logprobs-20")
BASELINE = "plain"
MAX_TOKENS = 32
JSON_MAX_TOKENS = 128
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["photo", "drawing", "chart"]},
        "objects": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "count": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["name", "count"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["title", "kind", "objects"],
    "additionalProperties": False,
}
REGEX = "[a-z]+( [a-z]+)*"
IMAGE_SIZES = ((320, 240), (256, 256), (448, 224), (200, 300))
RESPONSE_TIMEOUT_S = 300.0


def mode_sampling(mode: str, whitespace_bias: Mapping[str, float]) -> dict[str, Any]:
    """The ``sampling_parameters`` of one mode; ``whitespace_bias``: token id -> -100 for the
    tokenizer's whitespace-only tokens (the JSON mode's)."""
    sampling: dict[str, Any] = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
    if mode in ("plain", "plain-control"):
        return sampling
    if mode == "json_schema":
        return {**sampling, "max_tokens": JSON_MAX_TOKENS, "structured_outputs": {"json": SCHEMA},
                "logit_bias": dict(whitespace_bias)}  # fmt: skip
    if mode == "regex":
        return {**sampling, "structured_outputs": {"regex": REGEX}}
    if match := re.fullmatch(r"(prompt-)?logprobs-(\d+)", mode):
        return {**sampling, ("prompt_logprobs" if match.group(1) else "logprobs"): int(match.group(2))}
    raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")


def whitespace_tokens(model_dir: Path, closing: bool = False) -> dict[str, float]:
    """A ``logit_bias``: -100 for every token that decodes to whitespace only (greedy, a random-weight
    model writes whitespace, which JSON allows without end) and, with ``closing``, a push towards the
    tokens that close a JSON string (most) and an object (a free-form JSON object otherwise grows
    until max_tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    bias = {str(i): -100.0 for i, text in enumerate(texts) if not text.strip()}
    if closing:
        bias |= {str(i): {'"': 20.0, "}": 10.0}[text] for i, text in enumerate(texts) if text in ('"', "}")}
    return bias


def valid(mode: str, text: str, finish_reason: str) -> bool | None:
    """Whether a constrained answer is in its language (None for unconstrained modes). JSON strings
    may hold raw control characters (the tiny checkpoint's byte tokens; the grammar lets them
    through), so the parser is not strict. A regex answer cut by the token limit may end in a space."""
    if mode == "json_schema":
        import jsonschema

        try:
            jsonschema.validate(json.loads(text, strict=False), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if mode == "regex":
        return re.fullmatch(REGEX, text.rstrip(" ") if finish_reason == "length" else text) is not None
    return None


def schedule(
    rounds: int, seed: int, paths: Sequence[str] = tuple(PATHS), modes: Sequence[str] = MODES
) -> list[list[tuple[str, str]]]:
    """Per round, every (path, mode) once, in a seeded shuffle of that round's own."""
    order = []
    for round_ in range(rounds):
        pairs = [(path, mode) for path in paths for mode in modes]
        random.Random(f"{seed}:{round_}").shuffle(pairs)
        order.append(pairs)
    return order


# --------------------------------------------------------------------------------------------
# One request


@dataclass
class Sample:
    """One request as measured (a line of requests.jsonl)."""

    round: int
    path: str
    mode: str
    e2e_ms: float | None = None  # send -> the response with the last token
    ttft_ms: float | None = None  # send -> the first response with a token
    output_tokens: int = 0
    finish_reason: str = ""
    serving_path: str | None = None
    logprobs_positions: int = 0  # output positions that came with logprobs
    prompt_logprobs_positions: int = 0
    logprobs_bytes: int = 0  # the JSON text of logprobs and prompt_logprobs, as received
    valid: bool | None = None
    text: str = ""
    error: str | None = None
    responses: int = 0
    token_ids: list[int] = field(default_factory=list)


def send(client: Any, model: str, path: str | None, prompt: str, images: Sequence[bytes],
         sampling: dict[str, Any], sample: Sample) -> Sample:  # fmt: skip
    """One streaming request on its own gRPC stream, timed into ``sample``."""
    import tritonclient.grpc as grpcclient

    from client.epd_client import build_inputs

    responses: queue.Queue = queue.Queue()
    inputs = build_inputs(grpcclient, prompt, images, True, sampling, None)
    client.start_stream(callback=lambda result, error: responses.put((result, error, time.perf_counter())))
    try:
        started = time.perf_counter()
        client.async_stream_infer(model, inputs, enable_empty_final_response=True,
                                  parameters=None if path is None else {"path": path})  # fmt: skip
        while True:
            try:
                result, error, arrived = responses.get(timeout=RESPONSE_TIMEOUT_S)
            except queue.Empty:
                sample.error = f"no response in {RESPONSE_TIMEOUT_S:.0f} s"
                return sample
            if error is not None:
                sample.error = error.message()
                return sample
            sample.responses += 1
            tokens = result.as_numpy("output_token_ids")
            if tokens is not None and tokens.size:
                sample.token_ids += [int(t) for t in tokens.reshape(-1)]
                elapsed_ms = (arrived - started) * 1e3
                sample.ttft_ms = elapsed_ms if sample.ttft_ms is None else sample.ttft_ms
                sample.e2e_ms = elapsed_ms
            if (text := result.as_numpy("text_output")) is not None:
                sample.text += "".join(t.decode() for t in text.reshape(-1))
            if (reason := result.as_numpy("finish_reason")) is not None:
                sample.finish_reason = reason.reshape(-1)[0].decode() or sample.finish_reason
            for name in ("logprobs", "prompt_logprobs"):  # JSON null when not asked
                raw = result.as_numpy(name).reshape(-1)[0]
                positions = len(json.loads(raw) or [])
                sample.logprobs_bytes += len(raw) if positions else 0
                if name == "logprobs":
                    sample.logprobs_positions += positions
                else:
                    sample.prompt_logprobs_positions += positions
            if (served := result.as_numpy("serving_path")) is not None:
                sample.serving_path = served.reshape(-1)[0].decode()
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                sample.output_tokens = len(sample.token_ids)
                sample.valid = valid(sample.mode, sample.text, sample.finish_reason)
                return sample
    finally:
        client.stop_stream()


# --------------------------------------------------------------------------------------------
# Summary


def percentile(values: Sequence[float], q: float) -> float | None:
    """numpy's linear interpolation; None without values."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def ms_per_token(sample: Mapping[str, Any]) -> float | None:
    """Decode time per output token after the first: (e2e - TTFT) / (tokens - 1)."""
    tokens, e2e, ttft = sample.get("output_tokens") or 0, sample.get("e2e_ms"), sample.get("ttft_ms")
    if tokens < 2 or e2e is None or ttft is None:
        return None
    return (e2e - ttft) / (tokens - 1)


def _rank(name: str, known: Sequence[str]) -> int:
    """The position of a known path or mode (the others after them, in first-seen order: sorted is stable)."""
    return list(known).index(name) if name in known else len(known)


def _ratio(value: float | None, baseline: float | None) -> float | None:
    return None if value is None or not baseline else value / baseline


def summarize(samples: Sequence[Mapping[str, Any]], baseline: str = BASELINE) -> dict[str, dict[str, dict[str, Any]]]:
    """Per path and mode (in :data:`PATHS` and :data:`MODES` order): requests, errors, median / p90
    e2e ms, median TTFT, median decode ms per token, median output tokens, valid answers, and the
    ratios of median e2e and of median ms/token against the path's ``baseline`` mode. Failed
    requests count as errors only."""
    groups: dict[str, dict[str, list[Mapping[str, Any]]]] = {}
    for sample in samples:
        groups.setdefault(sample["path"], {}).setdefault(sample["mode"], []).append(sample)
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for path, modes in sorted(groups.items(), key=lambda item: _rank(item[0], PATHS)):
        rows: dict[str, dict[str, Any]] = {}
        for mode, group in sorted(modes.items(), key=lambda item: _rank(item[0], MODES)):
            done = [s for s in group if s.get("error") is None and s.get("e2e_ms") is not None]
            e2e = [s["e2e_ms"] for s in done]
            per_token = [v for s in done if (v := ms_per_token(s)) is not None]
            checked = [s["valid"] for s in done if s.get("valid") is not None]
            rows[mode] = {
                "requests": len(group),
                "errors": len(group) - len(done),
                "first_error": next((s["error"] for s in group if s.get("error")), None),
                "e2e_ms_p50": percentile(e2e, 50),
                "e2e_ms_p90": percentile(e2e, 90),
                "ttft_ms_p50": percentile([s["ttft_ms"] for s in done], 50),
                "ms_per_token_p50": percentile(per_token, 50),
                "output_tokens_p50": percentile([s["output_tokens"] for s in done], 50),
                "valid": sum(checked) if checked else None,
                "serving_paths": sorted({s.get("serving_path") or "-" for s in done}),
            }
        base = rows.get(baseline, {})
        for row in rows.values():
            row["e2e_ratio"] = _ratio(row["e2e_ms_p50"], base.get("e2e_ms_p50"))
            row["ms_per_token_ratio"] = _ratio(row["ms_per_token_p50"], base.get("ms_per_token_p50"))
        summary[path] = rows
    return summary


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(summary: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    lines = [
        "| path | mode | ok / sent | output tokens (p50) | e2e ms p50 | e2e ms p90 | TTFT ms p50 "
        "| decode ms/token p50 | e2e / plain | ms/token / plain |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for path, rows in summary.items():
        for mode, row in rows.items():
            ok = row["requests"] - row["errors"]
            sent = f"{ok} / {row['requests']}" + (f" ({row['valid']} valid)" if row["valid"] is not None else "")
            lines.append(
                f"| {path} | {mode} | {sent} | {_num(row['output_tokens_p50'])} | {_num(row['e2e_ms_p50'])} "
                f"| {_num(row['e2e_ms_p90'])} | {_num(row['ttft_ms_p50'])} | {_num(row['ms_per_token_p50'], 1)} "
                f"| {_num(row['e2e_ratio'], 2)}x | {_num(row['ms_per_token_ratio'], 2)}x |"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The run


def pool_images(count: int, seed: int = 7700) -> list[bytes]:
    from bench.workload import synthetic_image

    sizes = [IMAGE_SIZES[i % len(IMAGE_SIZES)] for i in range(count)]
    return [synthetic_image(width, height, seed=seed + i) for i, (width, height) in enumerate(sizes)]


def round_prompt(round_: int) -> str:
    from client.epd_client import chat_prompt

    return chat_prompt(f"Request {round_}: describe the picture as asked.", 1)


def run(url: str, model_dir: Path, rounds: int, seed: int, image_count: int,
        log: Any = print) -> tuple[list[Sample], list[Sample]]:  # fmt: skip
    """The warm-up round and the measured rounds: (warm-up samples, measured samples)."""
    import tritonclient.grpc as grpcclient

    bias = whitespace_tokens(model_dir)
    images = pool_images(image_count)
    client = grpcclient.InferenceServerClient(url)
    try:
        warm: list[Sample] = []
        # Warm-up: every pool image on every path (encoded, stored, prefix-cached), every mode once.
        for index, image in enumerate(images):
            for path, (model, parameter) in PATHS.items():
                modes = MODES if index == 0 else ("plain",)
                for mode in modes:
                    sample = Sample(-1, path, mode)
                    warm.append(send(client, model, parameter, round_prompt(-1 - index), [image],
                                     mode_sampling(mode, bias), sample))  # fmt: skip
        measured: list[Sample] = []
        for round_, pairs in enumerate(schedule(rounds, seed)):
            prompt, image = round_prompt(round_), images[round_ % len(images)]
            for path, mode in pairs:
                model, parameter = PATHS[path]
                measured.append(send(client, model, parameter, prompt, [image], mode_sampling(mode, bias),
                                     Sample(round_, path, mode)))  # fmt: skip
            failed = sum(s.error is not None for s in measured[-len(pairs) :])
            log(f"round {round_ + 1}/{rounds}: {len(pairs)} requests" + (f", {failed} failed" if failed else ""))
        return warm, measured
    finally:
        client.close()


@contextlib.contextmanager
def served(log: Path) -> Iterator[tuple[str, Path]]:
    """A server of the default model (the cpu target) with a store and KV folder of its own: its
    gRPC URL and the model folder."""
    from builders.launcher import prepare
    from builders.repository import TARGETS
    from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer

    node = Path("/dev/shm/triton-epd-bench-generation-features")
    shutil.rmtree(node, ignore_errors=True)
    node.mkdir(parents=True)
    repository = REPO_ROOT / "build" / "repo-generation-features"
    cache = dataclasses.replace(TARGETS["cpu"].cache, path=str(node / "embeddings"))
    try:
        model_dir = prepare("cpu", None, repository, cache=cache, kv_store_path=str(node / "kv"))
        with TritonServer(ServerOptions(repository, Ports.free()), log) as server:
            server.wait_ready(timeout_s=900)
            yield server.grpc_url, model_dir
    finally:
        shutil.rmtree(node, ignore_errors=True)


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def machine() -> dict[str, Any]:
    from builders.machine import describe_machine

    info = describe_machine()
    info["commit"] = _git("rev-parse", "--short", "HEAD")
    info["uncommitted_changes"] = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="gRPC HOST:PORT of a running server (default: serve one for the run)")
    parser.add_argument(
        "--model-dir", type=Path, help="with --url: the served checkpoint (its tokenizer; default: the tiny one)"
    )
    parser.add_argument("--requests", type=int, default=20, help="measured requests per path and mode (rounds)")
    parser.add_argument("--images", type=int, default=4, help="pool of images, reused round after round")
    parser.add_argument("--seed", type=int, default=0, help="of the order within each round")
    parser.add_argument("--out", type=Path, default=Path("results/generation-features/latest"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    if args.url:
        from builders.default_model import build_default_model

        model_dir = args.model_dir or build_default_model()
        warm, measured = run(args.url, model_dir, args.requests, args.seed, args.images)
    else:
        with served(args.out / "server.log") as (url, model_dir):
            warm, measured = run(url, model_dir, args.requests, args.seed, args.images)
    with (args.out / "requests.jsonl").open("w") as out:
        for sample in (*warm, *measured):
            out.write(json.dumps({"warm_up": sample.round < 0, **asdict(sample)}) + "\n")
    summary = summarize([asdict(s) for s in measured])
    report = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "wall_s": round(time.time() - started, 1),
        "machine": machine(),
        "warm_up_errors": [f"{s.path} {s.mode}: {s.error}" for s in warm if s.error],
        # Each mode's first request on each path (the grammar compiled, logprobs' first use), not counted.
        "warm_up_first_image": [
            {"path": s.path, "mode": s.mode, "e2e_ms": s.e2e_ms, "ttft_ms": s.ttft_ms, "output_tokens": s.output_tokens}
            for s in warm[: len(PATHS) * len(MODES)]
        ],
        "summary": summary,
    }
    (args.out / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    text = table(summary)
    (args.out / "README.md").write_text(f"# Structured outputs and logprobs against plain requests\n\n{text}\n")
    print(text)
    for line in report["warm_up_errors"]:
        print("warm-up error:", line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

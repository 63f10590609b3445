"""The targets (``cpu``, ``gpu``): one description each, the single source of the repository.

A :class:`Target` says how each group of models is served: the encode path
(:class:`EncodeServing`), the prefill/decode stages and ``epd`` (:class:`PdServing`), the
embedding cache (``python_backends.contract.CachePolicy``) and the request limits. Only
what differs between targets is written in :data:`TARGETS`; every other default comes from
``python_backends/contract.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from builders.tensorrt_config import TrtProfile
from python_backends import contract
from python_backends.contract import CachePolicy

Device = Literal["cpu", "gpu"]

# prefill, decode (vLLM KV producer / consumer) and epd (BLS): python models whose model.py is
# kept in model_repository/<name>/1/; their config.pbtxt and engine args are generated.
PD_MODELS = (contract.PREFILL_MODEL, contract.DECODE_MODEL, contract.EPD_MODEL)


class RepositoryBuildError(RuntimeError):
    """The repository cannot be generated as described; the message says what to fix."""


@dataclass(frozen=True)
class EncodeServing:
    """How a target serves the encode path (preprocess, vit_encoder, encode). Only ``device``
    differs between targets."""

    device: Device
    # Most images per execute (Triton's dynamic batch) and per DALI run.
    max_batch_size: int = 8
    max_queue_delay_us: int = 1000
    preprocess_instances: int = 1
    encoder_instances: int = 1
    dali_threads: int = contract.default_of(contract.DALI_NUM_THREADS)
    # cpu: ONNX Runtime threads (0: its default) and patches per packed call (vit_onnx.py).
    ort_intra_op_threads: int = contract.default_of(contract.INTRA_OP_THREADS)
    max_patches_per_run: int = contract.default_of(contract.MAX_PATCHES_PER_RUN)
    # gpu: TensorRT plan precision and optimisation profile.
    trt_precision: Literal["fp16", "fp32"] = contract.default_of(contract.PRECISION)
    trt_profile: TrtProfile = field(default_factory=TrtProfile)

    @property
    def models(self) -> tuple[str, ...]:
        middle = (contract.VIT_POSITIONS_MODEL,) if self.device == "gpu" else ()
        return (contract.PREPROCESS_MODEL, *middle, contract.VIT_ENCODER_MODEL, contract.ENCODE_MODEL)


@dataclass(frozen=True)
class PdServing:
    """How a target serves ``prefill`` / ``decode`` (vLLM KV producer / consumer) and ``epd``.

    ``role_env``: extra ``VLLM_*`` process environment per role on top of the target's
    ``vllm_env`` (e.g. the cores each engine's OpenMP threads are bound to, so that ``llm``,
    ``prefill`` and ``decode`` do not all pile onto one core).
    """

    kv_store_path: str = "/dev/shm/triton-epd-kv"  # TransferIdConnector's folder (tmpfs)
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Target:
    name: str
    instance_kind: str
    # vLLM engine args shared by every vLLM-backed model of the target ("model" is added).
    engine_args: dict[str, Any]
    # Process environment for vLLM engines (config.pbtxt parameters, set before start).
    vllm_env: dict[str, str]
    encode: EncodeServing
    pd: PdServing = field(default_factory=PdServing)
    cache: CachePolicy = field(default_factory=CachePolicy)
    # Request limits of the user-facing models (image limits also bind ``preprocess``).
    limits: dict[str, int] = field(default_factory=contract.limit_defaults)

    @property
    def models(self) -> tuple[str, ...]:
        return (
            contract.LLM_MODEL,
            *self.encode.models,
            contract.ENSEMBLE_MODEL,
            *self.cache.encoder_models,
            *PD_MODELS,
        )


TARGETS: dict[str, Target] = {
    "cpu": Target(
        name="cpu",
        instance_kind="KIND_CPU",
        engine_args={
            "dtype": "float32",
            "max_model_len": 4096,
            "max_num_seqs": 32,
            "limit_mm_per_prompt": {"image": 4},
            # torch.compile costs minutes of start-up on 2 cores for no gain on a tiny model.
            "enforce_eager": True,
            "seed": 0,
            "disable_log_stats": True,
        },
        vllm_env={
            # GiB of KV cache per engine; 1 is plenty for the tiny model and lets several
            # engines fit in 24 GiB.
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # Run the model worker inside the engine-core process instead of spawning a
            # second one: ~10 s less cold start on 2 cores (16 s vs 26 s), same tokens.
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        },
        # No dynamic-batching wait on the CPU: at concurrency 1 each of preprocess and
        # vit_encoder waited its full 1 ms for a second request (Triton stats, results/
        # 2026-11-29/encode-breakdown); under load, requests that queue while the instance
        # is busy are still batched (same executions per request at c=8).
        encode=EncodeServing(device="cpu", max_queue_delay_us=0),
        # llm keeps vLLM's default binding (core 0 on 2 cores); prefill gets core 1 and
        # decode core 0, so the two halves of one request run on different cores.
        pd=PdServing(
            role_env={
                contract.PREFILL_MODEL: {"VLLM_CPU_OMP_THREADS_BIND": "1"},
                contract.DECODE_MODEL: {"VLLM_CPU_OMP_THREADS_BIND": "0"},
            }
        ),
    ),
    "gpu": Target(
        name="gpu",
        instance_kind="KIND_MODEL",
        engine_args={
            "dtype": "bfloat16",
            "max_model_len": 8192,
            "max_num_seqs": 64,
            "limit_mm_per_prompt": {"image": 4},
            "gpu_memory_utilization": 0.35,
            "seed": 0,
            "disable_log_stats": True,
        },
        vllm_env={},
        encode=EncodeServing(device="gpu"),
        # The encoder's TensorRT output stays on the GPU: one device copy into the store.
        cache=CachePolicy(device="cuda:0"),
    ),
}


def target_named(name: str, cache: CachePolicy | None = None) -> Target:
    """The target of that name; ``cache`` replaces its cache policy (e.g. per-instance caches
    for a benchmark)."""
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; choose one of {sorted(TARGETS)}")
    target = TARGETS[name]
    return target if cache is None else dataclasses.replace(target, cache=cache)


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """Command-line overrides of the target's :class:`CachePolicy` (builders and launcher)."""
    group = parser.add_argument_group("embedding cache (default: the target's CachePolicy)")
    group.add_argument("--cache-scope", choices=("node", "instance"), help="one shared cache or one per encoder")
    group.add_argument("--cache-capacity-bytes", type=int, help="embedding bytes the store may hold")
    group.add_argument("--cache-ttl-s", type=float, help="expire unleased entries older than this (0: never)")
    group.add_argument("--encoders", type=int, help="number of encoder models (encoder_0..)")


def cache_policy_from(args: argparse.Namespace, target_name: str) -> CachePolicy | None:
    overrides = {
        field_name: value
        for field_name, value in (
            ("scope", args.cache_scope),
            ("capacity_bytes", args.cache_capacity_bytes),
            ("ttl_s", args.cache_ttl_s),
            ("encoders", args.encoders),
        )
        if value is not None
    }
    return dataclasses.replace(TARGETS[target_name].cache, **overrides) if overrides else None

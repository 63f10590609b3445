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
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from builders.default_model import is_audio_checkpoint
from builders.tensorrt_config import TrtProfile
from python_backends import contract
from python_backends.contract import CachePolicy
from python_backends.engines.llm import ENGINE_GPUS_ENV as GPU_DEVICE_ENV
from python_backends.engines.llm import OMP_THREADS_ENV
from python_backends.request.generation_defaults import AUTO, VLLM, resolve_setting, sampling_defaults
from python_backends.request.videos import GPU_CODECS
from python_backends.runtime.cpus import parse_cpu_list

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
    # cpu: ONNX Runtime threads of the audio encoder (0: its default); images the vit_encoder
    # encodes at once, one thread each (0: one per CPU of its set; vit_onnx.py says why).
    ort_intra_op_threads: int = contract.default_of(contract.INTRA_OP_THREADS)
    vit_threads: int = contract.default_of(contract.VIT_THREADS)
    # cpu: fp32 (ONNX Runtime) or bf16 (OpenVINO; faster, embeddings ~1e-2 off: docs/benchmarks/encode.md).
    vit_precision: str = contract.default_of(contract.VIT_PRECISION)
    # cpu: preprocess's kernels (docs/benchmarks/encode.md); the gpu target's is the DALI backend.
    image_backend: str = contract.default_of(contract.IMAGE_BACKEND)
    # gpu: TensorRT plan precision and optimisation profile.
    trt_precision: Literal["fp16", "fp32"] = contract.default_of(contract.PRECISION)
    trt_profile: TrtProfile = field(default_factory=TrtProfile)

    @property
    def models(self) -> tuple[str, ...]:
        middle = (contract.VIT_POSITIONS_MODEL,) if self.device == "gpu" else ()
        return (contract.PREPROCESS_MODEL, *middle, contract.VIT_ENCODER_MODEL, contract.ENCODE_MODEL)


@dataclass(frozen=True)
class PdServing:
    """How a target serves ``prefill`` / ``decode`` (vLLM KV producer / consumer) and ``epd``."""

    # The node's transfer folder (tmpfs): every transfer's record (manifest, first token) and,
    # with TransferIdConnector, its KV too.
    kv_store_path: str = "/dev/shm/triton-epd-kv"
    # vLLM KV connector between prefill and decode (python_backends/pd/engines.py, KV_CONNECTORS):
    # TransferIdConnector (cpu, files in kv_store_path) or NixlConnector (gpu: the KV moves GPU to
    # GPU, decode reads prefill's blocks). The epd transfer parameters are the same for both.
    kv_connector: str = "TransferIdConnector"
    # Scale-out (``--role pd``): epd's remote encoders; "local": the server's own encoder models.
    remote_encoders: str = contract.LOCAL_ENCODERS
    # With remote encoders: encode on this server's own encoder models when none is left (set by
    # the repository builder for an ``all`` server; a ``pd`` server serves no encoder models).
    remote_local_fallback: bool = False
    # epd's path policy (python_backends/epd/pipeline.py): ``adaptive`` (the cost model picks per
    # request), ``disaggregated`` (epd then starts no colocated engine) or ``colocated``.
    path_policy: str = contract.ADAPTIVE_POLICY
    # Tokens per answer of a polled decode (pd/polling.py; vLLM's stream_interval): each answer is
    # one Triton request from epd to decode. 1 per answer cost e2e +10% at c=1 and -13% req/s at
    # c=8 against a streamed read; 2 per answer were level with it (docs/benchmarks/bls-deadlock.md).
    stream_interval: int = 2
    # Who encodes the images the store lacks on epd's colocated path (contract.COLOCATED_ENCODES):
    # "engine" (its vLLM engine, from the media) or "encoders" (the encoder models; the engine
    # takes embeddings by reference: the E|PD topology, docs/benchmarks/epd-pays.md).
    colocated_encodes: str = contract.default_of(contract.COLOCATED_ENCODES)

    def __post_init__(self) -> None:
        if self.path_policy not in contract.PATH_POLICIES:
            choices = ", ".join(contract.PATH_POLICIES)
            raise ValueError(f"path_policy must be one of {choices}, got {self.path_policy!r}")
        if self.colocated_encodes not in contract.COLOCATED_ENCODERS:
            choices = ", ".join(contract.COLOCATED_ENCODERS)
            raise ValueError(f"colocated_encodes must be one of {choices}, got {self.colocated_encodes!r}")


# vLLM roles that own an engine, and the encode side (preprocess, vit_encoder, the store).
# ``epd`` runs one for its colocated path (in its own process), placed like ``llm``'s.
ENGINE_ROLES = (contract.LLM_MODEL, contract.PREFILL_MODEL, contract.DECODE_MODEL, contract.EPD_MODEL)
ENCODE_ROLE = "encode"


@dataclass(frozen=True)
class GpuBudget:
    """Which GPU each role uses and how much of it the vLLM engines may take.

    ``bound``: the most of one GPU's memory the engines on it may ask for together
    (``gpu_memory_utilization`` summed). On the GPU of the encode side (TensorRT plan, DALI,
    the store's CUDA block, every process's CUDA context) ``encode_reserve`` more is left out.
    vLLM checks each engine's share against the memory free at its start, so several engines
    on one GPU must ask for less than the whole together.
    """

    gpus: int = 1
    bound: float = 0.90
    encode_reserve: float = 0.15

    def __post_init__(self) -> None:
        if self.gpus not in GPU_LAYOUTS:
            raise ValueError(f"GpuBudget.gpus must be one of {sorted(GPU_LAYOUTS)}, got {self.gpus}")
        if not 0 < self.encode_reserve < self.bound <= 1:
            raise ValueError(f"need 0 < encode_reserve < bound <= 1, got {self}")

    @property
    def device_of(self) -> dict[str, int]:
        """Role (``llm``, ``prefill``, ``decode``, ``encode``) -> GPU index."""
        return dict(GPU_LAYOUTS[self.gpus])

    def engines_on(self, gpu: int) -> list[str]:
        return [role for role in ENGINE_ROLES if self.device_of[role] == gpu]

    def memory_utilization(self, role: str) -> float:
        """The engine's ``gpu_memory_utilization``: its GPU's engine share split evenly."""
        gpu = self.device_of[role]
        room = self.bound - (self.encode_reserve if self.device_of[ENCODE_ROLE] == gpu else 0.0)
        return math.floor(room / len(self.engines_on(gpu)) * 100 + 1e-9) / 100  # rounded down, never over

    def planned_use(self) -> dict[int, float]:
        """GPU -> fraction of its memory planned (engines + the encode reserve)."""
        use = dict.fromkeys(range(self.gpus), 0.0)
        for role in ENGINE_ROLES:
            use[self.device_of[role]] += self.memory_utilization(role)
        use[self.device_of[ENCODE_ROLE]] += self.encode_reserve
        return use

    def cuda_visible_devices(self, role: str) -> str:
        return str(self.device_of[role])


# 1 GPU: everything shares it. 2: the encode side and the colocated baseline on one, the
# prefill/decode pair on the other. 4: one GPU per engine, the encode side on its own.
GPU_LAYOUTS: dict[int, dict[str, int]] = {
    1: {ENCODE_ROLE: 0, contract.LLM_MODEL: 0, contract.PREFILL_MODEL: 0, contract.DECODE_MODEL: 0},
    2: {ENCODE_ROLE: 0, contract.LLM_MODEL: 0, contract.PREFILL_MODEL: 1, contract.DECODE_MODEL: 1},
    4: {ENCODE_ROLE: 0, contract.LLM_MODEL: 1, contract.PREFILL_MODEL: 2, contract.DECODE_MODEL: 3},
}
for _layout in GPU_LAYOUTS.values():  # epd's colocated engine shares llm's GPU
    _layout[contract.EPD_MODEL] = _layout[contract.LLM_MODEL]


@dataclass(frozen=True)
class Target:
    name: str
    instance_kind: str
    # vLLM engine args shared by every vLLM-backed model of the target ("model" is added).
    engine_args: dict[str, Any]
    # Process environment for vLLM engines (config.pbtxt parameters, set before start):
    # ``VLLM_*`` and ``OMP_*`` (contract.ENGINE_ENV_PREFIXES).
    vllm_env: dict[str, str]
    encode: EncodeServing
    pd: PdServing = field(default_factory=PdServing)
    cache: CachePolicy = field(default_factory=CachePolicy)
    # Request limits of the user-facing models (image limits also bind ``preprocess``).
    limits: dict[str, int] = field(default_factory=contract.limit_defaults)
    # Video limits of ``llm`` (contract.VIDEO_LIMITS); ``video_codecs`` names what the target's
    # video decoder reads (DALI's CPU decoder / NVDEC), so ``llm`` accepts what ``epd`` will.
    video_limits: dict[str, Any] = field(default_factory=contract.video_limit_defaults)
    # Audio limits of ``llm`` when it serves an audio checkpoint (contract.AUDIO_LIMITS; the
    # sampling rate is the checkpoint's, builders/model_configs.py audio_llm_files).
    audio_limits: dict[str, Any] = field(default_factory=lambda: {contract.MAX_AUDIOS: 2})
    # gpu only: GPUs per role and each engine's memory share (None: the cpu target).
    gpu_budget: GpuBudget | None = None
    # Test servers only: model name -> its ``test_pauses`` JSON (python_backends/runtime/stage_pauses.py).
    # Empty in every served target; set with ``write_repository(test_pauses=...)``.
    test_pauses: dict[str, str] = field(default_factory=dict)
    # Model name -> the CPU list its stub runs on (contract.CPUS; builders/roles.py model_cpu_sets).
    # Empty: every model runs wherever the server runs.
    cpu_sets: dict[str, str] = field(default_factory=dict)
    # Sampling defaults of ``llm`` and ``epd`` (contract.GENERATION_CONFIG; vLLM's --generation-config):
    # "auto" (the checkpoint's generation_config.json), "vllm" (vLLM's own) or an absolute folder.
    generation_config: str = contract.default_of(contract.GENERATION_CONFIG)

    def placed(self, model: str, parameters: dict[str, Any]) -> dict[str, Any]:
        """``parameters`` of ``model`` on its CPU set, if it has one: the set, and the thread
        counts the model declares (OpenMP's of its engine, DALI's, ONNX Runtime's) capped at its
        size, so that no model spins more threads than it has cores. A set caps, never raises: an
        engine's one OpenMP thread stays one on a 2-core set (a second made `epd`'s decode 1.4x
        slower beside `llm`'s one, docs/benchmarks/epd-pays.md); 0 (the library's default, one
        per core) becomes the set's size."""
        cpus = self.cpu_sets.get(model)
        if not cpus:
            return parameters
        cores = len(parse_cpu_list(cpus))
        capped = {
            key: min(int(parameters[key]), cores) or cores
            for key in (OMP_THREADS_ENV, contract.DALI_NUM_THREADS, contract.INTRA_OP_THREADS, contract.VIT_THREADS)
            if key in parameters
        }
        return {**parameters, **capped, contract.CPUS: cpus}

    def engine_args_for(self, role: str, max_position_embeddings: int | None) -> dict[str, Any]:
        """``engine_args`` for one engine role: ``max_model_len`` cut to the checkpoint's
        positions (vLLM refuses a longer one) and, on gpu, the role's memory share."""
        args = dict(self.engine_args)
        if max_position_embeddings and args.get("max_model_len", 0) > max_position_embeddings:
            args["max_model_len"] = max_position_embeddings
        if self.gpu_budget is not None:
            args["gpu_memory_utilization"] = self.gpu_budget.memory_utilization(role)
        return args

    def test_parameters(self, model: str) -> dict[str, str]:
        """The model's test-only parameters (none outside a test server's repository)."""
        pauses = self.test_pauses.get(model)
        return {contract.TEST_PAUSES: pauses} if pauses else {}

    def role_environment(self, role: str) -> dict[str, str]:
        """Process environment of one engine role: the target's, and on gpu the role's GPUs."""
        env = dict(self.vllm_env)
        if self.gpu_budget is not None:
            env[GPU_DEVICE_ENV] = self.gpu_budget.cuda_visible_devices(role)
        return env

    def with_engine_threads(self, threads: int) -> Target:
        """Each vLLM engine with ``threads`` OpenMP threads (0: torch's default, one per core)."""
        env = {key: value for key, value in self.vllm_env.items() if key != OMP_THREADS_ENV}
        if threads:
            env[OMP_THREADS_ENV] = str(threads)
        return dataclasses.replace(self, vllm_env=env)

    def with_vit_precision(self, precision: str) -> Target:
        """The vision encoder in ``precision``: bf16 runs on the cpu target's OpenVINO runner; the gpu
        target's plan has a precision of its own (``trt_precision``)."""
        if precision not in contract.VIT_PRECISIONS:
            raise ValueError(f"vit precision {precision!r}: use one of {', '.join(contract.VIT_PRECISIONS)}")
        if precision != "fp32" and self.encode.device == "gpu":
            raise ValueError("--vit-precision is for the cpu target; the gpu target's TensorRT plan is fp16 already")
        return dataclasses.replace(self, encode=dataclasses.replace(self.encode, vit_precision=precision))

    def with_generation_config(self, setting: str) -> Target:
        """``llm``'s and ``epd``'s sampling defaults from ``setting`` (``auto``, ``vllm`` or a folder,
        made absolute; python_backends/request/generation_defaults.py). A folder is read here once,
        so that one neither model could read fails the build, not the server's load."""
        resolved = resolve_setting(setting)
        if resolved not in (AUTO, VLLM):
            sampling_defaults(resolved, Path(resolved))
        return dataclasses.replace(self, generation_config=resolved)

    def fitted_to_checkpoint(self, model_dir: Path) -> Target:
        """gpu: the TensorRT profile derived from the checkpoint's pixel limits (the plan and its
        config both read ``encode.trt_profile``); other targets unchanged, and audio checkpoints
        too (no vision tower; their plan's profile: builders/model_configs.py audio_plan_profile)."""
        config_file = Path(model_dir) / "preprocessor_config.json"
        if self.encode.device != "gpu" or not config_file.is_file() or is_audio_checkpoint(model_dir):
            return self
        profile = TrtProfile.from_preprocessor_config(json.loads(config_file.read_text()))
        return dataclasses.replace(self, encode=dataclasses.replace(self.encode, trt_profile=profile))

    def with_gpus(self, gpus: int) -> Target:
        """This gpu target laid out over ``gpus`` GPUs (its store on the encode side's GPU)."""
        if self.gpu_budget is None:
            raise ValueError(f"target {self.name!r} has no GPU budget")
        budget = dataclasses.replace(self.gpu_budget, gpus=gpus)
        cache = dataclasses.replace(self.cache, device=f"cuda:{budget.device_of[ENCODE_ROLE]}")
        return dataclasses.replace(self, gpu_budget=budget, cache=cache)

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
            # KV cache per engine: 256 MiB is 262,144 tokens of the tiny model, twice what
            # max_num_seqs full-length requests hold. vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE,
            # whole GiB only) was 1 GiB per engine; with an explicit size (and eager mode) vLLM also
            # skips its warm-up: engine init 1.6-2.2 s, was 6.4-8.0 s (docs/benchmarks/cold-start.md).
            "kv_cache_memory_bytes": 256 << 20,
            "seed": 0,
            "disable_log_stats": True,
        },
        vllm_env={
            # Run the model worker inside the engine-core process instead of spawning a
            # second one: ~10 s less cold start on 2 cores (16 s vs 26 s), same tokens.
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            # An engine core's exit ends in a full garbage collection (~3 s idle, 5 s+ under
            # load here) after its teardown: not waited out on the CPU (python_backends/engines/llm.py).
            "VLLM_EPD_ENGINE_EXIT_GRACE_S": "2",
            # Fork the engine core from its stub, which has imported torch and vLLM already, instead
            # of vLLM's spawn on CPU (a fresh interpreter importing them again, ~7 CPU-s per
            # engine): `make serve` 38.8 s -> 21.1 s (docs/benchmarks/cold-start.md). No device in the
            # stub to make a fork unsafe; the stub's other threads are Triton's IPC and our loop,
            # whose state the engine core never touches.
            "VLLM_EPD_ENGINE_START": "fork",
            # One OpenMP thread per engine (torch's default is one per core, and its idle workers
            # spin: 52-68% of an engine's samples in libgomp's spin-wait). vLLM's own thread
            # binding never applies here (the worker runs in the engine core). Server CPU per
            # request -30-50% (docs/benchmarks/omp-threads.md). It was taken back once because the
            # faster disaggregated path met Triton 2.51's BLS deadlock; decode by polls removed that
            # (docs/benchmarks/bls-deadlock.md). --engine-threads changes it (0: torch's default).
            OMP_THREADS_ENV: "1",
        },
        # No dynamic-batching wait on the CPU: at concurrency 1 each of preprocess and
        # vit_encoder waited its full 1 ms for a second request (Triton stats, results/
        # 2026-11-29/encode-breakdown); under load, requests that queue while the instance
        # is busy are still batched (same executions per request at c=8).
        encode=EncodeServing(device="cpu", max_queue_delay_us=0),
    ),
    "gpu": Target(
        name="gpu",
        instance_kind="KIND_MODEL",
        engine_args={
            "dtype": "bfloat16",
            # Cut to the checkpoint's max_position_embeddings per model (Target.engine_args_for).
            "max_model_len": 8192,
            "max_num_seqs": 64,
            "limit_mm_per_prompt": {"image": 4},
            "seed": 0,
            "disable_log_stats": True,
        },
        vllm_env={
            # prefill/decode open the CUDA store before their engine starts; vLLM only picks
            # spawn itself when torch reports CUDA initialised, so say it: never fork a CUDA process.
            "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        },
        encode=EncodeServing(device="gpu", image_backend="dali"),
        video_limits={**contract.video_limit_defaults(), contract.VIDEO_CODECS: ",".join(GPU_CODECS)},
        # KV from prefill to decode GPU to GPU through vLLM's own connector (no host copy).
        pd=PdServing(kv_connector="NixlConnector"),
        # The encoder's TensorRT output stays on the GPU: one device copy into the store.
        cache=CachePolicy(device="cuda:0"),
        gpu_budget=GpuBudget(gpus=1),
    ),
}


def target_named(name: str, cache: CachePolicy | None = None) -> Target:
    """The target of that name; ``cache`` replaces its cache policy (e.g. per-instance caches
    for a benchmark)."""
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; choose one of {sorted(TARGETS)}")
    target = TARGETS[name]
    return target if cache is None else dataclasses.replace(target, cache=cache)


def resolved_target(
    name: str,
    model_dir: Path,
    cache: CachePolicy | None = None,
    kv_store_path: str | Path | None = None,
    gpus: int | None = None,
) -> Target:
    """The target a repository is written for (and the preflight checks): ``target_named`` with
    the command line's overrides, laid out over ``gpus`` GPUs (gpu only; None: the target's
    layout), fitted to the checkpoint in ``model_dir``."""
    target = target_named(name, cache)
    if gpus is not None:
        target = target.with_gpus(gpus)
    if kv_store_path is not None:
        target = dataclasses.replace(target, pd=dataclasses.replace(target.pd, kv_store_path=str(kv_store_path)))
    return target.fitted_to_checkpoint(model_dir)


def add_gpus_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gpus", type=int, choices=sorted(GPU_LAYOUTS),
        help="gpu target: lay the roles out over this many GPUs (builders/targets.py, GPU_LAYOUTS; default 1)",
    )


def _videos(value: str) -> int:
    count = int(value)
    if count < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (no video) or more, not {count}")
    return count


def _threads(value: str) -> int:
    count = int(value)
    if count < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (torch's default) or more, not {count}")
    return count


# vLLM 0.32's help of `vllm serve --generation-config` (ModelConfig.generation_config), with what
# max_new_tokens does here.
GENERATION_CONFIG_HELP = (
    "The folder path to the generation config. Defaults to 'auto', the generation config will be loaded "
    "from model path. If set to 'vllm', no generation config is loaded, vLLM defaults will be used. If set "
    "to a folder path, the generation config will be loaded from the specified folder path. If "
    "'max_new_tokens' is specified in generation config, then it sets a server-wide limit on the number of "
    "output tokens for all requests (the max_tokens of a request that sets none; at most max_tokens_limit). "
    "Applied by llm and epd to every request's sampling_parameters that do not set them."
)


def _generation_config(value: str) -> str:
    try:
        return resolve_setting(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_generation_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--generation-config", type=_generation_config, default=AUTO, metavar="auto|vllm|FOLDER",
        help=GENERATION_CONFIG_HELP,
    )  # fmt: skip


def add_engine_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine-threads", type=_threads, metavar="N",
        help="OpenMP threads of each vLLM engine (default: the target's, 1 on cpu); 0: torch's default, one per core",
    )  # fmt: skip


def add_vit_precision_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vit-precision", choices=contract.VIT_PRECISIONS,
        help="cpu target: the vision encoder in fp32 (ONNX Runtime, default) or bf16 (OpenVINO, on CPUs with "
        "avx512_bf16/amx_bf16: faster, embeddings ~1e-2 off fp32; docs/benchmarks/encode.md)",
    )  # fmt: skip


def add_colocated_encodes_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--colocated-encodes", choices=contract.COLOCATED_ENCODERS,
        help="who encodes the images the store lacks on epd's colocated path: its engine (default) or the "
        "encoder models, the engine then taking embeddings by reference (the E|PD topology)",
    )  # fmt: skip


def add_max_videos_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-videos", type=_videos, metavar="N",
        help="videos per request of the models that take video (default: the target's, 2); 0: images only, "
        "no model declares the 'video' input (e.g. for perf_analyzer --shared-memory against epd)",
    )  # fmt: skip


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """Command-line overrides of the target's :class:`CachePolicy` (builders and launcher)."""
    group = parser.add_argument_group("embedding cache (default: the target's CachePolicy)")
    group.add_argument("--cache-scope", choices=("node", "instance"), help="one shared cache or one per encoder")
    group.add_argument("--cache-capacity-bytes", type=int, help="embedding bytes the store may hold")
    group.add_argument("--cache-ttl-s", type=float, help="expire unleased entries older than this (0: never)")
    group.add_argument("--encoders", type=int, help="number of encoder models (encoder_0..)")
    group.add_argument(
        "--tenant-policy",
        choices=("isolated", "shared"),
        help="isolated: a request's 'tenant' parameter scopes its cache entries and mm_hash references; "
        "shared: tenants share entries",
    )


def cache_policy_from(args: argparse.Namespace, target_name: str) -> CachePolicy | None:
    overrides = {
        field_name: value
        for field_name, value in (
            ("scope", args.cache_scope),
            ("capacity_bytes", args.cache_capacity_bytes),
            ("ttl_s", args.cache_ttl_s),
            ("encoders", args.encoders),
            ("tenants", getattr(args, "tenant_policy", None)),
        )
        if value is not None
    }
    return dataclasses.replace(TARGETS[target_name].cache, **overrides) if overrides else None

"""Every config parameter with its one default, how values parse, and the cache policy.

``ModelParameters`` (python_backends/runtime/model_params.py) reads a model's parameters with these
defaults and bounds; ``builders`` write them. The store's defaults (path, capacity) are here
too: the store reads them from the contract, never the other way round.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from python_backends.contract.names import (
    ADAPTIVE_POLICY,
    AUDIO_LIMITS,
    AUDIO_SAMPLING_RATE,
    CACHE_SCOPE,
    CHECKPOINT_SHARDS,
    CHECKPOINT_WEIGHT_BYTES,
    COLOCATED_ENCODES,
    DALI_FILE,
    DALI_NUM_THREADS,
    DECODE_MODEL,
    DECODE_MODEL_KEY,
    ENCODE_MODEL,
    ENCODE_MODEL_KEY,
    ENCODE_ONE_IMAGE_KEY,
    ENCODER_FILE,
    ENCODER_MODELS_KEY,
    GENERATION_CONFIG,
    HIDDEN_SIZE,
    IMAGE_BACKEND,
    IMAGE_EMBEDS_HIDDEN_SIZE,
    IMAGE_PATCH_DIM,
    INTRA_OP_THREADS,
    LIMITS,
    LOCAL_ENCODERS,
    MAX_AUDIO_BYTES,
    MAX_AUDIO_SECONDS,
    MAX_AUDIOS,
    MAX_FRAMES,
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_IMAGES,
    MAX_IMAGES_PER_REQUEST,
    MAX_LOGPROBS,
    MAX_N,
    MAX_TOKENS_LIMIT,
    MAX_VIDEO_BYTES,
    MAX_VIDEO_SECONDS,
    MAX_VIDEOS,
    MERGE_SIZE,
    NODE_ID,
    ONNX_FILE,
    ONNX_FILE_KEY,
    PATCH_DIM,
    PATH_POLICY,
    PIPELINE_FILE,
    PRECISION,
    PREFILL_MODEL,
    PREFILL_MODEL_KEY,
    PREPROCESSOR_CONFIG,
    PROFILE_MAX_CLIPS,
    PROFILE_MAX_PATCHES,
    PROFILE_MIN_PATCHES,
    PROFILE_OPT_PATCHES,
    REMOTE_ENCODE_DEADLINE_S,
    REMOTE_ENCODERS_KEY,
    REMOTE_LOCAL_FALLBACK,
    SHARED_COMPUTE,
    SPATIAL_MERGE_SIZE,
    STORE_CAPACITY_BYTES,
    STORE_DEVICE,
    STORE_EVICTION,
    STORE_PATH,
    STORE_TTL_S,
    STREAM_INTERVAL,
    TENANT_POLICY,
    VIDEO_CODECS,
    VIDEO_LIMITS,
    VISION_SHARDS,
    VISION_WEIGHT_BYTES,
    VIT_PRECISION,
    VIT_THREADS,
    ContractError,
    encoder_model_names,
)

# The node's embedding store: LMDB on tmpfs, 1 GiB (the store's defaults too: store/config.py).
DEFAULT_STORE_PATH = "/dev/shm/triton-epd-embeddings"
DEFAULT_CAPACITY_BYTES = 1 << 30

__all__ = [
    "DEFAULT_CAPACITY_BYTES",
    "DEFAULT_STORE_PATH",
    "PARAMETERS",
    "CachePolicy",
    "CacheScope",
    "TenantPolicy",
    "Parameter",
    "ParameterValue",
    "default_of",
    "limit_defaults",
    "video_limit_defaults",
    "audio_limit_defaults",
    "parameter",
    "parse_boolean",
    "parse_integer",
    "parse_number",
]

ParameterValue = str | int | float | bool


@dataclass(frozen=True)
class Parameter:
    """A config parameter. ``default`` None: required (the builder always writes it)."""

    key: str
    default: ParameterValue | None
    minimum: float | None = None


PARAMETERS: dict[str, Parameter] = {
    p.key: p
    for p in (
        Parameter(MAX_IMAGES, 4, minimum=0),
        Parameter(MAX_IMAGE_BYTES, 20 << 20, minimum=1),
        Parameter(MAX_IMAGE_PIXELS, 4096 * 4096, minimum=1),
        Parameter(MAX_TOKENS_LIMIT, 2048, minimum=1),
        Parameter(MAX_LOGPROBS, 20, minimum=0),  # vLLM's default max_logprobs
        Parameter(MAX_N, 16, minimum=1),
        Parameter(GENERATION_CONFIG, "auto"),
        Parameter(MAX_IMAGES_PER_REQUEST, 64, minimum=1),
        Parameter(STREAM_INTERVAL, 1, minimum=1),
        # Defaults: python_backends.request.videos.VideoLimits / VideoSamplingConfig (kept equal by a test).
        Parameter(MAX_VIDEOS, 2, minimum=0),  # 0: the model refuses video
        Parameter(MAX_VIDEO_BYTES, 64 << 20, minimum=1),
        Parameter(MAX_VIDEO_SECONDS, 60.0, minimum=0.001),
        Parameter(MAX_FRAMES, 768, minimum=2),
        Parameter(VIDEO_CODECS, "vp8,vp9,mjpeg"),
        # Defaults: python_backends.preprocess.audio.AudioLimits (kept equal by a test).
        Parameter(MAX_AUDIOS, 0, minimum=0),  # 0: the model takes no audio (image checkpoints)
        Parameter(MAX_AUDIO_BYTES, 25 << 20, minimum=1),
        Parameter(MAX_AUDIO_SECONDS, 30.0, minimum=0.001),
        Parameter(AUDIO_SAMPLING_RATE, 16_000, minimum=1),
        Parameter(IMAGE_EMBEDS_HIDDEN_SIZE, 0, minimum=1),  # 0: embeddings by value refused
        Parameter(SPATIAL_MERGE_SIZE, 2, minimum=1),
        Parameter(ENCODE_MODEL_KEY, ENCODE_MODEL),
        Parameter(ENCODE_ONE_IMAGE_KEY, False),
        Parameter(ENCODER_MODELS_KEY, None),
        Parameter(PREFILL_MODEL_KEY, PREFILL_MODEL),
        Parameter(DECODE_MODEL_KEY, DECODE_MODEL),
        Parameter(PATH_POLICY, ADAPTIVE_POLICY),
        Parameter(COLOCATED_ENCODES, "engine"),
        Parameter(SHARED_COMPUTE, True),
        Parameter(PREPROCESSOR_CONFIG, None),
        Parameter(ENCODER_FILE, None),
        Parameter(STORE_PATH, DEFAULT_STORE_PATH),
        Parameter(STORE_CAPACITY_BYTES, DEFAULT_CAPACITY_BYTES, minimum=1),
        Parameter(STORE_EVICTION, "lru"),
        Parameter(STORE_TTL_S, 0.0, minimum=0.0),  # 0: entries live until evicted
        Parameter(STORE_DEVICE, "cpu"),  # "cpu" (shared memory) or "cuda:N" (CUDA IPC)
        Parameter(CACHE_SCOPE, "node"),
        Parameter(NODE_ID, "local"),
        Parameter(TENANT_POLICY, "isolated"),  # requests that name a tenant never share entries
        Parameter(REMOTE_ENCODERS_KEY, LOCAL_ENCODERS),
        Parameter(REMOTE_ENCODE_DEADLINE_S, 20.0, minimum=0.1),
        Parameter(REMOTE_LOCAL_FALLBACK, False),
        Parameter(PIPELINE_FILE, DALI_FILE),
        Parameter(DALI_NUM_THREADS, 2, minimum=1),
        Parameter(ONNX_FILE_KEY, ONNX_FILE),
        Parameter(INTRA_OP_THREADS, 0, minimum=0),  # 0: ONNX Runtime's default
        Parameter(VIT_THREADS, 0, minimum=0),  # 0: one per CPU of the model's set
        Parameter(VIT_PRECISION, "fp32"),  # one of VIT_PRECISIONS, checked at load
        Parameter(IMAGE_BACKEND, "torchvision"),  # one of IMAGE_BACKENDS, checked at load
        Parameter(PATCH_DIM, None, minimum=1),
        Parameter(IMAGE_PATCH_DIM, None, minimum=1),
        Parameter(HIDDEN_SIZE, None, minimum=1),
        Parameter(MERGE_SIZE, 2, minimum=1),
        Parameter(VISION_SHARDS, None, minimum=0),
        Parameter(CHECKPOINT_SHARDS, None, minimum=0),
        Parameter(VISION_WEIGHT_BYTES, None, minimum=0),
        Parameter(CHECKPOINT_WEIGHT_BYTES, None, minimum=0),
        Parameter(PRECISION, "fp16"),
        Parameter(PROFILE_MIN_PATCHES, 4, minimum=1),
        Parameter(PROFILE_OPT_PATCHES, 1024, minimum=1),
        Parameter(PROFILE_MAX_PATCHES, 1024, minimum=1),  # one image per call
        Parameter(PROFILE_MAX_CLIPS, 2, minimum=1),  # builders write the target's max_audios
    )
}


def parameter(key: str) -> Parameter:
    try:
        return PARAMETERS[key]
    except KeyError:
        raise ContractError(f"parameter '{key}' is not declared in python_backends/contract") from None


def default_of(key: str) -> Any:
    return parameter(key).default


def limit_defaults() -> dict[str, int]:
    """The request limits every target starts from."""
    return {key: int(default_of(key)) for key in LIMITS}


def video_limit_defaults() -> dict[str, Any]:
    """``llm``'s video limits every target starts from."""
    return {key: default_of(key) for key in VIDEO_LIMITS}


def audio_limit_defaults() -> dict[str, Any]:
    """The audio limits of a model that takes audio (``max_audios`` 0: none)."""
    return {key: default_of(key) for key in AUDIO_LIMITS}


def _minimum(key: str, minimum: float | None) -> float:
    """The caller's bound, else the declared one, else 0 (no parameter is negative)."""
    if minimum is not None:
        return minimum
    declared = PARAMETERS.get(key)
    return declared.minimum if declared is not None and declared.minimum is not None else 0


def parse_integer(key: str, text: str, minimum: float | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ContractError(f"parameter '{key}' must be an integer, got {text!r}") from None
    bound = _minimum(key, minimum)
    if value < bound:
        raise ContractError(f"parameter '{key}' must be >= {bound:g}, got {value}")
    return value


def parse_number(key: str, text: str, minimum: float | None = None) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ContractError(f"parameter '{key}' must be a number, got {text!r}") from None
    bound = _minimum(key, minimum)
    if math.isnan(value) or value < bound:
        raise ContractError(f"parameter '{key}' must be >= {bound:g}, got {text}")
    return value


def parse_boolean(key: str, text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise ContractError(f"parameter '{key}' must be true or false, got {text!r}")


CacheScope = Literal["node", "instance"]
# ``isolated``: a request that names a tenant (Triton request parameter ``tenant``) meets only
# that tenant's entries and ``mm_hash`` references; ``shared``: tenants share one key space.
TenantPolicy = Literal["isolated", "shared"]


@dataclass(frozen=True)
class CachePolicy:
    """The embedding cache, in one place: every store-using model (``encoder_<i>``, ``epd``,
    ``prefill``, ``decode``) gets :meth:`to_parameters` as config parameters and reads them
    back with :meth:`from_parameters`.

    Keys always cover the media bytes, the preprocessing config and the encoder version (the
    served encoder file's digest), so a rebuilt encoder or a changed resize setting never
    meets old embeddings. ``scope``: ``node`` -- one key space for every encoder of the node
    (an image encoded by one is a hit for all); ``instance`` -- each encoder model its own
    (the per-instance baseline the shared store is measured against). ``tenants``: ``isolated``
    -- a request's tenant scopes its keys and ``mm_hash`` references (no hit, join or reference
    crosses tenants); ``shared`` -- the tenant is checked but every tenant meets every entry.
    """

    path: str = DEFAULT_STORE_PATH  # the node's store (LMDB on tmpfs)
    capacity_bytes: int = DEFAULT_CAPACITY_BYTES
    eviction: Literal["lru"] = default_of(STORE_EVICTION)
    ttl_s: float = default_of(STORE_TTL_S)  # 0: entries live until evicted
    scope: CacheScope = default_of(CACHE_SCOPE)
    encoders: int = 2  # encoder models encoder_0 .. encoder_<n-1>
    device: str = default_of(STORE_DEVICE)  # where the bytes live: "cpu" or "cuda:N"
    node_id: str = default_of(NODE_ID)  # the node the store lives on (scale-out roles)
    tenants: TenantPolicy = default_of(TENANT_POLICY)

    def __post_init__(self) -> None:
        if self.encoders < 1:
            raise ContractError("CachePolicy.encoders must be at least 1")
        if self.scope not in ("node", "instance"):
            raise ContractError(f"CachePolicy.scope must be 'node' or 'instance', got {self.scope!r}")
        if self.tenants not in ("isolated", "shared"):
            raise ContractError(f"CachePolicy.tenants must be 'isolated' or 'shared', got {self.tenants!r}")

    @property
    def encoder_models(self) -> tuple[str, ...]:
        return encoder_model_names(self.encoders)

    def to_parameters(self) -> dict[str, ParameterValue]:
        return {
            STORE_PATH: self.path,
            STORE_CAPACITY_BYTES: self.capacity_bytes,
            STORE_EVICTION: self.eviction,
            STORE_TTL_S: self.ttl_s,
            STORE_DEVICE: self.device,
            CACHE_SCOPE: self.scope,
            NODE_ID: self.node_id,
            TENANT_POLICY: self.tenants,
        }

    @classmethod
    def from_parameters(cls, values: Mapping[str, str]) -> CachePolicy:
        """The policy a model's config parameters carry (absent keys: the defaults above).
        ``encoders`` is not a store parameter (only ``epd`` lists the encoder models): default."""

        def read(key: str, parse: Any = None) -> Any:
            raw = values.get(key)
            if raw is None or raw == "":
                return default_of(key)
            return parse(key, str(raw)) if parse is not None else str(raw)

        return cls(
            path=read(STORE_PATH),
            capacity_bytes=read(STORE_CAPACITY_BYTES, parse_integer),
            eviction=read(STORE_EVICTION),
            ttl_s=read(STORE_TTL_S, parse_number),
            scope=read(CACHE_SCOPE),
            device=read(STORE_DEVICE),
            node_id=read(NODE_ID),
            tenants=read(TENANT_POLICY),
        )

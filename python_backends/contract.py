"""The contract between the generated model repository and the code that serves it.

One place for what ``builders`` write into every ``config.pbtxt`` and what the runtime reads
back: model names, each model's input and output tensors (name, data type, dims, optional or
not), every config parameter key with its one default, and the embedding cache policy with
its to/from-parameters mapping. ``builders`` render configs from it; ``model.py`` files, the
BLS calls and :class:`python_backends.model_params.ModelParameters` read names and defaults
from it, so a name or a default is changed here and nowhere else.

Plain data: importable without Triton, torch or vLLM (tests/unit/test_contract.py checks
every generated config and every name the serving code uses against it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from python_backends.store import DEFAULT_STORE_PATH

# The store's default capacity; moves to python_backends.store (its one home) as the store is split.
DEFAULT_CAPACITY_BYTES = 1 << 30


class ContractError(ValueError):
    """A value breaks the contract (a parameter that does not parse, an unknown size)."""


# ---------------------------------------------------------------------------------------------
# Model names (DESIGN.md: used by tests, clients and docs)
# ---------------------------------------------------------------------------------------------

LLM_MODEL = "llm"
EPD_MODEL = "epd"
ENSEMBLE_MODEL = "ensemble"
PREPROCESS_MODEL = "preprocess"
VIT_ENCODER_MODEL = "vit_encoder"
VIT_POSITIONS_MODEL = "vit_positions"
ENCODE_MODEL = "encode"
PREFILL_MODEL = "prefill"
DECODE_MODEL = "decode"
ENCODER_MODEL_PREFIX = "encoder_"  # encoder_0 .. encoder_<n-1>, one per encoder of the policy


def encoder_model_names(count: int) -> tuple[str, ...]:
    return tuple(f"{ENCODER_MODEL_PREFIX}{i}" for i in range(count))


# ---------------------------------------------------------------------------------------------
# Tensor names
# ---------------------------------------------------------------------------------------------

# The user-facing request (llm, ensemble, epd), close to Triton's vllm_backend.
TEXT_INPUT = "text_input"
IMAGE = "image"
STREAM = "stream"
SAMPLING_PARAMETERS = "sampling_parameters"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
TEXT_OUTPUT = "text_output"
OUTPUT_TOKEN_IDS = "output_token_ids"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"
FINISH_REASON = "finish_reason"
CACHE_HITS = "cache_hits"  # epd: images served from the embedding store
TIMING_STAGES = ("hash", "lookup", "encode", "prefill", "decode")  # epd: timing_<stage>_ms

# The encode path (preprocess -> [vit_positions ->] vit_encoder), embeddings by value.
PIXEL_VALUES = "pixel_values"
IMAGE_GRID_THW = "image_grid_thw"
ROTARY_POS_IDS = "rotary_pos_ids"
CU_SEQLENS = "cu_seqlens"
IMAGE_EMBEDS = "image_embeds"

# Stages that epd calls over BLS (encoder_<i>, prefill, decode).
REFERENCES = "references"  # one signed reference per image, never media
MM_HASH = "mm_hash"
CACHE_HIT = "cache_hit"
LEASE_OWNER = "lease_owner"
TRANSFER_PARAMS = "transfer_params"
REQUEST_ID = "request_id"
ABORT = "abort"
# Errors as an output on request: why in python_backends/triton_edge/responses.py.
ERRORS_AS_OUTPUTS = "errors_as_outputs"
ERROR = "error"


def timing_output(stage: str) -> str:
    if stage not in TIMING_STAGES:
        raise ContractError(f"no timing output for stage {stage!r}; stages: {TIMING_STAGES}")
    return f"timing_{stage}_ms"


# ---------------------------------------------------------------------------------------------
# Tensors and model interfaces
# ---------------------------------------------------------------------------------------------

# Sizes the exported encoder decides (EncoderFacts): a dim may name one, filled in at build time.
PATCH_DIM = "patch_dim"
HIDDEN_SIZE = "hidden_size"

Dim = int | str
DataType = Literal[
    "TYPE_BOOL", "TYPE_UINT8", "TYPE_UINT32", "TYPE_INT64", "TYPE_FP32", "TYPE_STRING"
]


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a model config (dims without the batch dimension)."""

    name: str
    data_type: DataType
    dims: tuple[Dim, ...]
    optional: bool = False
    # Requests of different lengths share a batch (Triton's allow_ragged_batch).
    ragged: bool = False
    # What the backend sees instead of ``dims`` (Triton's ``reshape``), if anything.
    reshape: tuple[Dim, ...] | None = None

    def sized(self, sizes: Mapping[str, int]) -> TensorSpec:
        """The spec with every named dim (``patch_dim``, ``hidden_size``) replaced by its size."""

        def resolve(dims: tuple[Dim, ...]) -> tuple[int, ...]:
            try:
                return tuple(d if isinstance(d, int) else int(sizes[d]) for d in dims)
            except KeyError as exc:
                raise ContractError(f"tensor '{self.name}' needs the size {exc} to be rendered") from None

        reshape = None if self.reshape is None else resolve(self.reshape)
        return TensorSpec(self.name, self.data_type, resolve(self.dims), self.optional, self.ragged, reshape)


def _tensor(name: str, data_type: DataType, *dims: Dim, **options: Any) -> TensorSpec:
    return TensorSpec(name, data_type, tuple(dims), **options)


@dataclass(frozen=True)
class ModelInterface:
    """A model's tensors and the config parameter keys it reads (``VLLM_*`` too when
    ``vllm_env``: process environment for its vLLM engine)."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    parameters: tuple[str, ...] = ()
    vllm_env: bool = False

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)

    def tensor(self, name: str) -> TensorSpec:
        for spec in (*self.inputs, *self.outputs):
            if spec.name == name:
                return spec
        raise ContractError(f"model '{self.name}' has no tensor '{name}'")

    def sized(self, sizes: Mapping[str, int]) -> ModelInterface:
        return ModelInterface(
            self.name,
            tuple(t.sized(sizes) for t in self.inputs),
            tuple(t.sized(sizes) for t in self.outputs),
            self.parameters,
            self.vllm_env,
        )

    def accepts_parameter(self, key: str) -> bool:
        return key in self.parameters or (self.vllm_env and key.startswith(VLLM_ENV_PREFIX))


# ---------------------------------------------------------------------------------------------
# Config parameters: every key with its one default
# ---------------------------------------------------------------------------------------------

VLLM_ENV_PREFIX = "VLLM_"  # parameters that are process environment for a vLLM engine

# Request limits of the user-facing models (image limits also bind preprocess and encoders).
MAX_IMAGES = "max_images"
MAX_IMAGE_BYTES = "max_image_bytes"
MAX_IMAGE_PIXELS = "max_image_pixels"
MAX_TOKENS_LIMIT = "max_tokens_limit"
MAX_IMAGES_PER_REQUEST = "max_images_per_request"  # encoder_<i>
LIMITS = (MAX_IMAGES, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, MAX_TOKENS_LIMIT)
# Embeddings by value (llm) and the store's grid check.
IMAGE_EMBEDS_HIDDEN_SIZE = "image_embeds_hidden_size"
SPATIAL_MERGE_SIZE = "spatial_merge_size"
# The models a model calls over BLS.
ENCODE_MODEL_KEY = "encode_model"
ENCODER_MODELS_KEY = "encoder_models"
PREFILL_MODEL_KEY = "prefill_model"
DECODE_MODEL_KEY = "decode_model"
# What content keys cover besides the media (epd and encoder_<i> alike).
PREPROCESSOR_CONFIG = "preprocessor_config"
ENCODER_FILE = "encoder_file"
# The embedding store (CachePolicy.to_parameters).
STORE_PATH = "store_path"
STORE_CAPACITY_BYTES = "store_capacity_bytes"
STORE_EVICTION = "store_eviction"
STORE_TTL_S = "store_ttl_s"
STORE_DEVICE = "store_device"
CACHE_SCOPE = "cache_scope"
STORE_KEYS = (STORE_PATH, STORE_CAPACITY_BYTES, STORE_EVICTION, STORE_TTL_S, STORE_DEVICE, CACHE_SCOPE)
# preprocess (cpu): the serialized DALI pipeline.
PIPELINE_FILE = "pipeline_file"
DALI_NUM_THREADS = "dali_num_threads"
# vit_encoder (cpu): ONNX Runtime.
ONNX_FILE_KEY = "onnx_file"
INTRA_OP_THREADS = "intra_op_threads"
MAX_PATCHES_PER_RUN = "max_patches_per_run"
# vit_encoder (both): the exported encoder's facts, checked at load and shown as metrics.
MERGE_SIZE = "merge_size"  # also vit_positions'
VISION_SHARDS = "vision_shards"
CHECKPOINT_SHARDS = "checkpoint_shards"
VISION_WEIGHT_BYTES = "vision_weight_bytes"
CHECKPOINT_WEIGHT_BYTES = "checkpoint_weight_bytes"
ENCODER_FACTS = (
    PATCH_DIM, HIDDEN_SIZE, MERGE_SIZE, VISION_SHARDS, CHECKPOINT_SHARDS, VISION_WEIGHT_BYTES, CHECKPOINT_WEIGHT_BYTES
)
# vit_encoder (gpu): the TensorRT plan's precision and optimisation profile (shown, not read).
PRECISION = "precision"
PROFILE_MIN_PATCHES = "profile_min_patches"
PROFILE_OPT_PATCHES = "profile_opt_patches"
PROFILE_MAX_PATCHES = "profile_max_patches"
PROFILE_MAX_IMAGES = "profile_max_images"

DALI_FILE = "model.dali"
ONNX_FILE = "model.onnx"
PLAN_FILE = "model.plan"

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
        Parameter(MAX_IMAGES_PER_REQUEST, 64, minimum=1),
        Parameter(IMAGE_EMBEDS_HIDDEN_SIZE, 0, minimum=1),  # 0: embeddings by value refused
        Parameter(SPATIAL_MERGE_SIZE, 2, minimum=1),
        Parameter(ENCODE_MODEL_KEY, ENCODE_MODEL),
        Parameter(ENCODER_MODELS_KEY, None),
        Parameter(PREFILL_MODEL_KEY, PREFILL_MODEL),
        Parameter(DECODE_MODEL_KEY, DECODE_MODEL),
        Parameter(PREPROCESSOR_CONFIG, None),
        Parameter(ENCODER_FILE, None),
        Parameter(STORE_PATH, DEFAULT_STORE_PATH),
        Parameter(STORE_CAPACITY_BYTES, DEFAULT_CAPACITY_BYTES, minimum=1),
        Parameter(STORE_EVICTION, "lru"),
        Parameter(STORE_TTL_S, 0.0, minimum=0.0),  # 0: entries live until evicted
        Parameter(STORE_DEVICE, "cpu"),  # "cpu" (shared memory) or "cuda:N" (CUDA IPC)
        Parameter(CACHE_SCOPE, "node"),
        Parameter(PIPELINE_FILE, DALI_FILE),
        Parameter(DALI_NUM_THREADS, 2, minimum=1),
        Parameter(ONNX_FILE_KEY, ONNX_FILE),
        Parameter(INTRA_OP_THREADS, 0, minimum=0),  # 0: ONNX Runtime's default
        Parameter(MAX_PATCHES_PER_RUN, 1024, minimum=1),
        Parameter(PATCH_DIM, None, minimum=1),
        Parameter(HIDDEN_SIZE, None, minimum=1),
        Parameter(MERGE_SIZE, 2, minimum=1),
        Parameter(VISION_SHARDS, None, minimum=0),
        Parameter(CHECKPOINT_SHARDS, None, minimum=0),
        Parameter(VISION_WEIGHT_BYTES, None, minimum=0),
        Parameter(CHECKPOINT_WEIGHT_BYTES, None, minimum=0),
        Parameter(PRECISION, "fp16"),
        Parameter(PROFILE_MIN_PATCHES, 4, minimum=1),
        Parameter(PROFILE_OPT_PATCHES, 1024, minimum=1),
        Parameter(PROFILE_MAX_PATCHES, 8192, minimum=1),
        Parameter(PROFILE_MAX_IMAGES, 8, minimum=1),
    )
}


def parameter(key: str) -> Parameter:
    try:
        return PARAMETERS[key]
    except KeyError:
        raise ContractError(f"parameter '{key}' is not declared in python_backends/contract.py") from None


def default_of(key: str) -> Any:
    return parameter(key).default


def limit_defaults() -> dict[str, int]:
    """The request limits every target starts from."""
    return {key: int(default_of(key)) for key in LIMITS}


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


# ---------------------------------------------------------------------------------------------
# The embedding cache policy
# ---------------------------------------------------------------------------------------------

CacheScope = Literal["node", "instance"]


@dataclass(frozen=True)
class CachePolicy:
    """The embedding cache, in one place: every store-using model (``encoder_<i>``, ``epd``,
    ``prefill``, ``decode``) gets :meth:`to_parameters` as config parameters and reads them
    back with :meth:`from_parameters`.

    Keys always cover the media bytes, the preprocessing config and the encoder version (the
    served encoder file's digest), so a rebuilt encoder or a changed resize setting never
    meets old embeddings. ``scope``: ``node`` -- one key space for every encoder of the node
    (an image encoded by one is a hit for all); ``instance`` -- each encoder model its own
    (the per-instance baseline the shared store is measured against).
    """

    path: str = str(default_of(STORE_PATH))  # the node's store (LMDB on tmpfs)
    capacity_bytes: int = int(default_of(STORE_CAPACITY_BYTES))
    eviction: Literal["lru"] = "lru"
    ttl_s: float = float(default_of(STORE_TTL_S))  # 0: entries live until evicted
    scope: CacheScope = "node"
    encoders: int = 2  # encoder models encoder_0 .. encoder_<n-1>
    device: str = str(default_of(STORE_DEVICE))  # where the bytes live: "cpu" or "cuda:N"

    def __post_init__(self) -> None:
        if self.encoders < 1:
            raise ContractError("CachePolicy.encoders must be at least 1")
        if self.scope not in ("node", "instance"):
            raise ContractError(f"CachePolicy.scope must be 'node' or 'instance', got {self.scope!r}")

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
        }

    @classmethod
    def from_parameters(cls, values: Mapping[str, str]) -> CachePolicy:
        """The policy a model's config parameters carry (absent keys: the defaults above).
        ``encoders`` is not a store parameter (only ``epd`` lists the encoder models): default."""

        def text(key: str) -> str | None:
            value = values.get(key)
            return None if value is None or value == "" else str(value)

        def read(key: str, parse: Any) -> Any:
            raw = text(key)
            return default_of(key) if raw is None else parse(key, raw)

        return cls(
            path=read(STORE_PATH, lambda _key, raw: raw),
            capacity_bytes=read(STORE_CAPACITY_BYTES, parse_integer),
            eviction=read(STORE_EVICTION, lambda _key, raw: raw),
            ttl_s=read(STORE_TTL_S, parse_number),
            scope=read(CACHE_SCOPE, lambda _key, raw: raw),
            device=read(STORE_DEVICE, lambda _key, raw: raw),
        )


# ---------------------------------------------------------------------------------------------
# Every model's interface
# ---------------------------------------------------------------------------------------------

GENERATE_OPTIONS = (
    _tensor(STREAM, "TYPE_BOOL", 1, optional=True),
    _tensor(SAMPLING_PARAMETERS, "TYPE_STRING", 1, optional=True),
    _tensor(EXCLUDE_INPUT_IN_OUTPUT, "TYPE_BOOL", 1, optional=True),
)
GENERATE_OUTPUTS = (
    _tensor(TEXT_OUTPUT, "TYPE_STRING", -1),
    _tensor(OUTPUT_TOKEN_IDS, "TYPE_INT64", -1),
    _tensor(NUM_INPUT_TOKENS, "TYPE_UINT32", 1),
    _tensor(NUM_OUTPUT_TOKENS, "TYPE_UINT32", 1),
    _tensor(FINISH_REASON, "TYPE_STRING", 1),
)
_PROMPT = _tensor(TEXT_INPUT, "TYPE_STRING", 1)
_ENCODED_IMAGES = _tensor(IMAGE, "TYPE_STRING", -1, optional=True)  # one or more encoded files
_IMAGE_REFERENCES = _tensor(REFERENCES, "TYPE_STRING", -1, optional=True)  # <= 1 KB JSON each
_ERRORS_AS_OUTPUTS = _tensor(ERRORS_AS_OUTPUTS, "TYPE_BOOL", 1, optional=True)
_ERROR = _tensor(ERROR, "TYPE_STRING", 1)
_STORE_USER = (*STORE_KEYS, SPATIAL_MERGE_SIZE)
_CONTENT_KEYS = (PREPROCESSOR_CONFIG, ENCODER_FILE)

# ``llm``: one colocated vLLM engine. ``image`` (encoded files) or, instead, embeddings by value:
# ``image_embeds`` [n, tokens, hidden] (encode's output as it is) with ``image_grid_thw`` [images, 3].
LLM = ModelInterface(
    LLM_MODEL,
    (
        _PROMPT,
        _ENCODED_IMAGES,
        _tensor(IMAGE_EMBEDS, "TYPE_FP32", -1, -1, HIDDEN_SIZE, optional=True),
        _tensor(IMAGE_GRID_THW, "TYPE_INT64", -1, 3, optional=True),
        *GENERATE_OPTIONS,
    ),
    GENERATE_OUTPUTS,
    (*LIMITS, IMAGE_EMBEDS_HIDDEN_SIZE, SPATIAL_MERGE_SIZE),
    vllm_env=True,
)
# ``ensemble``: encode's steps -> llm; exactly one image per request, as encode takes it.
ENSEMBLE = ModelInterface(
    ENSEMBLE_MODEL, (_PROMPT, _tensor(IMAGE, "TYPE_UINT8", 1, -1), *GENERATE_OPTIONS), GENERATE_OUTPUTS
)
# ``epd``: the main entry point (BLS); llm's interface plus per-stage timings.
EPD = ModelInterface(
    EPD_MODEL,
    (_PROMPT, _ENCODED_IMAGES, *GENERATE_OPTIONS),
    (
        *GENERATE_OUTPUTS,
        *(_tensor(timing_output(stage), "TYPE_FP32", 1) for stage in TIMING_STAGES),
        _tensor(CACHE_HITS, "TYPE_UINT32", 1),
    ),
    (*LIMITS, *_STORE_USER, *_CONTENT_KEYS, ENCODER_MODELS_KEY, PREFILL_MODEL_KEY, DECODE_MODEL_KEY),
)
# ``preprocess``: the file's bytes, one image per batch row; rows of different requests differ in
# length, hence ragged (the DALI backend's input convention). Output order is the pipeline's.
PREPROCESS = ModelInterface(
    PREPROCESS_MODEL,
    (_tensor(IMAGE, "TYPE_UINT8", -1, ragged=True),),
    (_tensor(PIXEL_VALUES, "TYPE_FP32", -1, PATCH_DIM), _tensor(IMAGE_GRID_THW, "TYPE_INT64", 3)),
    (PIPELINE_FILE, PREPROCESSOR_CONFIG, DALI_NUM_THREADS, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS),
)
_EMBEDS = _tensor(IMAGE_EMBEDS, "TYPE_FP32", -1, HIDDEN_SIZE)
# ``vit_encoder`` (cpu): ONNX Runtime, dynamically batched, computes positions itself.
VIT_ENCODER = ModelInterface(
    VIT_ENCODER_MODEL,
    (_tensor(PIXEL_VALUES, "TYPE_FP32", -1, PATCH_DIM, ragged=True), _tensor(IMAGE_GRID_THW, "TYPE_INT64", 3)),
    (_EMBEDS,),
    (ONNX_FILE_KEY, INTRA_OP_THREADS, MAX_PATCHES_PER_RUN, *ENCODER_FACTS),
)
# ``vit_encoder`` (gpu): the TensorRT plan, one image per request (max_batch_size 0). pixel_values
# and image_embeds carry a leading 1 on the wire so that ``encode`` has the cpu target's shapes;
# Triton reshapes them to the engine's [patches, ...] (the engine's own input dims).
VIT_ENCODER_TENSORRT = ModelInterface(
    VIT_ENCODER_MODEL,
    (
        _tensor(PIXEL_VALUES, "TYPE_FP32", 1, -1, PATCH_DIM, reshape=(-1, PATCH_DIM)),
        _tensor(ROTARY_POS_IDS, "TYPE_INT64", -1, 2),
        _tensor(CU_SEQLENS, "TYPE_INT64", -1),
    ),
    (_tensor(IMAGE_EMBEDS, "TYPE_FP32", 1, -1, HIDDEN_SIZE, reshape=(-1, HIDDEN_SIZE)),),
    (PRECISION, PROFILE_MIN_PATCHES, PROFILE_OPT_PATCHES, PROFILE_MAX_PATCHES, PROFILE_MAX_IMAGES, *ENCODER_FACTS),
)
# ``vit_positions`` (gpu): rotary position ids and cu_seqlens for the plan, from the grid.
VIT_POSITIONS = ModelInterface(
    VIT_POSITIONS_MODEL,
    (_tensor(IMAGE_GRID_THW, "TYPE_INT64", -1, 3),),
    (_tensor(ROTARY_POS_IDS, "TYPE_INT64", -1, 2), _tensor(CU_SEQLENS, "TYPE_INT64", -1)),
    (MERGE_SIZE,),
)
# ``encode``: image -> embeddings + grid by value. Batched (cpu: several images of one size) or
# one image per request with the batch row explicit (gpu: the plan takes one image).
ENCODE = ModelInterface(
    ENCODE_MODEL, (_tensor(IMAGE, "TYPE_UINT8", -1),), (_EMBEDS, _tensor(IMAGE_GRID_THW, "TYPE_INT64", 3))
)
ENCODE_ONE_IMAGE = ModelInterface(
    ENCODE_MODEL,
    (_tensor(IMAGE, "TYPE_UINT8", 1, -1),),
    (_tensor(IMAGE_EMBEDS, "TYPE_FP32", 1, -1, HIDDEN_SIZE), _tensor(IMAGE_GRID_THW, "TYPE_INT64", 1, 3)),
)
# ``encoder_<i>``: media in, store write, references out. ``lease_owner``: the pid of the
# process the leases are for (epd); absent: no lease (warm-up).
ENCODER = ModelInterface(
    ENCODER_MODEL_PREFIX + "<i>",
    (_tensor(IMAGE, "TYPE_STRING", -1), _tensor(LEASE_OWNER, "TYPE_INT64", 1, optional=True), _ERRORS_AS_OUTPUTS),
    (
        _tensor(REFERENCES, "TYPE_STRING", -1),
        _tensor(MM_HASH, "TYPE_STRING", -1),
        _tensor(CACHE_HIT, "TYPE_BOOL", -1),
        _ERROR,
    ),
    (*_STORE_USER, *_CONTENT_KEYS, ENCODE_MODEL_KEY, MAX_IMAGE_BYTES, MAX_IMAGES_PER_REQUEST),
)
# ``prefill``: vLLM KV producer; prompt + references in, first token + KV transfer parameters out.
PREFILL = ModelInterface(
    PREFILL_MODEL,
    (_PROMPT, _IMAGE_REFERENCES, _tensor(SAMPLING_PARAMETERS, "TYPE_STRING", 1, optional=True), _ERRORS_AS_OUTPUTS),
    (
        _tensor(OUTPUT_TOKEN_IDS, "TYPE_INT64", -1),
        _tensor(TEXT_OUTPUT, "TYPE_STRING", -1),
        _tensor(NUM_INPUT_TOKENS, "TYPE_UINT32", 1),
        _tensor(FINISH_REASON, "TYPE_STRING", 1),
        _tensor(TRANSFER_PARAMS, "TYPE_STRING", 1),
        _ERROR,
    ),
    (MAX_TOKENS_LIMIT, *_STORE_USER),
    vllm_env=True,
)
# ``decode``: vLLM KV consumer, streams tokens 2..N. ``abort`` = true: a control request.
DECODE = ModelInterface(
    DECODE_MODEL,
    (
        _IMAGE_REFERENCES,
        _tensor(TRANSFER_PARAMS, "TYPE_STRING", 1, optional=True),
        _tensor(SAMPLING_PARAMETERS, "TYPE_STRING", 1, optional=True),
        _tensor(STREAM, "TYPE_BOOL", 1, optional=True),
        _tensor(REQUEST_ID, "TYPE_STRING", 1, optional=True),
        _tensor(ABORT, "TYPE_BOOL", 1, optional=True),
        _ERRORS_AS_OUTPUTS,
    ),
    (*GENERATE_OUTPUTS, _ERROR),
    (MAX_TOKENS_LIMIT, *_STORE_USER),
    vllm_env=True,
)

# Every interface by model name; a name may have one per target (cpu first, then gpu).
INTERFACES: dict[str, tuple[ModelInterface, ...]] = {
    LLM_MODEL: (LLM,),
    ENSEMBLE_MODEL: (ENSEMBLE,),
    EPD_MODEL: (EPD,),
    PREPROCESS_MODEL: (PREPROCESS,),
    VIT_ENCODER_MODEL: (VIT_ENCODER, VIT_ENCODER_TENSORRT),
    VIT_POSITIONS_MODEL: (VIT_POSITIONS,),
    ENCODE_MODEL: (ENCODE, ENCODE_ONE_IMAGE),
    PREFILL_MODEL: (PREFILL,),
    DECODE_MODEL: (DECODE,),
}


def interfaces_of(model: str) -> tuple[ModelInterface, ...]:
    """The interfaces a model of this name may have (``encoder_<i>``: the encoder's)."""
    if model.startswith(ENCODER_MODEL_PREFIX) and model[len(ENCODER_MODEL_PREFIX) :].isdigit():
        return (ENCODER,)
    try:
        return INTERFACES[model]
    except KeyError:
        raise ContractError(f"model '{model}' is not declared in python_backends/contract.py") from None


def tensor_names() -> frozenset[str]:
    """Every tensor name of every model."""
    return frozenset(
        t.name for group in (*INTERFACES.values(), (ENCODER,)) for m in group for t in (*m.inputs, *m.outputs)
    )

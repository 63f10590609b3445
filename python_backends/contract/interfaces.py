"""Every model's interface: its input and output tensors (name, data type, dims, optional or
not) and the config parameter keys it reads.

``builders`` render each config's tensors from these (named dims sized with the exported
encoder's facts); ``model.py`` files read their input names from them (``LLM.input_names``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from python_backends.contract import names as n
from python_backends.contract.names import ContractError

__all__ = [
    "AUDIO_ENCODER",
    "AUDIO_ENCODER_INSTANCE",
    "AUDIO_ENCODER_TENSORRT",
    "AUDIO_EPD",
    "AUDIO_PREFILL",
    "AUDIO_LLM",
    "DECODE",
    "ENCODE",
    "ENCODER",
    "ENCODE_ONE_IMAGE",
    "ENSEMBLE",
    "ENSEMBLE_ONE_IMAGE",
    "EPD",
    "GENERATE_OPTIONS",
    "GENERATE_OUTPUTS",
    "INTERFACES",
    "LLM",
    "PREFILL",
    "PREPROCESS",
    "PREPROCESS_DALI",
    "VIT_ENCODER",
    "VIT_ENCODER_TENSORRT",
    "VIT_POSITIONS",
    "DataType",
    "Dim",
    "ModelInterface",
    "TensorSpec",
    "interfaces_of",
    "tensor_names",
]

Dim = int | str
DataType = Literal["TYPE_BOOL", "TYPE_UINT8", "TYPE_UINT32", "TYPE_INT64", "TYPE_FP32", "TYPE_STRING"]


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

    def without(self, *names: str) -> ModelInterface:
        """The interface without the inputs ``names``."""
        inputs = tuple(t for t in self.inputs if t.name not in names)
        return ModelInterface(self.name, inputs, self.outputs, self.parameters, self.vllm_env)

    def taking_videos(self, max_videos: int) -> ModelInterface:
        """The interface a config declares for a model whose ``max_videos`` is ``max_videos``:
        without the ``video`` input when it is 0. A model that takes no video does not declare it:
        a client sees in the model's metadata that it takes none, a video is refused by Triton
        itself (unexpected input), and a client that must cover every optional input (perf_analyzer
        2.41's ``--shared-memory``) is not asked for a video an image request does not have."""
        return self if max_videos > 0 else self.without(n.VIDEO)

    def taking_audios(self, max_audios: int) -> ModelInterface:
        """As :meth:`taking_videos`, for ``audio``: declared only by a model of an audio checkpoint."""
        return self if max_audios > 0 else self.without(n.AUDIO)

    def accepts_parameter(self, key: str) -> bool:
        if key in (n.TEST_PAUSES, n.CPUS):  # any python model (test pauses: the decoupled ones)
            return True
        return key in self.parameters or (self.vllm_env and key.startswith(n.ENGINE_ENV_PREFIXES))


GENERATE_OPTIONS = (
    _tensor(n.STREAM, "TYPE_BOOL", 1, optional=True),
    _tensor(n.SAMPLING_PARAMETERS, "TYPE_STRING", 1, optional=True),
    _tensor(n.EXCLUDE_INPUT_IN_OUTPUT, "TYPE_BOOL", 1, optional=True),
)
GENERATE_OUTPUTS = (
    _tensor(n.TEXT_OUTPUT, "TYPE_STRING", -1),
    _tensor(n.OUTPUT_TOKEN_IDS, "TYPE_INT64", -1),
    _tensor(n.NUM_INPUT_TOKENS, "TYPE_UINT32", 1),
    _tensor(n.NUM_OUTPUT_TOKENS, "TYPE_UINT32", 1),
    _tensor(n.FINISH_REASON, "TYPE_STRING", 1),
    _tensor(n.OUTPUT_INDEX, "TYPE_UINT32", 1),
    _tensor(n.LOGPROBS, "TYPE_STRING", 1),
    _tensor(n.PROMPT_LOGPROBS, "TYPE_STRING", 1),
)
_PROMPT = _tensor(n.TEXT_INPUT, "TYPE_STRING", 1)
_ENCODED_IMAGES = _tensor(n.IMAGE, "TYPE_STRING", -1, optional=True)  # one or more encoded files
_ENCODED_VIDEOS = _tensor(n.VIDEO, "TYPE_STRING", -1, optional=True)  # llm, epd, encoders: video files
_ENCODED_AUDIOS = _tensor(n.AUDIO, "TYPE_STRING", -1, optional=True)  # llm of an audio checkpoint: audio files
_IMAGE_REFERENCES = _tensor(n.REFERENCES, "TYPE_STRING", -1, optional=True)  # <= 1 KB JSON each
_ERRORS_AS_OUTPUTS = _tensor(n.ERRORS_AS_OUTPUTS, "TYPE_BOOL", 1, optional=True)
# ``llm``, ``epd``: a client names its request (``request_id``) and stops it in-band with a control
# request (the same id, ``abort`` = true) instead of cancelling the stream (docs/operations.md).
_CLIENT_ABORT = (
    _tensor(n.REQUEST_ID, "TYPE_STRING", 1, optional=True),
    _tensor(n.ABORT, "TYPE_BOOL", 1, optional=True),
)
_ERROR = _tensor(n.ERROR, "TYPE_STRING", 1)
_STORE_USER = (*n.STORE_KEYS, n.SPATIAL_MERGE_SIZE)
_CONTENT_KEYS = (n.PREPROCESSOR_CONFIG, n.ENCODER_FILE, n.IMAGE_BACKEND, n.VIT_PRECISION)

# ``llm``: one colocated vLLM engine. ``image`` (encoded files) or, instead, embeddings by value:
# ``image_embeds`` [n, tokens, hidden] (encode's output as it is) with ``image_grid_thw`` [images, 3].
LLM = ModelInterface(
    n.LLM_MODEL,
    (
        _PROMPT,
        _ENCODED_IMAGES,
        _ENCODED_VIDEOS,
        _ENCODED_AUDIOS,
        _tensor(n.IMAGE_EMBEDS, "TYPE_FP32", -1, -1, n.HIDDEN_SIZE, optional=True),
        _tensor(n.IMAGE_GRID_THW, "TYPE_INT64", -1, 3, optional=True),
        *GENERATE_OPTIONS,
        *_CLIENT_ABORT,
    ),
    GENERATE_OUTPUTS,
    (
        *n.LIMITS,
        *n.VIDEO_LIMITS,
        *n.AUDIO_LIMITS,
        n.IMAGE_EMBEDS_HIDDEN_SIZE,
        n.SPATIAL_MERGE_SIZE,
        n.GENERATION_CONFIG,
    ),
    vllm_env=True,
)
# ``llm`` of an audio checkpoint (Qwen2-Audio: audio in, no image or video).
AUDIO_LLM = LLM.without(n.IMAGE, n.VIDEO, n.IMAGE_EMBEDS, n.IMAGE_GRID_THW)
# ``ensemble`` (cpu): encode's steps -> llm; 0 to max_images encoded images per request, as llm
# takes them (absent: preprocess gets no image and llm no embeddings, Triton's optional inputs).
ENSEMBLE = ModelInterface(n.ENSEMBLE_MODEL, (_PROMPT, _ENCODED_IMAGES, *GENERATE_OPTIONS), GENERATE_OUTPUTS)
# ``ensemble`` (gpu): exactly one image per request, as the gpu target's ``encode`` takes it.
ENSEMBLE_ONE_IMAGE = ModelInterface(
    n.ENSEMBLE_MODEL, (_PROMPT, _tensor(n.IMAGE, "TYPE_UINT8", 1, -1), *GENERATE_OPTIONS), GENERATE_OUTPUTS
)
# ``epd``: the main entry point; llm's interface plus per-stage timings and the path that served
# the request. Its colocated path runs a vLLM engine in epd's own process (``VLLM_*`` parameters).
# ``errors_as_outputs``: a gRPC stream carries a model error as a message without its code; a
# client that wants the code asks for the error in the ``error`` output (JSON code + message).
EPD = ModelInterface(
    n.EPD_MODEL,
    (_PROMPT, _ENCODED_IMAGES, _ENCODED_VIDEOS, _ENCODED_AUDIOS, *GENERATE_OPTIONS, _ERRORS_AS_OUTPUTS, *_CLIENT_ABORT),
    (
        *GENERATE_OUTPUTS,
        *(_tensor(n.timing_output(stage), "TYPE_FP32", 1) for stage in n.TIMING_STAGES),
        _tensor(n.CACHE_HITS, "TYPE_UINT32", 1),
        _ERROR,
        _tensor(n.SERVING_PATH, "TYPE_STRING", 1),
    ),
    (
        *n.LIMITS,
        *n.VIDEO_LIMITS,
        *n.AUDIO_LIMITS,
        n.GENERATION_CONFIG,
        *_STORE_USER,
        *_CONTENT_KEYS,
        n.ENCODER_MODELS_KEY,
        n.PREFILL_MODEL_KEY,
        n.DECODE_MODEL_KEY,
        n.PATH_POLICY,
        n.COLOCATED_ENCODES,
        n.SHARED_COMPUTE,
        n.REMOTE_ENCODERS_KEY,
        n.REMOTE_ENCODE_DEADLINE_S,
        n.REMOTE_LOCAL_FALLBACK,
    ),
    vllm_env=True,
)
# ``epd`` of an audio checkpoint: audio in (its encoders, prefill and decode take audio references).
AUDIO_EPD = EPD.without(n.IMAGE, n.VIDEO)
_PREPROCESS_PARAMETERS = (
    n.IMAGE_BACKEND,
    n.PIPELINE_FILE,
    n.PREPROCESSOR_CONFIG,
    n.DALI_NUM_THREADS,
    n.MAX_IMAGE_BYTES,
    n.MAX_IMAGE_PIXELS,
)
# ``preprocess`` (cpu): a python model, not batched: one request's 0..N encoded images (raw bytes
# or base64, as llm takes them; at most ``max_images_per_request``) -> every image's folded rows
# concatenated in order, and one grid row per image. No image: [0, image_patch_dim] and [0, 3].
PREPROCESS = ModelInterface(
    n.PREPROCESS_MODEL,
    (_ENCODED_IMAGES,),
    (
        _tensor(n.PIXEL_VALUES, "TYPE_FP32", -1, n.IMAGE_PATCH_DIM),
        _tensor(n.IMAGE_GRID_THW, "TYPE_INT64", -1, 3),
    ),
    (*_PREPROCESS_PARAMETERS, n.MAX_IMAGES_PER_REQUEST),
)
# ``preprocess`` (gpu): Triton's DALI backend, dynamically batched: the file's bytes, one image per
# batch row; rows of different requests differ in length, hence ragged (the DALI backend's input
# convention). Output order is the pipeline's. (tests/server/test_gpu_topology.py serves it with the
# cpu model.py, which takes this interface too when its config batches.)
PREPROCESS_DALI = ModelInterface(
    n.PREPROCESS_MODEL,
    (_tensor(n.IMAGE, "TYPE_UINT8", -1, ragged=True),),
    (_tensor(n.PIXEL_VALUES, "TYPE_FP32", -1, n.IMAGE_PATCH_DIM), _tensor(n.IMAGE_GRID_THW, "TYPE_INT64", 3)),
    _PREPROCESS_PARAMETERS,
)
# ``vit_encoder`` (cpu): ONNX Runtime (or OpenVINO), not batched, computes positions itself: one
# request's images (or one video) as rows concatenated in grid order, folded (an image from
# preprocess, ``image_patch_dim`` wide) or full (a video's, ``patch_dim``); every image's tokens
# concatenated in order ([1, 0, hidden] for no image), the leading 1 as llm takes them.
VIT_ENCODER = ModelInterface(
    n.VIT_ENCODER_MODEL,
    (_tensor(n.PIXEL_VALUES, "TYPE_FP32", -1, -1), _tensor(n.IMAGE_GRID_THW, "TYPE_INT64", -1, 3)),
    (_tensor(n.IMAGE_EMBEDS, "TYPE_FP32", 1, -1, n.HIDDEN_SIZE),),
    (n.ONNX_FILE_KEY, n.VIT_THREADS, n.VIT_PRECISION, *n.ENCODER_FACTS),
)
# ``vit_encoder`` (gpu): the TensorRT plan, one image per request (max_batch_size 0). pixel_values
# is the engine's own [frames, patches, width] with one frame of folded rows: preprocess's output
# for one image as it is. image_embeds carries a leading 1 on the wire so that ``encode`` has the
# cpu target's shapes; Triton reshapes it to the engine's [tokens, hidden].
VIT_ENCODER_TENSORRT = ModelInterface(
    n.VIT_ENCODER_MODEL,
    (
        _tensor(n.PIXEL_VALUES, "TYPE_FP32", 1, -1, n.IMAGE_PATCH_DIM),
        _tensor(n.ROTARY_POS_IDS, "TYPE_INT64", -1, 2),
    ),
    (_tensor(n.IMAGE_EMBEDS, "TYPE_FP32", 1, -1, n.HIDDEN_SIZE, reshape=(-1, n.HIDDEN_SIZE)),),
    (n.PRECISION, n.PROFILE_MIN_PATCHES, n.PROFILE_OPT_PATCHES, n.PROFILE_MAX_PATCHES, *n.ENCODER_FACTS),
)
# ``vit_positions`` (gpu): the plan's rotary position ids, one frame's, from one image's grid.
VIT_POSITIONS = ModelInterface(
    n.VIT_POSITIONS_MODEL,
    (_tensor(n.IMAGE_GRID_THW, "TYPE_INT64", 1, 3),),
    (_tensor(n.ROTARY_POS_IDS, "TYPE_INT64", -1, 2),),
    (n.MERGE_SIZE,),
)
# ``encode`` (cpu): a request's encoded images (BYTES, 0..N) -> every image's embeddings
# concatenated in order + one grid row per image, by value (not batched: preprocess and
# vit_encoder take one request's images at once).
ENCODE = ModelInterface(
    n.ENCODE_MODEL,
    (_tensor(n.IMAGE, "TYPE_STRING", -1),),
    (_tensor(n.IMAGE_EMBEDS, "TYPE_FP32", 1, -1, n.HIDDEN_SIZE), _tensor(n.IMAGE_GRID_THW, "TYPE_INT64", -1, 3)),
)
# ``encode`` (gpu): one image per request, its bytes as UINT8 [1, bytes] (the plan takes one image).
ENCODE_ONE_IMAGE = ModelInterface(
    n.ENCODE_MODEL,
    (_tensor(n.IMAGE, "TYPE_UINT8", 1, -1),),
    (_tensor(n.IMAGE_EMBEDS, "TYPE_FP32", 1, -1, n.HIDDEN_SIZE), _tensor(n.IMAGE_GRID_THW, "TYPE_INT64", 1, 3)),
)
# ``encoder_<i>``: media in (images, or videos), store write, references out. ``lease_owner``: the
# pid of the process the leases are for (epd); absent: no lease (warm-up).
ENCODER = ModelInterface(
    n.ENCODER_MODEL_PREFIX + "<i>",
    (
        _tensor(n.IMAGE, "TYPE_STRING", -1, optional=True),
        _ENCODED_VIDEOS,
        _ENCODED_AUDIOS,
        _tensor(n.LEASE_OWNER, "TYPE_INT64", 1, optional=True),
        _ERRORS_AS_OUTPUTS,
    ),
    (
        _tensor(n.REFERENCES, "TYPE_STRING", -1),
        _tensor(n.MM_HASH, "TYPE_STRING", -1),
        _tensor(n.CACHE_HIT, "TYPE_BOOL", -1),
        _ERROR,
        # With the request parameter ``by_value`` (one image): the stored embedding and its digest.
        _tensor(n.IMAGE_EMBEDS, "TYPE_FP32", -1, -1, -1),
        _tensor(n.IMAGE_GRID_THW, "TYPE_INT64", -1, 3),
        _tensor(n.EMBEDDING_DIGEST, "TYPE_STRING", -1),
    ),
    (
        *_STORE_USER,
        *_CONTENT_KEYS,
        n.ENCODE_MODEL_KEY,
        n.ENCODE_ONE_IMAGE_KEY,
        n.MAX_IMAGE_BYTES,
        n.MAX_IMAGES_PER_REQUEST,
        *n.VIDEO_LIMITS,
        *n.AUDIO_LIMITS,
        n.DALI_NUM_THREADS,
    ),
)
# ``encoder_<i>`` of an audio checkpoint: audio files in, references out.
AUDIO_ENCODER_INSTANCE = ENCODER.without(n.IMAGE, n.VIDEO)
# ``audio_encoder``: the ONNX audio encoder (ONNX Runtime), features in, embeddings by value.
AUDIO_ENCODER = ModelInterface(
    n.AUDIO_ENCODER_MODEL,
    (_tensor(n.INPUT_FEATURES, "TYPE_FP32", -1, -1, -1), _tensor(n.FEATURE_LENGTHS, "TYPE_INT64", -1)),
    (_tensor(n.AUDIO_EMBEDS, "TYPE_FP32", -1, -1, -1), _tensor(n.AUDIO_TOKENS, "TYPE_INT64", -1)),
    (n.ONNX_FILE_KEY, n.INTRA_OP_THREADS),
)
# ``audio_encoder`` (gpu): the TensorRT plan of the same graph, the same tensors (encoder_<i> calls
# both alike; Triton's TensorRT backend matches a -1 against the engine's fixed dims).
AUDIO_ENCODER_TENSORRT = ModelInterface(
    n.AUDIO_ENCODER_MODEL, AUDIO_ENCODER.inputs, AUDIO_ENCODER.outputs, (n.PRECISION, n.PROFILE_MAX_CLIPS)
)
# ``prefill``: vLLM KV producer; prompt + references in, first token + KV transfer parameters out.
PREFILL = ModelInterface(
    n.PREFILL_MODEL,
    (_PROMPT, _IMAGE_REFERENCES, _tensor(n.SAMPLING_PARAMETERS, "TYPE_STRING", 1, optional=True), _ERRORS_AS_OUTPUTS),
    (
        _tensor(n.OUTPUT_TOKEN_IDS, "TYPE_INT64", -1),
        _tensor(n.TEXT_OUTPUT, "TYPE_STRING", -1),
        _tensor(n.NUM_INPUT_TOKENS, "TYPE_UINT32", 1),
        _tensor(n.FINISH_REASON, "TYPE_STRING", 1),
        _tensor(n.TRANSFER_PARAMS, "TYPE_STRING", 1),
        _tensor(n.LOGPROBS, "TYPE_STRING", 1),
        _tensor(n.PROMPT_LOGPROBS, "TYPE_STRING", 1),
        _ERROR,
    ),
    (*n.SAMPLING_LIMITS, *_STORE_USER),
    vllm_env=True,
)
# ``prefill`` of an audio checkpoint: ``audio`` (measurement only) takes the clips themselves too,
# decoded and re-extracted there (contract.FORWARD_MEDIA: the baseline of metadata-only forwarding).
AUDIO_PREFILL = ModelInterface(
    n.PREFILL_MODEL,
    (*PREFILL.inputs, _ENCODED_AUDIOS),
    PREFILL.outputs,
    (*PREFILL.parameters, *n.AUDIO_LIMITS, n.PREPROCESSOR_CONFIG),
    vllm_env=True,
)
# ``decode``: vLLM KV consumer, streams tokens 2..N. ``abort`` = true: a control request.
DECODE = ModelInterface(
    n.DECODE_MODEL,
    (
        _IMAGE_REFERENCES,
        _tensor(n.TRANSFER_PARAMS, "TYPE_STRING", 1, optional=True),
        _tensor(n.SAMPLING_PARAMETERS, "TYPE_STRING", 1, optional=True),
        _tensor(n.STREAM, "TYPE_BOOL", 1, optional=True),
        _tensor(n.REQUEST_ID, "TYPE_STRING", 1, optional=True),
        _tensor(n.ABORT, "TYPE_BOOL", 1, optional=True),
        _tensor(n.POLL_OFFSET, "TYPE_INT64", 1, optional=True),
        _ERRORS_AS_OUTPUTS,
    ),
    (*GENERATE_OUTPUTS, _tensor(n.POLL_OFFSET, "TYPE_INT64", 1), _ERROR),
    (*n.SAMPLING_LIMITS, n.STREAM_INTERVAL, *_STORE_USER),
    vllm_env=True,
)

# Every interface by model name; a name may have one per target (cpu first, then gpu), and the
# models that take video one without ``video`` for ``max_videos`` 0 (``taking_videos``).
INTERFACES: dict[str, tuple[ModelInterface, ...]] = {
    n.LLM_MODEL: (LLM.taking_audios(0), LLM.taking_audios(0).taking_videos(0), AUDIO_LLM),
    n.ENSEMBLE_MODEL: (ENSEMBLE, ENSEMBLE_ONE_IMAGE),
    n.EPD_MODEL: (EPD.taking_audios(0), EPD.taking_audios(0).taking_videos(0), AUDIO_EPD),
    n.PREPROCESS_MODEL: (PREPROCESS, PREPROCESS_DALI),
    n.VIT_ENCODER_MODEL: (VIT_ENCODER, VIT_ENCODER_TENSORRT),
    n.VIT_POSITIONS_MODEL: (VIT_POSITIONS,),
    n.ENCODE_MODEL: (ENCODE, ENCODE_ONE_IMAGE),
    n.PREFILL_MODEL: (PREFILL, AUDIO_PREFILL),
    n.DECODE_MODEL: (DECODE,),
    n.AUDIO_ENCODER_MODEL: (AUDIO_ENCODER, AUDIO_ENCODER_TENSORRT),
}


def interfaces_of(model: str) -> tuple[ModelInterface, ...]:
    """The interfaces a model of this name may have (``encoder_<i>``: the encoder's)."""
    if model.startswith(n.ENCODER_MODEL_PREFIX) and model[len(n.ENCODER_MODEL_PREFIX) :].isdigit():
        images = ENCODER.taking_audios(0)
        return (images, images.taking_videos(0), AUDIO_ENCODER_INSTANCE)
    try:
        return INTERFACES[model]
    except KeyError:
        raise ContractError(f"model '{model}' is not declared in python_backends/contract.py") from None


def tensor_names() -> frozenset[str]:
    """Every tensor name of every model."""
    return frozenset(
        t.name for group in (*INTERFACES.values(), (ENCODER,)) for m in group for t in (*m.inputs, *m.outputs)
    )

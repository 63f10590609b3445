"""Names of the contract: models, tensors and config parameter keys (plain strings).

Code writes ``contract.TEXT_INPUT``, never the literal: a name is changed here and nowhere
else (tests/unit/test_contract.py checks that every name the serving code uses is declared).
"""

# No imports here: ``from names import *`` in the package exports exactly the names below.


class ContractError(ValueError):
    """A value breaks the contract (a parameter that does not parse, an unknown name or size)."""


# Models (docs/architecture.md: the names are used by tests, clients and docs).
LLM_MODEL = "llm"
EPD_MODEL = "epd"
ENSEMBLE_MODEL = "ensemble"
PREPROCESS_MODEL = "preprocess"
VIT_ENCODER_MODEL = "vit_encoder"
VIT_POSITIONS_MODEL = "vit_positions"
ENCODE_MODEL = "encode"
AUDIO_ENCODER_MODEL = "audio_encoder"  # an audio checkpoint's encoder (ONNX Runtime), called by encoder_<i>
PREFILL_MODEL = "prefill"
DECODE_MODEL = "decode"
ENCODER_MODEL_PREFIX = "encoder_"  # encoder_0 .. encoder_<n-1>, one per encoder of the cache policy


def encoder_model_names(count: int) -> tuple[str, ...]:
    return tuple(f"{ENCODER_MODEL_PREFIX}{i}" for i in range(count))


# The user-facing request (llm, ensemble, epd), close to Triton's vllm_backend.
TEXT_INPUT = "text_input"
IMAGE = "image"
VIDEO = "video"  # llm: one or more encoded videos
AUDIO = "audio"  # llm of an audio checkpoint: one or more encoded audio files (WAV, FLAC, MP3, Ogg)
STREAM = "stream"
SAMPLING_PARAMETERS = "sampling_parameters"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
TEXT_OUTPUT = "text_output"
OUTPUT_TOKEN_IDS = "output_token_ids"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"
FINISH_REASON = "finish_reason"
# Which of a request's ``n`` sequences a response's text and tokens belong to (0 when n = 1).
OUTPUT_INDEX = "output_index"
# With ``logprobs`` / ``prompt_logprobs`` in sampling_parameters: JSON, vllm_backend's layout (a
# list, one entry per token: {"<token id>": {"logprob", "rank", "decoded_token"}}); the prompt's
# on the first response only, its first entry null. JSON null where there are none.
LOGPROBS = "logprobs"
PROMPT_LOGPROBS = "prompt_logprobs"
CACHE_HITS = "cache_hits"  # epd: images served from the embedding store
TIMING_STAGES = ("hash", "lookup", "encode", "prefill", "decode")  # epd: timing_<stage>_ms
# epd's serving paths (python_backends/epd_paths): which one served a request comes back in the
# ``serving_path`` output; a request may force one with the Triton request parameter ``path``.
SERVING_PATH = "serving_path"
PATH_REQUEST_PARAMETER = "path"
DISAGGREGATED_PATH = "disaggregated"  # store -> encoders -> prefill -> KV transfer -> decode
COLOCATED_PATH = "colocated"  # epd's own vLLM engine does prefill and decode
SERVING_PATHS = (DISAGGREGATED_PATH, COLOCATED_PATH)
ADAPTIVE_POLICY = "adaptive"  # the path with the lower predicted completion time, per request
PATH_POLICIES = (ADAPTIVE_POLICY, *SERVING_PATHS)

# The encode path (preprocess -> [vit_positions ->] vit_encoder), embeddings by value.
PIXEL_VALUES = "pixel_values"
IMAGE_GRID_THW = "image_grid_thw"
ROTARY_POS_IDS = "rotary_pos_ids"
IMAGE_EMBEDS = "image_embeds"
# The audio encode path (encoder_<i>: FFmpeg decode, DALI features -> audio_encoder), by value.
INPUT_FEATURES = "input_features"  # Whisper log-mel features, [clips, mel bins, frames]
FEATURE_LENGTHS = "feature_lengths"  # the frames each clip fills
AUDIO_EMBEDS = "audio_embeds"  # [clips, padded tokens, hidden]
AUDIO_TOKENS = "audio_tokens"  # the tokens of each clip: its embeddings are audio_embeds[i, :audio_tokens[i]]

# Stages that epd calls over BLS (encoder_<i>, prefill, decode).
REFERENCES = "references"  # one signed reference per image, never media
MM_HASH = "mm_hash"
CACHE_HIT = "cache_hit"
LEASE_OWNER = "lease_owner"
TRANSFER_PARAMS = "transfer_params"
REQUEST_ID = "request_id"
ABORT = "abort"
# decode, polled (pd/polling.py): the offset a poll reads from (input) and the next one (output).
POLL_OFFSET = "poll_offset"
# Errors as an output on request: why in python_backends/triton_edge/responses.py.
ERRORS_AS_OUTPUTS = "errors_as_outputs"
ERROR = "error"


def timing_output(stage: str) -> str:
    if stage not in TIMING_STAGES:
        raise ContractError(f"no timing output for stage {stage!r}; stages: {TIMING_STAGES}")
    return f"timing_{stage}_ms"


# Sizes the exported encoder decides (EncoderFacts): a tensor dim may name one, filled in at
# build time; they are vit_encoder parameters too.
PATCH_DIM = "patch_dim"
# An image's rows folded to one temporal copy (C*P*P): what preprocess sends (vit_onnx.py).
IMAGE_PATCH_DIM = "image_patch_dim"
HIDDEN_SIZE = "hidden_size"

# Config parameter keys (their defaults: parameters.py).
# Parameters that are process environment for a vLLM engine: vLLM's own, and OpenMP's (torch's
# CPU threads, read by the engine-core process at start).
ENGINE_ENV_PREFIXES = ("VLLM_", "OMP_")
# Request limits of the user-facing models (image limits also bind preprocess and encoders).
MAX_IMAGES = "max_images"
MAX_IMAGE_BYTES = "max_image_bytes"
MAX_IMAGE_PIXELS = "max_image_pixels"
MAX_TOKENS_LIMIT = "max_tokens_limit"
# The most alternatives a request's ``logprobs`` / ``prompt_logprobs`` may ask (vLLM's max_logprobs)
# and the most sequences its ``n`` may ask.
MAX_LOGPROBS = "max_logprobs"
MAX_N = "max_n"
# Sampling defaults from the checkpoint: ``auto`` (its generation_config.json, as `vllm serve`),
# ``vllm`` (vLLM's own defaults) or a folder holding a generation_config.json.
GENERATION_CONFIG = "generation_config"
MAX_IMAGES_PER_REQUEST = "max_images_per_request"  # encoder_<i>
# decode, polled: the tokens one poll's answer waits for (vLLM's ``stream_interval``, pd/polling.py).
STREAM_INTERVAL = "stream_interval"
# What a request's sampling_parameters may ask (every model that parses them: llm, epd, prefill, decode).
SAMPLING_LIMITS = (MAX_TOKENS_LIMIT, MAX_LOGPROBS, MAX_N)
LIMITS = (MAX_IMAGES, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, *SAMPLING_LIMITS)
# Video limits of ``llm``, ``epd`` and the encoders. ``max_frames`` caps the frame
# sampler (python_backends/request/videos.py) and is passed to vLLM's loader; ``video_codecs`` are the
# codecs the target's decoder reads (comma-separated).
MAX_VIDEOS = "max_videos"
MAX_VIDEO_BYTES = "max_video_bytes"
MAX_VIDEO_SECONDS = "max_video_seconds"
MAX_FRAMES = "max_frames"
VIDEO_CODECS = "video_codecs"
VIDEO_LIMITS = (MAX_VIDEOS, MAX_VIDEO_BYTES, MAX_VIDEO_SECONDS, MAX_FRAMES, VIDEO_CODECS)
# Audio limits of the models that take audio (python_backends/request/audios.py, AudioLimits);
# ``audio_sampling_rate`` is the checkpoint feature extractor's rate, what clips are resampled to.
MAX_AUDIOS = "max_audios"
MAX_AUDIO_BYTES = "max_audio_bytes"
MAX_AUDIO_SECONDS = "max_audio_seconds"
AUDIO_SAMPLING_RATE = "audio_sampling_rate"
AUDIO_LIMITS = (MAX_AUDIOS, MAX_AUDIO_BYTES, MAX_AUDIO_SECONDS, AUDIO_SAMPLING_RATE)
# Embeddings by value (llm) and the store's grid check.
IMAGE_EMBEDS_HIDDEN_SIZE = "image_embeds_hidden_size"
SPATIAL_MERGE_SIZE = "spatial_merge_size"
# The models a model calls over BLS.
ENCODE_MODEL_KEY = "encode_model"
# encoder_<i>: the encode model takes one image as UINT8 [1, bytes] (the gpu target's one-image
# DAG) instead of a request's encoded images as BYTES [n] (the cpu target's).
ENCODE_ONE_IMAGE_KEY = "encode_one_image"
ENCODER_MODELS_KEY = "encoder_models"
PREFILL_MODEL_KEY = "prefill_model"
DECODE_MODEL_KEY = "decode_model"
# epd: the deployment's path policy (one of PATH_POLICIES; a request's ``path`` overrides it).
PATH_POLICY = "path_policy"
# epd: who encodes the images the store lacks on the colocated path: ``engine`` (epd's own vLLM
# engine, from the media, when every image is new) or ``encoders`` (always the encoder models,
# into the store; the engine gets embeddings by reference: vLLM's 1E+1PD, the E|PD topology).
COLOCATED_ENCODES = "colocated_encodes"
COLOCATED_ENCODERS = ("engine", "encoders")
# epd: whether its two paths' engines share processors (the adaptive rule, epd/path_cost.py); the
# builders write false when epd's CPU set is apart from prefill's and decode's.
SHARED_COMPUTE = "shared_compute"
# Any python model: the CPUs its stub (and what the stub starts: a vLLM engine core, ONNX Runtime
# and DALI threads) runs on, as a Linux CPU list ("0", "0-1,3"); empty: wherever the server runs.
CPUS = "cpus"
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
# Which node the store lives on (``triton-epd-serve --node-id``): servers with the same node id and
# store path share one store and pass embeddings by reference; others must copy them over.
NODE_ID = "node_id"
# epd on a ``pd`` server: its remote encoders (``HOST:PORT,...``, ``dns:NAME:PORT`` or ``file:PATH``;
# ``local``: none, the server's own encoder models) and each remote encode call's deadline.
REMOTE_ENCODERS_KEY = "remote_encoders"
LOCAL_ENCODERS = "local"
REMOTE_ENCODE_DEADLINE_S = "remote_encode_deadline_s"
# Whether epd, with remote encoders, may encode on this server's own encoder models when no remote
# encoder is left (true on an ``all`` server given ``--remote-encoders``; a ``pd`` server has none).
REMOTE_LOCAL_FALLBACK = "remote_local_fallback"
TENANT_POLICY = "tenant_policy"  # isolated | shared: whether cache entries cross tenants
# Test only (python_backends/runtime/stage_pauses.py): pauses at fixed points of every request of a
# decoupled python model, so that a server test can cancel there. Never in a served target.
TEST_PAUSES = "test_pauses"
STORE_KEYS = (
    STORE_PATH, STORE_CAPACITY_BYTES, STORE_EVICTION, STORE_TTL_S, STORE_DEVICE, CACHE_SCOPE, NODE_ID, TENANT_POLICY
)
# Triton request parameters (not tensors): the tenant that scopes cache keys and mm_hash references.
TENANT = "tenant"
# Request parameter of an encoder model (a ``pd`` server on another node asks it): answer the
# stored embedding by value too, with its digest (``python_backends/encode/digest.py``).
BY_VALUE = "by_value"
ENCODER_REQUEST_PARAMETER = "encoder"  # epd: the encoder model a request pins
# epd, measurement only: "stream" reads decode as one BLS stream, the pattern that deadlocks Triton
# 2.51's python backend under load (docs/upstream/python-backend-bls-deadlock.md), to measure what
# the polls cost (bench mode option ``stream-decode``). Refused unless the server's environment
# has ALLOW_STREAMED_DECODE_ENV=1.
DECODE_READS_REQUEST_PARAMETER = "decode_reads"
DECODE_READS = ("poll", "stream")
ALLOW_STREAMED_DECODE_ENV = "TRITON_EPD_ALLOW_STREAMED_DECODE"
# epd of an audio checkpoint, measurement only (the article's audio experiment, bench.audio_forwarding):
# "raw" also sends each clip to prefill, which decodes and re-extracts its features there, as a
# downstream stage does that is not given the structure (the baseline of metadata-only forwarding).
# Refused unless the server's environment has ALLOW_RAW_FORWARDING_ENV=1.
FORWARD_MEDIA_REQUEST_PARAMETER = "forward_media"
FORWARD_MEDIA = ("metadata", "raw")
ALLOW_RAW_FORWARDING_ENV = "TRITON_EPD_ALLOW_RAW_FORWARDING"
EMBEDDING_DIGEST = "embedding_digest"
# preprocess (cpu): the serialized DALI pipeline.
PIPELINE_FILE = "pipeline_file"
DALI_NUM_THREADS = "dali_num_threads"
# vit_encoder (cpu): ONNX Runtime.
ONNX_FILE_KEY = "onnx_file"
INTRA_OP_THREADS = "intra_op_threads"
# vit_encoder (cpu): images encoded at once, each on one ONNX Runtime thread (0: one per CPU of its set).
VIT_THREADS = "vit_threads"
# vit_encoder (cpu): "fp32" (ONNX Runtime, the default) or "bf16" (OpenVINO, on CPUs with bf16 dot products).
VIT_PRECISION = "vit_precision"
VIT_PRECISIONS = ("fp32", "bf16")
# preprocess (cpu): "torchvision" (PIL + torchvision, vLLM's processor bit for bit) or "dali".
IMAGE_BACKEND = "image_backend"
IMAGE_BACKENDS = ("torchvision", "dali")
# vit_encoder (both): the exported encoder's facts, checked at load and shown as metrics.
MERGE_SIZE = "merge_size"  # also vit_positions'
VISION_SHARDS = "vision_shards"
CHECKPOINT_SHARDS = "checkpoint_shards"
VISION_WEIGHT_BYTES = "vision_weight_bytes"
CHECKPOINT_WEIGHT_BYTES = "checkpoint_weight_bytes"
ENCODER_FACTS = (
    PATCH_DIM,
    IMAGE_PATCH_DIM,
    HIDDEN_SIZE,
    MERGE_SIZE,
    VISION_SHARDS,
    CHECKPOINT_SHARDS,
    VISION_WEIGHT_BYTES,
    CHECKPOINT_WEIGHT_BYTES,
)
# vit_encoder (gpu): the TensorRT plan's precision and optimisation profile (shown, not read).
PRECISION = "precision"
PROFILE_MIN_PATCHES = "profile_min_patches"
PROFILE_OPT_PATCHES = "profile_opt_patches"
PROFILE_MAX_PATCHES = "profile_max_patches"
# audio_encoder (gpu): its plan's precision (above) and most clips per call (shown, not read).
PROFILE_MAX_CLIPS = "profile_max_clips"

# Artefact files in a model's version folder.
DALI_FILE = "model.dali"
# The video pipeline (python_backends/preprocess/video_pipeline.py), beside the image one in preprocess/1.
VIDEO_DALI_FILE = "video.dali"
# The audio features pipeline (python_backends/preprocess/audio_pipeline.py), beside audio_encoder's model.onnx.
AUDIO_DALI_FILE = "audio.dali"
ONNX_FILE = "model.onnx"
PLAN_FILE = "model.plan"

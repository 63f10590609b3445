"""Write the Triton model repository for a target (``cpu`` or ``gpu``).

One description per target (:data:`TARGETS`) is the single source of truth: each
model's config.pbtxt is rendered from ``builders/templates/<model>*.pbtxt`` and any
unfilled placeholder fails the build. Tensor lists (the models' interfaces) are written
once, in Python below, and rendered into every template that needs them. The generated
files are git-ignored.

Models per target (names are a contract, DESIGN.md):

- ``llm``: one colocated vLLM engine (both targets).
- ``preprocess``: the one DALI pipeline (``python_backends/dali_pipeline.py``), serialized into
  ``preprocess/1/model.dali``. ``cpu``: run with ``device_id=None`` by a python-backend model;
  ``gpu``: Triton's DALI backend, mixed (nvJPEG) decoder. Dynamic batching over images of
  different sizes (``allow_ragged_batch`` on ``image``); one image per batch row.
- ``vit_encoder``: the vision tower + merger exported from the checkpoint's vision shards only
  (``builders/encoder.py``) to ``vit_encoder/1/model.onnx``. ``cpu``: ONNX Runtime in a
  python-backend model with dynamic batching; ``gpu``: a ``tensorrt_plan`` (``model.plan``,
  built where TensorRT imports) with CUDA graphs.
- ``vit_positions`` (``gpu`` only): the TensorRT graph takes rotary position ids and
  ``cu_seqlens`` as inputs (DESIGN.md, ONNX export recipe); this python model computes them
  from ``image_grid_thw`` (on ``cpu`` the ONNX Runtime model does so itself).
- ``encoder_<i>`` (``CachePolicy.encoders`` of them): encode by reference -- image in, content
  key, store claim (hit / single-flight join / encode through ``encode`` and write the store),
  signed reference out (``python_backends/cached_encoder.py``).
- ``encode``: ensemble ``preprocess -> [vit_positions ->] vit_encoder``; in: ``image`` (uint8,
  the encoded file); out: ``image_embeds`` and ``image_grid_thw`` per image. A request of one
  image has the same wire shapes on both targets (``[1, bytes]`` in, ``[1, tokens, hidden]``
  and ``[1, 3]`` out); the ``cpu`` target also takes several images of one size per request.

Binary artefacts (``model.dali``, ``model.onnx``, ``model.plan``) are built once: a stamp
under ``build/stamps/`` records a digest of everything they depend on (checkpoint files,
preprocessor config, builder sources, library versions), so a rebuild of an up-to-date
repository takes well under a second and a changed input rebuilds only what depends on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import re
import shutil
import string
import struct
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from python_backends.store import DEFAULT_STORE_PATH

LOGGER = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = Path(__file__).resolve().parent / "templates"
DEFAULT_REPOSITORY = REPO_ROOT / "model_repository"
DEFAULT_STAMPS = REPO_ROOT / "build" / "stamps"

DALI_FILE = "model.dali"
ONNX_FILE = "model.onnx"  # == builders.encoder.ONNX_FILE (kept here to avoid importing torch)
PLAN_FILE = "model.plan"
POSITIONS_MODEL_TEMPLATE = "vit_positions_model.py"

Device = Literal["cpu", "gpu"]


class RepositoryBuildError(RuntimeError):
    """The repository cannot be generated as described; the message says what to fix."""


@dataclass(frozen=True)
class EncodeStage:
    """How a target serves the encode path. Only ``device`` differs between targets."""

    device: Device
    # Most images per execute (Triton's dynamic batch) and per DALI run.
    max_batch_size: int = 8
    max_queue_delay_us: int = 1000
    preprocess_instances: int = 1
    encoder_instances: int = 1
    dali_threads: int = 2
    # cpu: ONNX Runtime threads (0: its default) and patches per packed call (vit_onnx.py).
    ort_intra_op_threads: int = 0
    max_patches_per_run: int = 1024
    # gpu: TensorRT plan precision and optimisation profile (builders.encoder.TrtProfile).
    trt_precision: Literal["fp16", "fp32"] = "fp16"
    trt_profile: dict[str, int] = field(
        default_factory=lambda: {"min_patches": 4, "opt_patches": 1024, "max_patches": 8192, "max_images": 8}
    )

    @property
    def models(self) -> tuple[str, ...]:
        middle = ("vit_positions",) if self.device == "gpu" else ()
        return ("preprocess", *middle, "vit_encoder", "encode")


@dataclass(frozen=True)
class CachePolicy:
    """The embedding cache, in one place: every store-using model (``encoder_<i>``, ``epd``,
    ``prefill``, ``decode``) gets these as config parameters.

    Keys always cover the media bytes, the preprocessing config and the encoder version (the
    served encoder file's digest), so a rebuilt encoder or a changed resize setting never
    meets old embeddings. ``scope``: ``node`` -- one key space for every encoder of the node
    (an image encoded by one is a hit for all); ``instance`` -- each encoder model its own
    (the per-instance baseline the shared store is measured against).
    """

    path: str = DEFAULT_STORE_PATH  # the node's store (LMDB on tmpfs)
    capacity_bytes: int = 1 << 30
    eviction: Literal["lru"] = "lru"
    ttl_s: float = 0.0  # 0: entries live until evicted
    scope: Literal["node", "instance"] = "node"
    encoders: int = 2  # encoder models encoder_0 .. encoder_<n-1>
    device: str = "cpu"  # where the bytes live: "cpu" (shared memory) or "cuda:N" (CUDA IPC)

    def __post_init__(self) -> None:
        if self.encoders < 1:
            raise RepositoryBuildError("CachePolicy.encoders must be at least 1")
        if self.scope not in ("node", "instance"):
            raise RepositoryBuildError(f"CachePolicy.scope must be 'node' or 'instance', got {self.scope!r}")

    @property
    def encoder_models(self) -> tuple[str, ...]:
        return tuple(f"encoder_{i}" for i in range(self.encoders))

    def parameters(self) -> dict[str, Any]:
        return {
            "store_path": self.path,
            "store_capacity_bytes": self.capacity_bytes,
            "store_eviction": self.eviction,
            "store_ttl_s": self.ttl_s,
            "store_device": self.device,
            "cache_scope": self.scope,
        }


@dataclass(frozen=True)
class PdStage:
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
    encode: EncodeStage
    pd: PdStage = field(default_factory=PdStage)
    cache: CachePolicy = field(default_factory=CachePolicy)
    # Request limits of the user-facing models (image limits also bind ``preprocess``).
    limits: dict[str, int] = field(
        default_factory=lambda: {
            "max_images": 4,
            "max_image_bytes": 20 << 20,
            "max_image_pixels": 4096 * 4096,
            "max_tokens_limit": 2048,
        }
    )

    @property
    def models(self) -> tuple[str, ...]:
        return ("llm", *self.encode.models, "ensemble", *self.cache.encoder_models, *PD_MODELS)


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
        encode=EncodeStage(device="cpu", max_queue_delay_us=0),
        # llm keeps vLLM's default binding (core 0 on 2 cores); prefill gets core 1 and
        # decode core 0, so the two halves of one request run on different cores.
        pd=PdStage(
            role_env={
                "prefill": {"VLLM_CPU_OMP_THREADS_BIND": "1"},
                "decode": {"VLLM_CPU_OMP_THREADS_BIND": "0"},
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
        encode=EncodeStage(device="gpu"),
        # The encoder's TensorRT output stays on the GPU: one device copy into the store.
        cache=CachePolicy(device="cuda:0"),
    ),
}

# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"\$\{?\w+\}?")


def render_template(template_name: str, values: dict[str, str], templates: Path = TEMPLATES) -> str:
    """Fill ``${name}`` placeholders; a missing value or a leftover one is an error."""
    text = (templates / template_name).read_text()
    try:
        rendered = string.Template(text).substitute(values)
    except KeyError as exc:
        raise ValueError(f"{template_name}: no value for placeholder {exc}") from None
    leftover = _PLACEHOLDER.findall(rendered)
    if leftover:
        raise ValueError(f"{template_name}: unfilled placeholders {leftover}")
    return rendered


def render_parameters(parameters: dict[str, Any]) -> str:
    entries = [
        f'  {{ key: "{key}" value: {{ string_value: {json.dumps(str(value))} }} }}'
        for key, value in sorted(parameters.items())
    ]
    return ",\n".join(entries)


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a model config (dims without the batch dimension)."""

    name: str
    data_type: str
    dims: tuple[int, ...]
    ragged: bool = False
    # What the backend sees instead of ``dims`` (Triton's ``reshape``), if anything.
    reshape: tuple[int, ...] | None = None
    optional: bool = False

    def render(self) -> str:
        def shape(dims: Sequence[int]) -> str:
            return "[ " + ", ".join(str(d) for d in dims) + " ]" if dims else "[ ]"

        text = f'  {{ name: "{self.name}" data_type: {self.data_type} dims: {shape(self.dims)}'
        if self.reshape is not None:
            text += f" reshape: {{ shape: {shape(self.reshape)} }}"
        if self.ragged:
            text += " allow_ragged_batch: true"
        if self.optional:
            text += " optional: true"
        return text + " }"


def render_tensors(tensors: Iterable[TensorSpec]) -> str:
    return ",\n".join(t.render() for t in tensors)


@dataclass(frozen=True)
class EnsembleStep:
    model: str
    inputs: dict[str, str]  # the model's input name -> ensemble tensor
    outputs: dict[str, str]  # the model's output name -> ensemble tensor

    def render(self) -> str:
        maps = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in self.inputs.items()]
        maps += [f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in self.outputs.items()]
        body = "\n".join(f"      {m}" for m in maps)
        return f'    {{\n      model_name: "{self.model}"\n      model_version: -1\n{body}\n    }}'


# ---------------------------------------------------------------------------------------------
# What the configs need from the built encoder
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EncoderFacts:
    """Shapes and provenance of the exported vision encoder (kept in its build stamp)."""

    patch_dim: int
    hidden_size: int
    merge_size: int
    vision_shards: int  # shard files the export read
    checkpoint_shards: int  # shard files in the checkpoint
    vision_weight_bytes: int
    checkpoint_weight_bytes: int

    @classmethod
    def from_report(cls, report: dict[str, Any]) -> EncoderFacts:
        return cls(**{name: int(report[name]) for name in cls.__dataclass_fields__})


# The interface of the encode models, written once.
def image_input() -> TensorSpec:
    # The encoded file's bytes, one image per batch row; rows of different requests differ in
    # length, hence ragged (the DALI backend's input convention).
    return TensorSpec("image", "TYPE_UINT8", (-1,), ragged=True)


def pixel_outputs(patch_dim: int) -> list[TensorSpec]:
    return [
        TensorSpec("pixel_values", "TYPE_FP32", (-1, patch_dim)),
        TensorSpec("image_grid_thw", "TYPE_INT64", (3,)),
    ]


def embeds_output(hidden_size: int) -> TensorSpec:
    return TensorSpec("image_embeds", "TYPE_FP32", (-1, hidden_size))


# The user-facing interface (``llm``, ``ensemble``), written once. Non-batching models.
def generate_outputs() -> list[TensorSpec]:
    return [
        TensorSpec("text_output", "TYPE_STRING", (-1,)),
        TensorSpec("output_token_ids", "TYPE_INT64", (-1,)),
        TensorSpec("num_input_tokens", "TYPE_UINT32", (1,)),
        TensorSpec("num_output_tokens", "TYPE_UINT32", (1,)),
        TensorSpec("finish_reason", "TYPE_STRING", (1,)),
    ]


def generate_options() -> list[TensorSpec]:
    return [
        TensorSpec("stream", "TYPE_BOOL", (1,), optional=True),
        TensorSpec("sampling_parameters", "TYPE_STRING", (1,), optional=True),
        TensorSpec("exclude_input_in_output", "TYPE_BOOL", (1,), optional=True),
    ]


def llm_inputs(hidden_size: int) -> list[TensorSpec]:
    """``image`` (encoded files) or, instead, embeddings by value: ``image_embeds``
    [n, tokens, hidden] (``encode``'s output as it is; leading dims are flattened, images
    concatenated along tokens) with ``image_grid_thw`` [images, 3]."""
    return [
        TensorSpec("text_input", "TYPE_STRING", (1,)),
        TensorSpec("image", "TYPE_STRING", (-1,), optional=True),
        TensorSpec("image_embeds", "TYPE_FP32", (-1, -1, hidden_size), optional=True),
        TensorSpec("image_grid_thw", "TYPE_INT64", (-1, 3), optional=True),
        *generate_options(),
    ]


# ---------------------------------------------------------------------------------------------
# Model files
# ---------------------------------------------------------------------------------------------


def llm_files(target: Target, model_dir: Path, facts: EncoderFacts) -> dict[str, str]:
    # Embeddings by value (``ensemble``, or a client that ran ``encode``) are checked against
    # the exported encoder's output: hidden size and merge size come from its facts.
    embeds = {"image_embeds_hidden_size": facts.hidden_size, "spatial_merge_size": facts.merge_size}
    config = render_template(
        "llm.pbtxt",
        {
            "target": target.name,
            "instance_kind": target.instance_kind,
            "inputs": render_tensors(llm_inputs(facts.hidden_size)),
            "outputs": render_tensors(generate_outputs()),
            "parameters": render_parameters({**target.limits, **target.vllm_env, **embeds}),
        },
    )
    engine_args = {"model": str(model_dir.resolve()), **target.engine_args, "enable_mm_embeds": True}
    return {
        "llm/config.pbtxt": config,
        "llm/1/engine_args.json": json.dumps(engine_args, indent=2, sort_keys=True) + "\n",
    }


def preprocess_files(target: Target, model_dir: Path, facts: EncoderFacts) -> dict[str, str]:
    stage = target.encode
    values = {
        "target": target.name,
        "max_batch_size": str(stage.max_batch_size),
        "max_queue_delay_us": str(stage.max_queue_delay_us),
        "inputs": render_tensors([image_input()]),
        "outputs": render_tensors(pixel_outputs(facts.patch_dim)),
        "instances": str(stage.preprocess_instances),
    }
    if stage.device == "gpu":
        return {"preprocess/config.pbtxt": render_template("preprocess_dali.pbtxt", values)}
    parameters = {
        "pipeline_file": DALI_FILE,
        "preprocessor_config": str((model_dir / "preprocessor_config.json").resolve()),
        "dali_num_threads": stage.dali_threads,
        "max_image_bytes": target.limits["max_image_bytes"],
        "max_image_pixels": target.limits["max_image_pixels"],
    }
    values["parameters"] = render_parameters(parameters)
    return {"preprocess/config.pbtxt": render_template("preprocess_python.pbtxt", values)}


def vit_encoder_files(target: Target, facts: EncoderFacts) -> dict[str, str]:
    stage = target.encode
    if stage.device == "gpu":
        return {"vit_encoder/config.pbtxt": tensorrt_config(target, facts)}
    parameters = {
        "onnx_file": ONNX_FILE,
        "intra_op_threads": stage.ort_intra_op_threads,
        "max_patches_per_run": stage.max_patches_per_run,
        # Checked against the ONNX file's metadata at load, and shown as metrics.
        **{name: value for name, value in asdict(facts).items()},
    }
    config = render_template(
        "vit_encoder_onnxruntime.pbtxt",
        {
            "target": target.name,
            "max_batch_size": str(stage.max_batch_size),
            "max_queue_delay_us": str(stage.max_queue_delay_us),
            "inputs": render_tensors(
                [
                    TensorSpec("pixel_values", "TYPE_FP32", (-1, facts.patch_dim), ragged=True),
                    TensorSpec("image_grid_thw", "TYPE_INT64", (3,)),
                ]
            ),
            "outputs": render_tensors([embeds_output(facts.hidden_size)]),
            "instances": str(stage.encoder_instances),
            "parameters": render_parameters(parameters),
        },
    )
    return {"vit_encoder/config.pbtxt": config}


# gpu: the tensorrt_plan takes one image per request (max_batch_size 0, rows = patches); its
# pixel_values and image_embeds carry a leading 1 on the wire, so that ``encode`` has the cpu
# target's shapes, and Triton reshapes them to the engine's [patches, ...].
_ONE_IMAGE_RESHAPED = ("pixel_values", "image_embeds")


def tensorrt_config(target: Target, facts: EncoderFacts) -> str:
    """``vit_encoder`` on the gpu target: builders.encoder's description, rendered here."""
    from builders.encoder import TrtProfile, tensorrt_plan_config  # noqa: PLC0415 (imports torch)

    stage = target.encode
    description = tensorrt_plan_config(
        facts.patch_dim,
        facts.hidden_size,
        profile=TrtProfile(**stage.trt_profile),
        instance_count=stage.encoder_instances,
    )

    def spec(entry: dict[str, Any]) -> TensorSpec:
        dims = tuple(entry["dims"])
        if entry["name"] in _ONE_IMAGE_RESHAPED:
            return TensorSpec(entry["name"], entry["data_type"], (1, *dims), reshape=dims)
        return TensorSpec(entry["name"], entry["data_type"], dims)

    def graph_spec(shapes: dict[str, list[int]]) -> str:
        lines = []
        for name, dims in shapes.items():
            wire = [1, *dims] if name in _ONE_IMAGE_RESHAPED else list(dims)
            lines.append(f'        input {{ key: "{name}" value {{ dim: [ {", ".join(str(d) for d in wire)} ] }} }}')
        return "      {\n" + "\n".join(lines) + "\n      }"

    cuda = description["optimization"]["cuda"]
    return render_template(
        "vit_encoder_tensorrt.pbtxt",
        {
            "target": target.name,
            "name": description["name"],
            "platform": description["platform"],
            "max_batch_size": str(description["max_batch_size"]),
            "inputs": render_tensors(spec(e) for e in description["input"]),
            "outputs": render_tensors(spec(e) for e in description["output"]),
            "instance_group": ",\n".join(
                f'  {{ count: {g["count"]} kind: {g["kind"]} }}' for g in description["instance_group"]
            ),
            "cuda_graphs": str(cuda["graphs"]).lower(),
            "graph_spec": ",\n".join(graph_spec(s["input"]) for s in cuda["graph_spec"]),
            "parameters": render_parameters(
                {**description["parameters"], "precision": stage.trt_precision, **asdict(facts)}
            ),
        },
    )


def vit_positions_files(target: Target, facts: EncoderFacts) -> dict[str, str]:
    config = render_template(
        "vit_positions.pbtxt",
        {
            "target": target.name,
            "inputs": render_tensors([TensorSpec("image_grid_thw", "TYPE_INT64", (-1, 3))]),
            "outputs": render_tensors(
                [TensorSpec("rotary_pos_ids", "TYPE_INT64", (-1, 2)), TensorSpec("cu_seqlens", "TYPE_INT64", (-1,))]
            ),
            "parameters": render_parameters({"merge_size": facts.merge_size}),
        },
    )
    model_py = (TEMPLATES / POSITIONS_MODEL_TEMPLATE).read_text()
    return {"vit_positions/config.pbtxt": config, "vit_positions/1/model.py": model_py}


def encode_steps(target: Target) -> list[EnsembleStep]:
    """``image`` -> ``image_embeds`` + ``image_grid_thw``: the steps of ``encode`` (and the head
    of ``ensemble``)."""
    grid = {"image_grid_thw": "image_grid_thw"}
    preprocess = EnsembleStep("preprocess", {"image": "image"}, {"pixel_values": "pixel_values", **grid})
    if target.encode.device == "gpu":
        positions = EnsembleStep(
            "vit_positions", grid, {"rotary_pos_ids": "rotary_pos_ids", "cu_seqlens": "cu_seqlens"}
        )
        encoder = EnsembleStep(
            "vit_encoder",
            {"pixel_values": "pixel_values", "rotary_pos_ids": "rotary_pos_ids", "cu_seqlens": "cu_seqlens"},
            {"image_embeds": "image_embeds"},
        )
        return [preprocess, positions, encoder]
    encoder = EnsembleStep("vit_encoder", {"pixel_values": "pixel_values", **grid}, {"image_embeds": "image_embeds"})
    return [preprocess, encoder]


def encode_files(target: Target, facts: EncoderFacts) -> dict[str, str]:
    stage = target.encode
    steps = encode_steps(target)
    if stage.device == "gpu":
        # The plan runs one image per request (max_batch_size 0): the batch row is explicit.
        max_batch_size = 0
        inputs = [TensorSpec("image", "TYPE_UINT8", (1, -1))]
        outputs = [
            TensorSpec("image_embeds", "TYPE_FP32", (1, -1, facts.hidden_size)),
            TensorSpec("image_grid_thw", "TYPE_INT64", (1, 3)),
        ]
    else:
        max_batch_size = stage.max_batch_size
        inputs = [TensorSpec("image", "TYPE_UINT8", (-1,))]
        outputs = [embeds_output(facts.hidden_size), TensorSpec("image_grid_thw", "TYPE_INT64", (3,))]
    config = render_template(
        "encode.pbtxt",
        {
            "target": target.name,
            "max_batch_size": str(max_batch_size),
            "inputs": render_tensors(inputs),
            "outputs": render_tensors(outputs),
            "steps": ",\n".join(step.render() for step in steps),
        },
    )
    return {"encode/config.pbtxt": config}


def ensemble_files(target: Target, facts: EncoderFacts) -> dict[str, str]:
    """``ensemble``: encode's steps -> ``llm`` with the embeddings by value, one static DAG.

    Exactly one image per request (``image``: UINT8 [1, bytes], as ``encode`` takes it): a
    static DAG runs each step once and cannot loop over images or skip the encoder, so 0 or
    several images are refused by Triton's shape check (use ``llm`` or ``epd`` for those).
    Decoupled streaming passes through: ``llm``'s responses are the ensemble's.
    """
    del facts  # the llm step's own config carries the hidden size
    options = {spec.name: spec.name for spec in generate_options()}
    embeds = {"image_embeds": "image_embeds", "image_grid_thw": "image_grid_thw"}
    llm = EnsembleStep(
        "llm",
        {"text_input": "text_input", **embeds, **options},
        {spec.name: spec.name for spec in generate_outputs()},
    )
    inputs = [
        TensorSpec("text_input", "TYPE_STRING", (1,)),
        TensorSpec("image", "TYPE_UINT8", (1, -1)),
        *generate_options(),
    ]
    config = render_template(
        "ensemble.pbtxt",
        {
            "target": target.name,
            "inputs": render_tensors(inputs),
            "outputs": render_tensors(generate_outputs()),
            "steps": ",\n".join(step.render() for step in [*encode_steps(target), llm]),
        },
    )
    return {"ensemble/config.pbtxt": config}


# ``prefill``, ``decode`` (vLLM KV producer / consumer) and ``epd`` (BLS): python models whose
# model.py is kept in model_repository/<name>/1/ (hand-written, thin); config.pbtxt and the
# engine args are generated here.
PD_MODELS = ("prefill", "decode", "epd")


def _stage_error_specs() -> tuple[TensorSpec, TensorSpec]:
    """Input and output of stages that ``epd`` calls over BLS: errors as an output on request
    (why: ``python_backends/triton_edge.py``, ERROR_OUTPUT)."""
    return (
        TensorSpec("errors_as_outputs", "TYPE_BOOL", (1,), optional=True),
        TensorSpec("error", "TYPE_STRING", (1,)),
    )


def _reference_inputs() -> list[TensorSpec]:
    # One signed reference (<= 1 KB JSON) per image; never media.
    return [TensorSpec("references", "TYPE_STRING", (-1,), optional=True)]


def _store_parameters(target: Target, facts: EncoderFacts) -> dict[str, Any]:
    return {**target.cache.parameters(), "spatial_merge_size": facts.merge_size}


def _key_parameters(target: Target, model_dir: Path) -> dict[str, Any]:
    """What content keys cover besides the media (read by ``epd`` and the encoders alike)."""
    encoder_file = PLAN_FILE if target.encode.device == "gpu" else ONNX_FILE
    return {
        "preprocessor_config": str((model_dir / "preprocessor_config.json").resolve()),
        # Relative to the model repository: its digest is the encoder version in content keys.
        "encoder_file": f"vit_encoder/1/{encoder_file}",
    }


ENCODER_MODEL_TEMPLATE = "encoder_model.py"


def encoder_files(target: Target, model_dir: Path, facts: EncoderFacts) -> dict[str, str]:
    """``encoder_<i>``: media in, store write, references out (one model per encoder)."""
    model_py = (TEMPLATES / ENCODER_MODEL_TEMPLATE).read_text()
    inputs = [
        TensorSpec("image", "TYPE_STRING", (-1,)),
        # The pid of the process the leases are for (``epd``); absent: no lease (warm-up).
        TensorSpec("lease_owner", "TYPE_INT64", (1,), optional=True),
        _stage_error_specs()[0],
    ]
    outputs = [
        TensorSpec("references", "TYPE_STRING", (-1,)),
        TensorSpec("mm_hash", "TYPE_STRING", (-1,)),
        TensorSpec("cache_hit", "TYPE_BOOL", (-1,)),
        _stage_error_specs()[1],
    ]
    parameters = {
        **_store_parameters(target, facts),
        **_key_parameters(target, model_dir),
        "encode_model": "encode",
        "max_image_bytes": target.limits["max_image_bytes"],
    }
    files: dict[str, str] = {}
    for name in target.cache.encoder_models:
        files[f"{name}/config.pbtxt"] = _python_model_config(target, name, inputs, outputs, parameters)
        files[f"{name}/1/model.py"] = model_py
    return files


def _python_model_config(target: Target, name: str, inputs: list[TensorSpec], outputs: list[TensorSpec], parameters: dict[str, Any]) -> str:
    return render_template(
        "python_decoupled.pbtxt",
        {
            "target": target.name,
            "name": name,
            "instance_kind": target.instance_kind,
            "inputs": render_tensors(inputs),
            "outputs": render_tensors(outputs),
            "parameters": render_parameters(parameters),
        },
    )


def pd_files(target: Target, model_dir: Path, facts: EncoderFacts) -> dict[str, str]:
    """``prefill``, ``decode`` and ``epd`` configs plus the two engines' args."""
    from python_backends.pd.engines import pd_engine_args  # noqa: PLC0415 (light: no vLLM import)

    base = {"model": str(model_dir.resolve()), **target.engine_args}
    store = _store_parameters(target, facts)
    limit = {"max_tokens_limit": target.limits["max_tokens_limit"]}
    files: dict[str, str] = {}
    stage_outputs = {
        "prefill": [
            TensorSpec("output_token_ids", "TYPE_INT64", (-1,)),
            TensorSpec("text_output", "TYPE_STRING", (-1,)),
            TensorSpec("num_input_tokens", "TYPE_UINT32", (1,)),
            TensorSpec("finish_reason", "TYPE_STRING", (1,)),
            TensorSpec("transfer_params", "TYPE_STRING", (1,)),
        ],
        "decode": generate_outputs(),
    }
    stage_inputs = {
        "prefill": [
            TensorSpec("text_input", "TYPE_STRING", (1,)),
            *_reference_inputs(),
            TensorSpec("sampling_parameters", "TYPE_STRING", (1,), optional=True),
        ],
        "decode": [
            *_reference_inputs(),
            TensorSpec("transfer_params", "TYPE_STRING", (1,), optional=True),
            TensorSpec("sampling_parameters", "TYPE_STRING", (1,), optional=True),
            TensorSpec("stream", "TYPE_BOOL", (1,), optional=True),
            TensorSpec("request_id", "TYPE_STRING", (1,), optional=True),
            TensorSpec("abort", "TYPE_BOOL", (1,), optional=True),
        ],
    }
    error_input, error_output = _stage_error_specs()
    for role in ("prefill", "decode"):
        env = {**target.vllm_env, **target.pd.role_env.get(role, {})}
        files[f"{role}/config.pbtxt"] = _python_model_config(
            target,
            role,
            [*stage_inputs[role], error_input],
            [*stage_outputs[role], error_output],
            {**limit, **env, **store},
        )
        args = pd_engine_args(base, role, target.pd.kv_store_path)  # type: ignore[arg-type]
        files[f"{role}/1/engine_args.json"] = json.dumps(args, indent=2, sort_keys=True) + "\n"
    timings = [TensorSpec(f"timing_{stage}_ms", "TYPE_FP32", (1,)) for stage in ("hash", "lookup", "encode", "prefill", "decode")]
    files["epd/config.pbtxt"] = _python_model_config(
        target,
        "epd",
        [
            TensorSpec("text_input", "TYPE_STRING", (1,)),
            TensorSpec("image", "TYPE_STRING", (-1,), optional=True),
            *generate_options(),
        ],
        [*generate_outputs(), *timings, TensorSpec("cache_hits", "TYPE_UINT32", (1,))],
        {
            **target.limits,
            **store,
            **_key_parameters(target, model_dir),
            "encoder_models": ",".join(target.cache.encoder_models),
            "prefill_model": "prefill",
            "decode_model": "decode",
        },
    )
    return files


def repository_files(target: Target, model_dir: Path, facts: EncoderFacts) -> dict[str, str]:
    """Relative path -> content of every generated text file for ``target``."""
    files = llm_files(target, model_dir, facts)
    files.update(preprocess_files(target, model_dir, facts))
    if "vit_positions" in target.models:
        files.update(vit_positions_files(target, facts))
    files.update(vit_encoder_files(target, facts))
    files.update(encode_files(target, facts))
    files.update(ensemble_files(target, facts))
    files.update(encoder_files(target, model_dir, facts))
    files.update(pd_files(target, model_dir, facts))
    return files


# ---------------------------------------------------------------------------------------------
# Binary artefacts, built once (stamps)
# ---------------------------------------------------------------------------------------------


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _source_digest(*relative: str) -> str:
    return _digest({name: _file_sha256(REPO_ROOT / name) for name in relative})


def ensure_artifact(
    version_dir: Path,
    kind: str,
    inputs: dict[str, Any],
    build: Callable[[Path], dict[str, Any]],
    stamp_dir: Path = DEFAULT_STAMPS,
) -> tuple[dict[str, Any], bool]:
    """Run ``build(scratch_dir)`` and move what it wrote into ``version_dir``, unless the stamp
    of ``version_dir``/``kind`` says the same ``inputs`` built the files that are there now.

    Returns (the build's report, whether it built). A file changed or removed since its build
    (size or mtime differ) makes the artefact stale too.
    """
    version_dir = Path(version_dir).resolve()
    digest = _digest(inputs)
    stamp_path = stamp_dir / f"{kind}-{hashlib.sha1(str(version_dir).encode()).hexdigest()[:16]}.json"
    stamp = json.loads(stamp_path.read_text()) if stamp_path.is_file() else None
    if stamp and stamp.get("inputs") == digest and _files_unchanged(version_dir, stamp.get("files", {})):
        return stamp["report"], False
    stamp_dir.mkdir(parents=True, exist_ok=True)
    version_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=stamp_dir, prefix=f"{kind}-") as scratch:
        report = build(Path(scratch))
        produced = sorted(p for p in Path(scratch).iterdir() if p.is_file())
        if not produced:
            raise RepositoryBuildError(f"building {kind} for {version_dir} wrote no file")
        for path in produced:
            shutil.move(str(path), str(version_dir / path.name))
    files = {p.name: _file_state(version_dir / p.name) for p in produced}
    stamp_path.write_text(json.dumps({"inputs": digest, "files": files, "report": report}, indent=2) + "\n")
    return report, True


def _file_state(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def _files_unchanged(version_dir: Path, files: dict[str, list[int]]) -> bool:
    return bool(files) and all(
        (version_dir / name).is_file() and _file_state(version_dir / name) == state for name, state in files.items()
    )


def safetensors_tensor_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file, from its header alone."""
    with path.open("rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_len))
    return sum(end - begin for key, entry in header.items() if key != "__metadata__" for begin, end in [entry["data_offsets"]])


def checkpoint_fingerprint(model_dir: Path) -> dict[str, Any]:
    """What the exported encoder depends on in a checkpoint, without reading weights."""
    small = {
        name: _file_sha256(model_dir / name)
        for name in ("config.json", "preprocessor_config.json", "model.safetensors.index.json")
        if (model_dir / name).is_file()
    }
    shards = {p.name: _file_state(p) for p in sorted(model_dir.glob("*.safetensors"))}
    return {"files": small, "shards": shards}


def build_dali_artifact(
    target: Target, model_dir: Path, version_dir: Path, stamp_dir: Path = DEFAULT_STAMPS
) -> tuple[dict[str, Any], bool]:
    from python_backends.dali_pipeline import ImageTransformConfig, write_pipeline  # noqa: PLC0415

    stage = target.encode
    config = ImageTransformConfig.from_file(model_dir)
    inputs = {
        "transform": asdict(config),
        "device": stage.device,
        "max_batch_size": stage.max_batch_size,
        "dali": _version("nvidia-dali-cuda120"),
        "source": _source_digest("python_backends/dali_pipeline.py"),
    }

    def build(scratch: Path) -> dict[str, Any]:
        path = write_pipeline(scratch / DALI_FILE, config, stage.device, stage.max_batch_size)
        LOGGER.info("serialized the DALI pipeline for %s (%d bytes)", stage.device, path.stat().st_size)
        return {"device": stage.device, "bytes": path.stat().st_size, "patch_dim": config.patch_dim}

    return ensure_artifact(version_dir, "dali", inputs, build, stamp_dir)


def build_onnx_artifact(
    model_dir: Path, version_dir: Path, stamp_dir: Path = DEFAULT_STAMPS
) -> tuple[EncoderFacts, dict[str, Any], bool]:
    inputs = {
        "checkpoint": checkpoint_fingerprint(model_dir),
        "source": _source_digest("builders/encoder.py", "python_backends/vit_onnx.py"),
        "versions": {p: _version(p) for p in ("torch", "onnx", "onnxscript", "transformers", "onnxruntime")},
    }

    def build(scratch: Path) -> dict[str, Any]:
        from python_backends.dali_pipeline import ImageTransformConfig  # noqa: PLC0415
        from builders.encoder import (  # noqa: PLC0415 (torch, transformers)
            export_onnx,
            load_vision_tower,
            load_vision_weights,
            tower_dims,
            validate_onnx,
            vision_shard_plan,
        )

        weights = load_vision_weights(model_dir)
        tower = load_vision_tower(model_dir, weights)
        dims = tower_dims(tower)
        transform_patch_dim = ImageTransformConfig.from_file(model_dir).patch_dim
        if dims["patch_dim"] != transform_patch_dim:
            raise RepositoryBuildError(
                f"{model_dir}: the vision config gives {dims['patch_dim']} values per patch, "
                f"preprocessor_config.json {transform_patch_dim}; the checkpoint is inconsistent"
            )
        path = export_onnx(tower, scratch)
        parity = validate_onnx(path, tower)
        if not parity.ok:
            raise RepositoryBuildError(
                f"ONNX Runtime differs from torch by {parity.worst:.2e} (> {parity.tolerance:.0e}) on {model_dir}"
            )
        _, total = vision_shard_plan(model_dir)
        shard_files = sorted({p.name for p in model_dir.glob("*.safetensors")})
        facts = EncoderFacts(
            patch_dim=dims["patch_dim"],
            hidden_size=dims["hidden_size"],
            merge_size=dims["merge_size"],
            vision_shards=len(weights.shard_files_read),
            checkpoint_shards=total,
            vision_weight_bytes=sum(t.numel() * t.element_size() for t in weights.tensors.values()),
            checkpoint_weight_bytes=sum(safetensors_tensor_bytes(model_dir / name) for name in shard_files),
        )
        LOGGER.info(
            "exported the vision encoder: %d of %d shard files read (%s) in %.2f s, "
            "%.1f MB of %.1f MB weights; ONNX Runtime vs torch max-abs %.1e over %d grid batches",
            facts.vision_shards, facts.checkpoint_shards, ", ".join(weights.shard_files_read), weights.seconds,
            facts.vision_weight_bytes / 1e6, facts.checkpoint_weight_bytes / 1e6, parity.worst, len(parity.grids),
        )
        return {
            **asdict(facts),
            "shard_files_read": list(weights.shard_files_read),
            "vision_load_seconds": weights.seconds,
            "parity_max_abs": parity.worst,
        }

    report, built = ensure_artifact(version_dir, "onnx", inputs, build, stamp_dir)
    return EncoderFacts.from_report(report), report, built


def build_plan_artifact(
    target: Target, facts: EncoderFacts, version_dir: Path, onnx_report: dict[str, Any], stamp_dir: Path = DEFAULT_STAMPS
) -> bool:
    """TensorRT plan where TensorRT imports (the NGC image); elsewhere a warning, no plan."""
    from builders.encoder import TrtProfile, build_tensorrt_plan, tensorrt_unavailable_reason  # noqa: PLC0415

    reason = tensorrt_unavailable_reason()
    if reason:
        LOGGER.warning(
            "vit_encoder/1/%s not built: %s. Run `python -m builders.repository --target gpu` there; "
            "Triton cannot load vit_encoder (and encode) until then.", PLAN_FILE, reason,
        )
        return False
    stage = target.encode
    profile = TrtProfile(**stage.trt_profile)
    onnx_path = Path(version_dir) / ONNX_FILE
    inputs = {
        "onnx": _file_sha256(onnx_path),
        "precision": stage.trt_precision,
        "profile": stage.trt_profile,
        "tensorrt": _version("tensorrt"),
        "source": _source_digest("builders/encoder.py"),
    }

    def build(scratch: Path) -> dict[str, Any]:
        build_tensorrt_plan(onnx_path, scratch / PLAN_FILE, facts.patch_dim, profile, stage.trt_precision)
        return {"precision": stage.trt_precision, "profile": stage.trt_profile, "onnx_parity": onnx_report.get("parity_max_abs")}

    _, built = ensure_artifact(version_dir, "plan", inputs, build, stamp_dir)
    return built


# ---------------------------------------------------------------------------------------------
# The repository
# ---------------------------------------------------------------------------------------------


def _prune_other_targets(target: Target, out: Path) -> list[Path]:
    """Remove generated files of models that only another target has (e.g. gpu's
    ``vit_positions`` when the cpu repository is written over a gpu one)."""
    removed = []
    encoders = {p.name for p in out.glob("encoder_*") if re.fullmatch(r"encoder_\d+", p.name)}
    others = ({m for t in TARGETS.values() for m in t.models} | encoders) - set(target.models)
    for model in sorted(others):
        model_dir = out / model
        candidates = [model_dir / "config.pbtxt", model_dir / "1" / "model.py"]
        for path in candidates:
            if path.is_file():
                path.unlink()
                removed.append(path)
        for folder in (model_dir / "1" / "__pycache__", model_dir / "1", model_dir):
            if folder.is_dir() and folder.name == "__pycache__":
                shutil.rmtree(folder)
            elif folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
    return removed


def write_repository(
    target_name: str,
    model_dir: Path,
    out: Path = DEFAULT_REPOSITORY,
    stamp_dir: Path = DEFAULT_STAMPS,
    cache: CachePolicy | None = None,
    kv_store_path: str | None = None,
) -> list[Path]:
    """Build the artefacts (once) and write every generated file; returns the paths written.
    ``cache`` replaces the target's cache policy (e.g. per-instance caches for a benchmark),
    ``kv_store_path`` its PD KV transfer folder (e.g. one per test server)."""
    if target_name not in TARGETS:
        raise ValueError(f"unknown target {target_name!r}; choose one of {sorted(TARGETS)}")
    target = TARGETS[target_name]
    if cache is not None:
        target = dataclasses.replace(target, cache=cache)
    if kv_store_path is not None:
        target = dataclasses.replace(target, pd=dataclasses.replace(target.pd, kv_store_path=kv_store_path))
    model_dir = Path(model_dir).resolve()
    out = Path(out)
    _prune_other_targets(target, out)

    _, dali_built = build_dali_artifact(target, model_dir, out / "preprocess" / "1", stamp_dir)
    facts, onnx_report, onnx_built = build_onnx_artifact(model_dir, out / "vit_encoder" / "1", stamp_dir)
    LOGGER.info(
        "%s: %s; %s", target.name,
        f"{DALI_FILE} " + ("built" if dali_built else "up to date"),
        f"{ONNX_FILE} " + ("built" if onnx_built else "up to date"),
    )
    if target.encode.device == "gpu":
        build_plan_artifact(target, facts, out / "vit_encoder" / "1", onnx_report, stamp_dir)

    written = [out / "preprocess" / "1" / DALI_FILE, out / "vit_encoder" / "1" / ONNX_FILE]
    for model in target.models:  # an ensemble needs its (empty) version folder too
        (out / model / "1").mkdir(parents=True, exist_ok=True)
    for relative, content in repository_files(target, model_dir, facts).items():
        path = out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != content:
            path.write_text(content)
        written.append(path)
    return written


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=sorted(TARGETS), default="cpu")
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--out", type=Path, default=DEFAULT_REPOSITORY)
    add_cache_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("onnx_ir").setLevel(logging.WARNING)  # one line per folded constant
    for path in write_repository(args.target, args.model, args.out, cache=cache_policy_from(args, args.target)):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

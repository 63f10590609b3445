"""The encode side's generated files: ``preprocess``, ``vit_encoder``, ``vit_positions`` (gpu),
the ``encode`` ensemble and the ``ensemble`` (encode's steps -> ``llm``), per target.

- ``preprocess``: ``cpu``: a python-backend model running PIL + torchvision (vLLM's processor
  bit for bit; ``python_backends/preprocess/torch_images.py``) or, with ``image_backend``
  ``dali``, the serialized DALI pipeline with ``device_id=None``, not batched: one request's
  0..N images at once, rows concatenated; ``gpu``: Triton's DALI backend with the mixed (nvJPEG)
  decoder, the same pipeline (``python_backends/preprocess/image_pipeline.py``), dynamically
  batched, one image per batch row. Images go out folded (one temporal copy per patch row,
  ``image_patch_dim`` wide).
- ``vit_encoder``: the vision tower + merger exported from the checkpoint's vision shards only
  (``builders/encoder.py``) to ``vit_encoder/1/model.onnx``, one image per graph call. ``cpu``:
  ONNX Runtime in a python-backend model, one request's images side by side (not batched);
  ``gpu``: a ``tensorrt_plan`` (``model.plan``, built where TensorRT imports) with CUDA graphs
  (``builders/tensorrt_config.py``), one image per request.
- ``vit_positions`` (``gpu`` only): the image's rotary position ids for the plan, from its grid
  (on ``cpu`` the ONNX Runtime model computes them itself).
- ``encode``: ensemble ``preprocess -> [vit_positions ->] vit_encoder``: images in (cpu: 0..N,
  gpu: one), embeddings and grid out, by value.
- ``ensemble``: encode's steps -> ``llm`` with the embeddings by value, one static DAG (cpu: 0
  to ``max_images`` images per request; gpu: one).
"""

from __future__ import annotations

from pathlib import Path

from builders.checkpoint import EncoderFacts
from builders.pbtxt import TEMPLATES, EnsembleStep, render_parameters, render_steps, render_template, render_tensors
from builders.targets import ENCODE_ROLE, Target
from builders.tensorrt_config import tensorrt_config
from python_backends import contract

POSITIONS_MODEL_TEMPLATE = "vit_positions_model.py"


def preprocessor_config_path(model_dir: Path) -> str:
    return str((model_dir / "preprocessor_config.json").resolve())


def encode_gpu(target: Target) -> int:
    """The GPU of the encode side (DALI, TensorRT, the store) in the target's budget."""
    return target.gpu_budget.device_of[ENCODE_ROLE] if target.gpu_budget is not None else 0


def preprocess_files(target: Target, model_dir: Path, facts: EncoderFacts) -> dict[str, str]:
    serving = target.encode
    if serving.device == "gpu":
        # Triton's DALI backend: dynamically batched, one image per batch row.
        interface = contract.PREPROCESS_DALI.sized(facts.parameters())
        values = {
            "target": target.name,
            "max_batch_size": str(serving.max_batch_size),
            "max_queue_delay_us": str(serving.max_queue_delay_us),
            "inputs": render_tensors(interface.inputs),
            "outputs": render_tensors(interface.outputs),
            "instances": str(serving.preprocess_instances),
            "gpu": str(encode_gpu(target)),
        }
        return {"preprocess/config.pbtxt": render_template("preprocess_dali.pbtxt", values)}
    # cpu: the python model, one request's images at once (not batched).
    interface = contract.PREPROCESS.sized(facts.parameters())
    parameters = {
        contract.IMAGE_BACKEND: serving.image_backend,
        contract.PIPELINE_FILE: contract.DALI_FILE,
        contract.PREPROCESSOR_CONFIG: preprocessor_config_path(model_dir),
        contract.DALI_NUM_THREADS: serving.dali_threads,
        contract.MAX_IMAGE_BYTES: target.limits[contract.MAX_IMAGE_BYTES],
        contract.MAX_IMAGE_PIXELS: target.limits[contract.MAX_IMAGE_PIXELS],
        contract.MAX_IMAGES_PER_REQUEST: max_images_per_request(target),
    }
    values = {
        "target": target.name,
        "inputs": render_tensors(interface.inputs),
        "outputs": render_tensors(interface.outputs),
        "instances": str(serving.preprocess_instances),
        "parameters": render_parameters(target.placed(contract.PREPROCESS_MODEL, parameters)),
    }
    return {"preprocess/config.pbtxt": render_template("preprocess_python.pbtxt", values)}


def max_images_per_request(target: Target) -> int:
    """The most images one request may bring to ``preprocess`` (cpu) and the encoders: the
    target's ``max_images_per_request`` if it sets one, else the contract's default (``llm``
    enforces its own ``max_images`` on the embeddings it receives)."""
    default = int(contract.default_of(contract.MAX_IMAGES_PER_REQUEST))
    return int(target.limits.get(contract.MAX_IMAGES_PER_REQUEST, default))


def vit_encoder_files(target: Target, facts: EncoderFacts) -> dict[str, str]:
    serving = target.encode
    if serving.device == "gpu":
        config = tensorrt_config(
            target.name, facts.parameters(), serving.trt_profile, serving.trt_precision, serving.encoder_instances,
            encode_gpu(target),
        )
        return {"vit_encoder/config.pbtxt": config}
    interface = contract.VIT_ENCODER.sized(facts.parameters())
    parameters = {
        contract.ONNX_FILE_KEY: contract.ONNX_FILE,
        contract.VIT_THREADS: serving.vit_threads,
        contract.VIT_PRECISION: serving.vit_precision,
        # Checked against the ONNX file's metadata at load, and shown as metrics.
        **facts.parameters(),
    }
    config = render_template(
        "vit_encoder_onnxruntime.pbtxt",
        {
            "target": target.name,
            "inputs": render_tensors(interface.inputs),
            "outputs": render_tensors(interface.outputs),
            "instances": str(serving.encoder_instances),
            "parameters": render_parameters(target.placed(contract.VIT_ENCODER_MODEL, parameters)),
        },
    )
    return {"vit_encoder/config.pbtxt": config}


def vit_positions_files(target: Target, facts: EncoderFacts) -> dict[str, str]:
    interface = contract.VIT_POSITIONS
    config = render_template(
        "vit_positions.pbtxt",
        {
            "target": target.name,
            "inputs": render_tensors(interface.inputs),
            "outputs": render_tensors(interface.outputs),
            "parameters": render_parameters({contract.MERGE_SIZE: facts.merge_size}),
        },
    )
    model_py = (TEMPLATES / POSITIONS_MODEL_TEMPLATE).read_text()
    return {"vit_positions/config.pbtxt": config, "vit_positions/1/model.py": model_py}


def _same_names(*names: str) -> dict[str, str]:
    """A step's tensor map where the model's tensors keep their names in the ensemble."""
    return {name: name for name in names}


def encode_steps(target: Target) -> list[EnsembleStep]:
    """``image`` -> ``image_embeds`` + ``image_grid_thw``: the steps of ``encode`` (and the head
    of ``ensemble``)."""
    grid = _same_names(contract.IMAGE_GRID_THW)
    embeds = _same_names(contract.IMAGE_EMBEDS)
    preprocess = EnsembleStep(
        contract.PREPROCESS_MODEL, _same_names(contract.IMAGE), {**_same_names(contract.PIXEL_VALUES), **grid}
    )
    if target.encode.device == "gpu":
        # The plan takes the image's folded rows as preprocess gives them, and one frame's ids.
        positions_out = _same_names(contract.ROTARY_POS_IDS)
        positions = EnsembleStep(contract.VIT_POSITIONS_MODEL, grid, positions_out)
        encoder_in = {**_same_names(contract.PIXEL_VALUES), **positions_out}
        return [preprocess, positions, EnsembleStep(contract.VIT_ENCODER_MODEL, encoder_in, embeds)]
    encoder_in = {**_same_names(contract.PIXEL_VALUES), **grid}
    return [preprocess, EnsembleStep(contract.VIT_ENCODER_MODEL, encoder_in, embeds)]


# What ``encode`` and ``ensemble`` take per target, said in their configs' comments.
_ENCODE_SHAPES = {
    "cpu": "0..N encoded images per request (image: BYTES [n], raw or base64) -> every image's\n"
    "# embeddings concatenated in order (image_embeds [1, tokens, hidden]) + image_grid_thw [n, 3].",
    "gpu": "exactly one image per request (image: UINT8 [1, bytes]; the TensorRT plan takes one\n"
    "# image) -> image_embeds [1, tokens, hidden] + image_grid_thw [1, 3].",
}
_ENSEMBLE_SHAPES = {
    "cpu": "0 to max_images encoded images per request (image: BYTES [n], optional, raw or base64,\n"
    "# as llm takes them): preprocess and vit_encoder take a request's images at once.",
    "gpu": "exactly one image per request (image: UINT8 [1, bytes]), as this target's encode takes\n"
    "# it (a static DAG cannot loop); use llm or epd for 0 or several.",
}


def encode_files(target: Target, facts: EncoderFacts) -> dict[str, str]:
    """``encode``: not batched on either target. ``cpu``: a request's images at once (BYTES
    ``[n]``); ``gpu``: one image per request with the batch row explicit (the plan takes one)."""
    device = target.encode.device
    interface = (contract.ENCODE_ONE_IMAGE if device == "gpu" else contract.ENCODE).sized(facts.parameters())
    config = render_template(
        "encode.pbtxt",
        {
            "target": target.name,
            "shapes": _ENCODE_SHAPES[device],
            "inputs": render_tensors(interface.inputs),
            "outputs": render_tensors(interface.outputs),
            "steps": render_steps(encode_steps(target)),
        },
    )
    return {"encode/config.pbtxt": config}


def ensemble_files(target: Target, facts: EncoderFacts) -> dict[str, str]:
    """``ensemble``: encode's steps -> ``llm`` with the embeddings by value, one static DAG.

    ``cpu``: 0 to ``max_images`` images per request (``image``: BYTES ``[n]``, optional, as
    ``llm`` takes them): ``preprocess`` and ``vit_encoder`` take all of a request's images at once
    and answer empty tensors for none (an absent ``image`` reaches preprocess as no input), which
    ``llm`` reads as no image. ``gpu``: exactly one image per request (``image``: UINT8
    ``[1, bytes]``, as its ``encode`` takes it): the TensorRT plan takes one image per call and a
    static DAG cannot loop, so 0 or several are refused by Triton's shape check (use ``llm`` or
    ``epd`` for those). Decoupled streaming passes through: ``llm``'s responses are the ensemble's.
    """
    del facts  # the llm step's own config carries the hidden size
    device = target.encode.device
    interface = contract.ENSEMBLE_ONE_IMAGE if device == "gpu" else contract.ENSEMBLE
    options = _same_names(*(spec.name for spec in contract.GENERATE_OPTIONS))
    llm_in = _same_names(contract.TEXT_INPUT, contract.IMAGE_EMBEDS, contract.IMAGE_GRID_THW)
    llm = EnsembleStep(contract.LLM_MODEL, {**llm_in, **options}, _same_names(*contract.LLM.output_names))
    config = render_template(
        "ensemble.pbtxt",
        {
            "target": target.name,
            "shapes": _ENSEMBLE_SHAPES[device],
            "inputs": render_tensors(interface.inputs),
            "outputs": render_tensors(interface.outputs),
            "steps": render_steps([*encode_steps(target), llm]),
        },
    )
    return {"ensemble/config.pbtxt": config}

"""Step 5 of an encoder build, GPU target only: the TensorRT plan of an exported ONNX graph.

:func:`build_tensorrt_plan` serializes the ``tensorrt_plan`` engine of an ONNX graph for one
optimisation profile, given as each input's (min, opt, max) shape: the vision encoder's
(``builders/encoder.py``; ``TrtProfile.input_shapes``) and the audio encoder's
(``builders/audio_encoder.py``; ``AudioTrtProfile.input_shapes``), both in
``builders/tensorrt_config.py``, which also renders their config.pbtxt. It runs only where
``tensorrt`` imports and a GPU is visible: elsewhere :func:`tensorrt_unavailable_reason` says
why, for skips and CLI errors.

Both graphs have INT64 inputs (the ViT's ``rotary_pos_ids``, the audio encoder's
``feature_lengths``) and the audio one an INT64 output (``audio_tokens``): TensorRT 10 (the NGC
image's) takes INT64 I/O tensors as they are; TensorRT 8 would need them cast to INT32 in the
graph and the configs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from builders.checkpoint import EncoderBuildError, Precision
from builders.tensorrt_config import ShapeRange

# Where a container with GPUs has its /dev/nvidia0, /dev/nvidia1, ... device nodes.
DEVICE_DIR = Path("/dev")


def no_gpu_reason() -> str | None:
    """None where a GPU is visible (nvidia-smi lists one, or /dev/nvidiaN exists); else why not.
    Makes no CUDA context."""
    from builders.preflight import query_gpus  # it imports this package's modules

    gpus, note = query_gpus()
    if gpus or sorted(DEVICE_DIR.glob("nvidia[0-9]*")):
        return None
    return f"no GPU visible ({note})"


def tensorrt_unavailable_reason() -> str | None:
    """None where TensorRT's Python API imports and a GPU is visible; else why not (for skips and
    CLI errors). TensorRT builds a plan on, and for, the GPU it runs on: the image imports
    tensorrt at ``docker build`` too, where there is no GPU, so the plan waits for the first start."""
    try:
        import tensorrt  # noqa: F401
    except ImportError as exc:  # includes the PyPI placeholder packages that fail to load
        return f"tensorrt is not importable here ({exc}); build plans in the NGC Triton image"
    no_gpu = no_gpu_reason()
    if no_gpu:
        return f"tensorrt imports but {no_gpu}; the plan is built at the first start with a GPU"
    return None


def check_input_shapes(input_shapes: Mapping[str, ShapeRange]) -> None:
    """ValueError unless each input's (min, opt, max) shapes have one rank and min <= opt <= max
    in every dim (TensorRT's own check only fails the build, after parsing the graph)."""
    for name, (low, opt, high) in input_shapes.items():
        ordered = len(low) == len(opt) == len(high) and all(
            0 < a <= b <= c for a, b, c in zip(low, opt, high, strict=True)
        )
        if not ordered:
            raise ValueError(f"input {name!r}: need positive min <= opt <= max of one rank, got {low}, {opt}, {high}")


def build_tensorrt_plan(
    onnx_path: str | Path,
    plan_path: str | Path,
    input_shapes: Mapping[str, ShapeRange],
    precision: Precision = "fp16",
    workspace_bytes: int = 4 << 30,
) -> Path:
    """Serialize a TensorRT engine with one optimisation profile: ``input_shapes``, the (min, opt,
    max) engine shape of every input of the graph. Runs only where ``tensorrt`` imports."""
    check_input_shapes(input_shapes)
    reason = tensorrt_unavailable_reason()
    if reason:
        raise EncoderBuildError(reason)
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # from file: finds external weight data
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EncoderBuildError(f"TensorRT could not parse {onnx_path}: {errors}")
    graph_inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    if graph_inputs != set(input_shapes):
        raise EncoderBuildError(f"{onnx_path} takes inputs {sorted(graph_inputs)}, the profile {sorted(input_shapes)}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    optimization_profile = builder.create_optimization_profile()
    for name, (low, opt, high) in input_shapes.items():
        optimization_profile.set_shape(name, low, opt, high)
    config.add_optimization_profile(optimization_profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EncoderBuildError("TensorRT failed to build the engine; see its log above")
    plan_path = Path(plan_path)
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_bytes(bytes(serialized))
    return plan_path

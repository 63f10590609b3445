"""The TensorRT plans (FP32 and FP16) against the same ONNX graphs under ONNX Runtime.

``vit_encoder``: builds the tiny default model's ONNX encoder and a plan per precision with the
profile derived from the checkpoint's pixel limits (what the gpu target serves), then feeds both
one image per call with folded rows (``vit_onnx.encoder_calls``, as preprocess and
``vit_positions`` feed the plan), batches of one and of several images, and checks the plan
against ONNX Runtime and against transformers (the processor's full rows). ``audio_encoder``: the tiny Qwen2-Audio
checkpoint's encoder with the gpu target's audio profile, one clip (what ``encoder_<i>`` sends), a
short one and the profile's most clips. Skipped where TensorRT or a GPU is missing (CI); run with
``bash tests/gpu/check_gpu.sh`` on a GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from builders.targets import TARGETS
from python_backends.encode.vit_onnx import OUTPUT_NAME, OnnxVisionEncoder, encoder_calls, unfold_temporal


def _missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    from builders.tensorrt_plan import tensorrt_unavailable_reason

    return tensorrt_unavailable_reason()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]

# Max-abs difference to ONNX Runtime (float32 on the CPU). FP16 keeps about 3 decimal digits
# through 2 tiny transformer blocks; FP32 differs only by kernel order.
TOLERANCE = {"fp32": 1e-3, "fp16": 5e-2}
GRIDS = ([[1, 4, 4]], [[1, 16, 16]], [[1, 32, 32]], [[1, 8, 12], [1, 4, 4]])


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, object]:
    from builders.default_model import build_default_model
    from builders.encoder import export_onnx, load_vision_tower, load_vision_weights

    model_dir = build_default_model()
    tower = load_vision_tower(model_dir, load_vision_weights(model_dir))
    onnx_path = export_onnx(tower, tmp_path_factory.mktemp("onnx"))
    profile = TARGETS["gpu"].fitted_to_checkpoint(model_dir).encode.trt_profile
    return onnx_path, tower, profile


def run_plan(
    plan: Path, feed: dict[str, np.ndarray], outputs: tuple[str, ...] = (OUTPUT_NAME,)
) -> dict[str, np.ndarray]:
    """``outputs`` of one run of ``plan`` on ``feed`` (every engine input, host arrays)."""
    import tensorrt as trt
    import torch

    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan.read_bytes())
    assert engine is not None, "the plan does not load on this GPU"
    context = engine.create_execution_context()
    keep = []
    for name, value in feed.items():
        array = np.ascontiguousarray(value.astype(trt.nptype(engine.get_tensor_dtype(name))))
        tensor = torch.from_numpy(array).cuda()
        keep.append(tensor)
        context.set_input_shape(name, tuple(array.shape))
        context.set_tensor_address(name, tensor.data_ptr())
    results = {}
    for name in outputs:
        dtype = torch.from_numpy(np.zeros(0, trt.nptype(engine.get_tensor_dtype(name)))).dtype
        results[name] = torch.empty(tuple(context.get_tensor_shape(name)), dtype=dtype, device="cuda")
        context.set_tensor_address(name, results[name].data_ptr())
    stream = torch.cuda.current_stream()
    assert context.execute_async_v3(stream.cuda_stream)
    stream.synchronize()
    return {name: (t.float() if t.is_floating_point() else t).cpu().numpy() for name, t in results.items()}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_plan_matches_onnx_runtime(precision: str, exported: tuple[Path, object, object], tmp_path: Path) -> None:
    from builders.encoder import torch_reference
    from builders.tensorrt_plan import build_tensorrt_plan

    onnx_path, tower, profile = exported
    encoder = OnnxVisionEncoder(onnx_path, threads=1)
    shape = encoder.shape
    shapes = profile.input_shapes(shape.folded_patch_dim)  # frames 1, folded rows: what the gpu target serves
    plan = build_tensorrt_plan(onnx_path, tmp_path / "model.plan", shapes, precision)  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    worst: dict[str, tuple[float, float]] = {}
    for grid_rows in GRIDS:
        grid = np.asarray(grid_rows, dtype=np.int64)
        rows = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
        folded = rng.standard_normal((rows, shape.folded_patch_dim), dtype=np.float32)
        calls = encoder_calls(folded, grid, shape)  # one per image: [1, patches, folded row] + its ids
        expected = np.concatenate([encoder.run(call) for call in calls])
        actual = np.concatenate([run_plan(plan, call.as_feed())[OUTPUT_NAME] for call in calls])
        reference = torch_reference(tower, unfold_temporal(folded, shape.temporal_patch_size), grid)
        assert actual.shape == expected.shape == reference.shape
        worst[str(grid_rows)] = (float(np.abs(actual - expected).max()), float(np.abs(actual - reference).max()))
    print(f"{precision} plan vs (ONNX Runtime, transformers), max-abs per grid batch: {worst}")
    assert max(max(pair) for pair in worst.values()) <= TOLERANCE[precision], worst


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_audio_plan_matches_onnx_runtime(precision: str, tmp_path: Path) -> None:
    import onnxruntime as ort

    from builders.audio_encoder import OUTPUT_NAMES, export_onnx
    from builders.default_model import DEFAULT_AUDIO_MODEL_DIR, build_default_model
    from builders.model_configs import audio_plan_profile
    from builders.tensorrt_plan import build_tensorrt_plan

    model_dir = build_default_model(DEFAULT_AUDIO_MODEL_DIR, recipe="qwen2-audio")
    onnx_path = export_onnx(model_dir, tmp_path)
    profile = audio_plan_profile(TARGETS["gpu"], model_dir)
    plan = build_tensorrt_plan(onnx_path, tmp_path / "model.plan", profile.input_shapes(), precision)  # type: ignore[arg-type]
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    worst = {}
    for lengths in ([profile.frames], [101], [profile.frames, 1000][: profile.max_clips]):
        features = rng.standard_normal((len(lengths), profile.mel_bins, profile.frames), dtype=np.float32)
        feed = {"input_features": features, "feature_lengths": np.array(lengths, dtype=np.int64)}
        embeds, tokens = session.run(list(OUTPUT_NAMES), feed)
        actual = run_plan(plan, feed, OUTPUT_NAMES)
        np.testing.assert_array_equal(actual["audio_tokens"], tokens)
        # The rows the store keeps: each clip's first tokens (the rest pad the window).
        worst[str(lengths)] = max(
            float(np.abs(actual["audio_embeds"][i, :n] - embeds[i, :n]).max()) for i, n in enumerate(tokens)
        )
    print(f"{precision} audio plan vs ONNX Runtime, max-abs per call: {worst}")
    assert max(worst.values()) <= TOLERANCE[precision], worst

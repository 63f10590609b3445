"""vit_encoder's TensorRT plan (FP32 and FP16) against the same ONNX graph under ONNX Runtime.

Builds the tiny default model's ONNX encoder and a plan per precision with the profile derived
from the checkpoint's pixel limits (what the gpu target serves), then runs one-image and
several-image calls through both. Skipped where TensorRT or a GPU is missing (CI); run with
``bash tests/gpu/check_gpu.sh`` on a GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from builders.targets import TARGETS
from python_backends.encode.vit_onnx import INPUT_NAMES, OUTPUT_NAME, encoder_inputs


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
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, object]:
    from builders.default_model import build_default_model
    from builders.encoder import export_onnx, load_vision_tower, load_vision_weights, tower_dims

    model_dir = build_default_model()
    tower = load_vision_tower(model_dir, load_vision_weights(model_dir))
    onnx_path = export_onnx(tower, tmp_path_factory.mktemp("onnx"))
    profile = TARGETS["gpu"].fitted_to_checkpoint(model_dir).encode.trt_profile
    return onnx_path, tower_dims(tower)["patch_dim"], profile


def run_plan(plan: Path, feed: dict[str, np.ndarray]) -> np.ndarray:
    import tensorrt as trt
    import torch

    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan.read_bytes())
    assert engine is not None, "the plan does not load on this GPU"
    context = engine.create_execution_context()
    keep = []
    for name in INPUT_NAMES:
        array = np.ascontiguousarray(feed[name].astype(trt.nptype(engine.get_tensor_dtype(name))))
        tensor = torch.from_numpy(array).cuda()
        keep.append(tensor)
        context.set_input_shape(name, tuple(array.shape))
        context.set_tensor_address(name, tensor.data_ptr())
    out_dtype = torch.from_numpy(np.zeros(0, trt.nptype(engine.get_tensor_dtype(OUTPUT_NAME)))).dtype
    out = torch.empty(tuple(context.get_tensor_shape(OUTPUT_NAME)), dtype=out_dtype, device="cuda")
    context.set_tensor_address(OUTPUT_NAME, out.data_ptr())
    stream = torch.cuda.current_stream()
    assert context.execute_async_v3(stream.cuda_stream)
    stream.synchronize()
    return out.float().cpu().numpy()


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_plan_matches_onnx_runtime(precision: str, exported: tuple[Path, int, object], tmp_path: Path) -> None:
    import onnxruntime as ort

    from builders.tensorrt_plan import build_tensorrt_plan

    onnx_path, patch_dim, profile = exported
    plan = build_tensorrt_plan(onnx_path, tmp_path / "model.plan", patch_dim, profile, precision)  # type: ignore[arg-type]
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    worst = {}
    for grid_rows in GRIDS:
        grid = np.asarray(grid_rows, dtype=np.int64)
        rows = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
        feed = encoder_inputs(rng.standard_normal((rows, patch_dim), dtype=np.float32), grid, 2).as_feed()
        expected = session.run([OUTPUT_NAME], feed)[0]
        actual = run_plan(plan, feed)
        assert actual.shape == expected.shape
        worst[str(grid_rows)] = float(np.abs(actual - expected).max())
    print(f"{precision} plan vs ONNX Runtime, max-abs per grid: {worst}")
    assert max(worst.values()) <= TOLERANCE[precision], worst

"""Vision encoder: vision-only weight loading, ONNX export parity, TensorRT path and config."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.vision_utils import get_vision_position_ids

from builders.encoder import (
    PARITY_TOLERANCE,
    VALIDATION_GRIDS,
    EncoderBuildError,
    export_onnx,
    load_vision_tower,
    load_vision_weights,
    torch_reference,
    tower_dims,
    validate_onnx,
)
from builders.tensorrt_config import TrtProfile, cuda_graph_shapes, tensorrt_config
from builders.tensorrt_plan import build_tensorrt_plan, tensorrt_unavailable_reason
from python_backends.encode.vit_onnx import (
    OnnxVisionEncoder,
    embedding_counts,
    frame_position_ids,
    unfold_temporal,
    vision_position_ids,
)
from python_backends.errors import EpdError, ErrorCode

GRIDS_FOR_IDS = [[[1, 2, 2]], [[1, 4, 6]], [[2, 4, 4]], [[1, 26, 36], [1, 2, 40], [3, 6, 2]]]


@pytest.fixture(scope="module")
def tower(model_dir: Path):
    return load_vision_tower(model_dir)


@pytest.fixture(scope="module")
def onnx_path(tower, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_onnx(tower, tmp_path_factory.mktemp("vit_encoder"))


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def _all_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


def test_reads_only_the_vision_shard(model_dir: Path, tower) -> None:
    weights = load_vision_weights(model_dir)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    vision_files = {f for k, f in index["weight_map"].items() if k.startswith("visual.")}
    assert weights.shard_files_read == tuple(sorted(vision_files)) == ("model-00001-of-00002.safetensors",)
    assert weights.shard_files_total == 2
    rotary_buffers = {"rotary_pos_emb.inv_freq", "rotary_pos_emb.original_inv_freq"}
    assert set(weights.tensors) == set(tower.state_dict()) - rotary_buffers

    started = time.perf_counter()
    everything = _all_tensors(model_dir)
    full_seconds = time.perf_counter() - started
    print(
        f"\nvision-only: {len(weights.tensors)} tensors from {len(weights.shard_files_read)}/"
        f"{weights.shard_files_total} shards in {weights.seconds * 1e3:.1f} ms; "
        f"full checkpoint: {len(everything)} tensors in {full_seconds * 1e3:.1f} ms"
    )
    for name, tensor in weights.tensors.items():
        torch.testing.assert_close(tensor, everything["visual." + name], rtol=0, atol=0)


def test_single_file_checkpoint_in_transformers5_layout(model_dir: Path, tmp_path: Path) -> None:
    renamed = {}
    for key, tensor in _all_tensors(model_dir).items():
        if key.startswith("visual."):
            key = "model." + key  # transformers 5 module names
        elif key.startswith("model."):
            key = "model.language_model." + key[len("model.") :]
        renamed[key] = tensor
    save_file(renamed, str(tmp_path / "model.safetensors"))
    shutil.copy(model_dir / "config.json", tmp_path / "config.json")

    weights = load_vision_weights(tmp_path)
    assert weights.shard_files_read == ("model.safetensors",) and weights.shard_files_total == 1
    reference = load_vision_weights(model_dir)
    assert set(weights.tensors) == set(reference.tensors)
    single_file_tower = load_vision_tower(tmp_path, weights)
    grid = np.array([[1, 4, 6]])
    pixels = np.random.default_rng(1).standard_normal((24, 1176), dtype=np.float32)
    np.testing.assert_array_equal(
        torch_reference(single_file_tower, pixels, grid), torch_reference(load_vision_tower(model_dir), pixels, grid)
    )


def test_checkpoint_without_vision_weights_is_refused(model_dir: Path, tmp_path: Path) -> None:
    text_only = {k: v for k, v in _all_tensors(model_dir).items() if not k.startswith("visual.")}
    save_file(text_only, str(tmp_path / "model.safetensors"))
    with pytest.raises(EncoderBuildError, match="no vision weights"):
        load_vision_weights(tmp_path)
    with pytest.raises(EncoderBuildError, match="neither"):
        load_vision_weights(tmp_path / "missing")


# ---------------------------------------------------------------------------------------------
# Graph inputs computed outside the graph
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("grid", GRIDS_FOR_IDS)
def test_position_ids_match_transformers(grid: list[list[int]]) -> None:
    grid_np = np.array(grid, dtype=np.int64)
    expected_ids = get_vision_position_ids(torch.tensor(grid), 2).numpy()
    np.testing.assert_array_equal(vision_position_ids(grid_np, 2), expected_ids)
    t, h, w = grid[0]
    np.testing.assert_array_equal(frame_position_ids(h, w, 2), expected_ids[: h * w])


def test_unfold_temporal_gives_the_processors_rows() -> None:
    """A folded row is one temporal copy of each channel's P*P values; the processor repeats it T
    times inside each channel (C, T, P, P)."""
    folded = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 12)  # 2 rows, C=3, P*P=4
    full = unfold_temporal(folded, 2)
    assert full.shape == (2, 24)
    np.testing.assert_array_equal(full[0], [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7, 8, 9, 10, 11, 8, 9, 10, 11])


# ---------------------------------------------------------------------------------------------
# ONNX
# ---------------------------------------------------------------------------------------------


def test_onnx_matches_torch_over_many_grids(onnx_path: Path, tower) -> None:
    report = validate_onnx(onnx_path, tower)
    image_batches = sum(all(t == 1 for t, _, _ in batch) for batch in VALIDATION_GRIDS)
    assert len(report.grids) == len(VALIDATION_GRIDS) + image_batches  # images: full and folded rows
    assert set(report.grids) == set(VALIDATION_GRIDS)
    print(f"\nONNX Runtime vs torch, max-abs per grid batch: {[f'{e:.1e}' for e in report.max_abs]}")
    assert report.ok, report
    assert report.worst <= PARITY_TOLERANCE


def test_an_image_gives_the_same_bits_alone_in_a_batch_and_on_any_thread_count(onnx_path: Path) -> None:
    """One call per image, one thread per call: an image's embeddings never depend on what else
    was encoded with it, nor on the encoder's CPU set (ONNX Runtime's own intra-op threads change
    small products by ~1e-6)."""
    one, many = OnnxVisionEncoder(onnx_path, threads=1), OnnxVisionEncoder(onnx_path, threads=3)
    grids = np.array([[1, 4, 6], [1, 2, 2], [1, 10, 4], [2, 4, 4]])
    rows = [int(t * h * w) for t, h, w in grids]
    rng = np.random.default_rng(2)
    images = [rng.standard_normal((n, one.shape.folded_patch_dim), dtype=np.float32) for n in rows[:3]]
    video = rng.standard_normal((rows[3], one.patch_dim), dtype=np.float32)
    together = many.encode(np.concatenate([unfold_temporal(i, 2) for i in images] + [video]), grids)
    assert [e.shape for e in together] == [(n, one.hidden_size) for n in embedding_counts(grids, 2)]
    for i, folded in enumerate(images):
        alone = one.encode(folded, grids[i : i + 1])[0]
        np.testing.assert_array_equal(many.encode(folded, grids[i : i + 1])[0], alone)
        np.testing.assert_allclose(together[i], alone, atol=1e-5, rtol=0)  # full rows: the unfolded weights
    np.testing.assert_array_equal(one.encode(video, grids[3:])[0], together[3])


def test_runner_rejects_inconsistent_inputs(onnx_path: Path) -> None:
    encoder = OnnxVisionEncoder(onnx_path)
    pixels = np.zeros((24, encoder.patch_dim), dtype=np.float32)
    cases = [
        (pixels, np.array([[1, 4, 4]]), "needs 16 rows"),
        (pixels, np.array([[1, 3, 8]]), "multiples of 2"),
        (pixels[:, :10], np.array([[1, 4, 6]]), "encoder takes 1176 .* or 588"),
        (pixels, np.array([1, 4, 6]), r"shape \[num_images, 3\]"),
        (pixels, np.array([[0, 4, 6]]), "positive"),
    ]
    for values, grid, match in cases:
        with pytest.raises(EpdError, match=match) as caught:
            encoder.encode(values, grid)
        assert caught.value.code == ErrorCode.INVALID_ARG


# ---------------------------------------------------------------------------------------------
# TensorRT
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(tensorrt_unavailable_reason() is not None, reason=str(tensorrt_unavailable_reason()))
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_tensorrt_plan_builds(onnx_path: Path, tower, precision: str) -> None:
    profile = TrtProfile(min_patches=4, opt_patches=1024, max_patches=4096)
    plan_path = onnx_path.parent / f"model-{precision}.plan"
    dims = tower_dims(tower)
    shapes = profile.input_shapes(dims["patch_dim"] // dims["temporal_patch_size"])  # folded image rows
    plan = build_tensorrt_plan(onnx_path, plan_path, shapes, precision)  # type: ignore[arg-type]
    assert plan.stat().st_size > 0


def test_tensorrt_unavailable_is_a_clear_error_here(onnx_path: Path) -> None:
    if tensorrt_unavailable_reason() is None:
        pytest.skip("tensorrt is importable here; the GPU test covers the build")
    with pytest.raises(EncoderBuildError, match="tensorrt is not importable"):
        build_tensorrt_plan(onnx_path, onnx_path.parent / "model.plan", TrtProfile().input_shapes(588))


def test_tensorrt_without_a_gpu_leaves_the_plan_for_the_first_start(
    onnx_path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """docker build imports tensorrt (the image installs it) but has no GPU: a clear reason, not
    a builder crash that would stop the image build."""
    import sys
    import types

    import builders.preflight
    import builders.tensorrt_plan

    monkeypatch.setitem(sys.modules, "tensorrt", types.ModuleType("tensorrt"))  # importable
    monkeypatch.setattr(builders.preflight, "query_gpus", lambda: (None, "nvidia-smi not found"))
    monkeypatch.setattr(builders.tensorrt_plan, "DEVICE_DIR", tmp_path)
    reason = tensorrt_unavailable_reason()
    assert reason is not None and "no GPU visible (nvidia-smi not found)" in reason and "first start" in reason
    with pytest.raises(EncoderBuildError, match="no GPU visible"):
        build_tensorrt_plan(onnx_path, tmp_path / "model.plan", TrtProfile().input_shapes(588))
    (tmp_path / "nvidia0").touch()  # a GPU's device node, where nvidia-smi is missing
    assert tensorrt_unavailable_reason() is None
    (tmp_path / "nvidia0").unlink()
    gpu = builders.preflight.Gpu(0, "H100", 80 << 30, 80 << 30, "9.0")
    monkeypatch.setattr(builders.preflight, "query_gpus", lambda: ([gpu], ""))
    assert tensorrt_unavailable_reason() is None


def test_tensorrt_config_matches_the_exported_graph(onnx_path: Path, tower) -> None:
    """The gpu vit_encoder config against what the export declares (the ONNX graph the plan is
    built from, not the builder's own description): the engine's inputs and output as Triton
    hands them over (after the config's reshape) fit the graph's (its frames, patches and row
    width are dynamic; the config fixes frames at 1 and rows folded), and every CUDA graph and
    profile shape has the rank and fixed dims of the graph input it is set on (TensorRT's
    setInputShape)."""
    import onnx
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    def declared(values) -> dict[str, list[int]]:
        return {
            v.name: [d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim]
            for v in values
        }

    def fits(shape: list[int], dims: list[int]) -> bool:
        return len(shape) == len(dims) and all(d == -1 or s == d for s, d in zip(shape, dims, strict=True))

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    engine_inputs, engine_outputs = declared(graph.input), declared(graph.output)
    dims = tower_dims(tower)
    image_patch_dim = dims["patch_dim"] // dims["temporal_patch_size"]
    facts = {
        **dims, "image_patch_dim": image_patch_dim,
        "vision_shards": 1, "checkpoint_shards": 2, "vision_weight_bytes": 1, "checkpoint_weight_bytes": 2,
    }  # fmt: skip
    profile = TrtProfile(min_patches=4, opt_patches=1024, max_patches=4096)
    config = text_format.Parse(tensorrt_config("gpu", facts, profile, "fp16", 1), model_config_pb2.ModelConfig())
    assert config.platform == "tensorrt_plan" and config.max_batch_size == 0

    def as_engine_sees(tensors) -> dict[str, list[int]]:
        return {t.name: list(t.reshape.shape) if t.HasField("reshape") else list(t.dims) for t in tensors}

    inputs = as_engine_sees(config.input)
    assert set(inputs) == set(engine_inputs)
    assert all(fits(shape, engine_inputs[name]) for name, shape in inputs.items()), (inputs, engine_inputs)
    assert inputs["pixel_values"] == [1, -1, image_patch_dim]
    assert as_engine_sees(config.output) == engine_outputs
    graphs = config.optimization.cuda.graph_spec
    assert config.optimization.cuda.graphs and len(graphs) == 2
    for spec in graphs:
        assert set(spec.input) == set(engine_inputs)
        for name, shape in spec.input.items():
            assert fits(list(shape.dim), engine_inputs[name]), (name, list(shape.dim), engine_inputs[name])
    assert sorted(spec.input["pixel_values"].dim[1] for spec in graphs) == [1024, 4096]
    for name, shapes in profile.input_shapes(image_patch_dim).items():
        assert all(fits(list(shape), engine_inputs[name]) for shape in shapes), name


@pytest.mark.parametrize(
    ("profile", "match"),
    [
        (TrtProfile(min_patches=8, opt_patches=4, max_patches=16), "min <= opt <= max"),
        (TrtProfile(min_patches=4, opt_patches=6, max_patches=16), "multiples of 4"),
    ],
)
def test_tensorrt_profile_is_checked(profile: TrtProfile, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cuda_graph_shapes(profile, image_patch_dim=588)


def test_the_export_gives_the_same_bytes_under_any_hash_seed(model_dir: Path, tmp_path: Path) -> None:
    """Content keys cover the served file's digest: two servers that export the same checkpoint
    apart (a scale-out encoder and its PD server) must write the same bytes, whatever Python's
    hash seed (torch.export's notes once listed shape symbols in hash order)."""
    import hashlib
    import os
    import subprocess
    import sys

    script = (
        "import sys; from builders.encoder import export_onnx, load_vision_tower; "
        "print(export_onnx(load_vision_tower(sys.argv[1]), sys.argv[2]))"
    )
    digests = set()
    for seed in ("1", "3"):
        out = tmp_path / seed
        env = {**os.environ, "PYTHONHASHSEED": seed}
        command = [sys.executable, "-c", script, str(model_dir), str(out)]
        subprocess.run(command, env=env, check=True, capture_output=True)
        digests.add(hashlib.sha256((out / "model.onnx").read_bytes()).hexdigest())
    assert len(digests) == 1

"""The gpu target's audio encoder (issue 34): ``audio_encoder`` as a TensorRT plan of the ONNX graph
the cpu target runs under ONNX Runtime, checked offline (no GPU, no TensorRT here).

- the plan's profile and CUDA graph against what the export declares, and the config's tensors as
  Triton's TensorRT backend compares them with the engine's;
- ``build_tensorrt_plan`` given each encoder's (min, opt, max) shapes (the ViT's: one image), through
  a stand-in of TensorRT's builder API;
- the gpu repository of an audio checkpoint against the contract, and the plan left for the first
  start on a GPU with a warning.

The plan itself against ONNX Runtime: tests/gpu/test_tensorrt_parity.py.
"""

from __future__ import annotations

import importlib.machinery
import json
import logging
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

import builders.tensorrt_plan
from builders.artifacts import build_audio_plan_artifact, build_plan_artifact
from builders.default_model import DEFAULT_AUDIO_MODEL_DIR, build_default_model
from builders.encoder import EncoderBuildError
from builders.model_configs import audio_plan_profile
from builders.repository import TARGETS, write_repository
from builders.targets import PD_MODELS
from builders.tensorrt_config import AudioTrtProfile, audio_tensorrt_config
from builders.tensorrt_plan import build_tensorrt_plan
from python_backends import contract
from tests.unit.repository_helpers import FACTS
from tests.unit.test_contract import config_tensors, contract_tensors, declared_interface, generated_configs

GPU = TARGETS["gpu"]
Config = model_config_pb2.ModelConfig
# ONNX's element types of the graph's tensors, as Triton's config names them.
ONNX_TYPES = {1: "TYPE_FP32", 7: "TYPE_INT64"}


@pytest.fixture(scope="module")
def audio_model() -> Path:
    return build_default_model(DEFAULT_AUDIO_MODEL_DIR, recipe="qwen2-audio")


@pytest.fixture(scope="module")
def exported_graph(audio_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list[int]]]:
    """Each input's and output's (data type, dims) as the exported ONNX graph declares them (-1:
    a dynamic dim): what TensorRT builds the engine from."""
    import onnx

    from builders.audio_encoder import export_onnx

    graph = onnx.load(str(export_onnx(audio_model, tmp_path_factory.mktemp("audio"))), load_external_data=False).graph
    return {
        v.name: (
            ONNX_TYPES[v.type.tensor_type.elem_type],
            [d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim],
        )
        for v in (*graph.input, *graph.output)
    }


def fits(shape: Sequence[int], dims: Sequence[int]) -> bool:
    """``shape`` is one the engine takes, or a config's dims match the engine's: same rank, equal
    where neither is -1 (Triton's TensorRT backend: CompareDimsSupported, compare_exact false)."""
    return len(shape) == len(dims) and all(-1 in (s, d) or s == d for s, d in zip(shape, dims, strict=True))


def test_the_profile_is_the_checkpoints_window_and_the_targets_clips(
    audio_model: Path, exported_graph: dict[str, tuple[str, list[int]]]
) -> None:
    profile = audio_plan_profile(GPU, audio_model)
    assert profile == AudioTrtProfile(mel_bins=128, frames=3000, max_clips=GPU.audio_limits[contract.MAX_AUDIOS])
    shapes = profile.input_shapes()
    assert shapes == {
        contract.INPUT_FEATURES: ((1, 128, 3000), (1, 128, 3000), (2, 128, 3000)),
        contract.FEATURE_LENGTHS: ((1,), (1,), (2,)),
    }
    # Every input of the graph has a range, and every shape of it is one the graph takes.
    assert set(shapes) == {name for name in exported_graph if name in contract.AUDIO_ENCODER.input_names}
    for name, ranges in shapes.items():
        assert all(fits(shape, exported_graph[name][1]) for shape in ranges), (name, ranges)
    # One CUDA graph, at what encoder_<i> sends (python_backends/encode/audios.py): one clip.
    assert profile.graph_shapes() == [{contract.INPUT_FEATURES: (1, 128, 3000), contract.FEATURE_LENGTHS: (1,)}]


@pytest.mark.parametrize(
    ("profile", "match"),
    [
        (AudioTrtProfile(mel_bins=0, frames=3000), "positive"),
        (AudioTrtProfile(mel_bins=128, frames=3000, max_clips=0), "opt_clips <= max_clips"),
        (AudioTrtProfile(mel_bins=128, frames=3000, max_clips=2, opt_clips=3), "opt_clips <= max_clips"),
    ],
)
def test_an_audio_profile_is_checked(profile: AudioTrtProfile, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        profile.input_shapes()


def test_the_config_is_the_cpu_models_tensors_on_the_encode_gpu(
    audio_model: Path, exported_graph: dict[str, tuple[str, list[int]]]
) -> None:
    profile = audio_plan_profile(GPU, audio_model)
    config = text_format.Parse(audio_tensorrt_config("gpu", profile, "fp16", 2, gpu=1), Config())
    assert config.name == contract.AUDIO_ENCODER_MODEL
    assert config.platform == "tensorrt_plan" and not config.backend and config.max_batch_size == 0
    # encoder_<i> calls it as it calls the ONNX Runtime model: the same names, dims and data types.
    assert config_tensors(config.input) == contract_tensors(contract.AUDIO_ENCODER.inputs)
    assert config_tensors(config.output) == contract_tensors(contract.AUDIO_ENCODER.outputs)
    # ... which the engine built from the graph takes (INT64 I/O: TensorRT 10).
    for entry in (*config.input, *config.output):
        data_type, dims = exported_graph[entry.name]
        assert model_config_pb2.DataType.Name(entry.data_type) == data_type, entry.name
        assert fits(list(entry.dims), dims), (entry.name, list(entry.dims), dims)
    assert set(exported_graph) == {e.name for e in (*config.input, *config.output)}
    (group,) = config.instance_group
    assert group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU and list(group.gpus) == [1] and group.count == 2
    cuda = config.optimization.cuda
    graphs = [{name: list(shape.dim) for name, shape in spec.input.items()} for spec in cuda.graph_spec]
    assert cuda.graphs and graphs == [{contract.INPUT_FEATURES: [1, 128, 3000], contract.FEATURE_LENGTHS: [1]}]
    params = {key: entry.string_value for key, entry in config.parameters.items()}
    assert params == {contract.PRECISION: "fp16", contract.PROFILE_MAX_CLIPS: "2"}


# ---------------------------------------------------------------------------------------------
# build_tensorrt_plan: each encoder's shapes, through a stand-in of TensorRT's builder API


def fake_tensorrt(graph_inputs: Sequence[str], profile_shapes: dict[str, tuple[Any, ...]]) -> types.ModuleType:
    """Just enough of ``tensorrt`` for :func:`build_tensorrt_plan`: a network with
    ``graph_inputs``; the shapes the optimisation profile gets are recorded in ``profile_shapes``."""
    network = SimpleNamespace(num_inputs=len(graph_inputs), get_input=lambda i: SimpleNamespace(name=graph_inputs[i]))
    profile = SimpleNamespace(set_shape=lambda name, *shapes: profile_shapes.__setitem__(name, shapes))
    config = SimpleNamespace(
        set_memory_pool_limit=lambda *args: None, set_flag=lambda flag: None, add_optimization_profile=lambda p: None
    )
    builder = SimpleNamespace(
        create_network=lambda flags: network,
        create_builder_config=lambda: config,
        create_optimization_profile=lambda: profile,
        build_serialized_network=lambda network, config: b"plan",
    )
    module = types.ModuleType("tensorrt")
    module.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)  # importable, as a real one
    module.__version__ = "10.0-fake"  # type: ignore[attr-defined]
    module.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None})  # type: ignore[attr-defined]
    module.Builder = lambda logger: builder  # type: ignore[attr-defined]
    module.OnnxParser = lambda network, logger: SimpleNamespace(parse_from_file=lambda path: True)  # type: ignore[attr-defined]
    module.MemoryPoolType = SimpleNamespace(WORKSPACE="workspace")  # type: ignore[attr-defined]
    module.BuilderFlag = SimpleNamespace(FP16="fp16")  # type: ignore[attr-defined]
    return module


def with_fake_tensorrt(monkeypatch: pytest.MonkeyPatch, graph_inputs: Sequence[str]) -> dict[str, tuple[Any, ...]]:
    shapes: dict[str, tuple[Any, ...]] = {}
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(graph_inputs, shapes))
    monkeypatch.setattr(builders.tensorrt_plan, "tensorrt_unavailable_reason", lambda: None)
    return shapes


def test_each_encoders_plan_gets_its_own_shapes(
    audio_model: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The artefact builders hand ``build_tensorrt_plan`` the ViT's profile (patches of one image)
    and the audio encoder's (clips), and stamp what they built."""
    vit_dir, audio_dir, stamps = tmp_path / "vit_encoder" / "1", tmp_path / "audio_encoder" / "1", tmp_path / "stamps"
    for folder in (vit_dir, audio_dir):
        folder.mkdir(parents=True)
        (folder / contract.ONNX_FILE).write_bytes(b"graph")
    vit_target = GPU.fitted_to_checkpoint(model_dir)
    vit = vit_target.encode.trt_profile
    shapes = with_fake_tensorrt(monkeypatch, contract.VIT_ENCODER_TENSORRT.input_names)
    assert build_plan_artifact(vit_target, FACTS, vit_dir, {}, stamps)
    patches = (vit.min_patches, vit.opt_patches, vit.max_patches)
    assert shapes == {  # one image of folded rows per call: only the patch count varies
        contract.PIXEL_VALUES: tuple((1, n, FACTS.image_patch_dim) for n in patches),
        contract.ROTARY_POS_IDS: tuple((n, 2) for n in patches),
    }
    audio = audio_plan_profile(GPU, audio_model)
    shapes = with_fake_tensorrt(monkeypatch, contract.AUDIO_ENCODER.input_names)
    assert build_audio_plan_artifact(GPU, audio, audio_dir, {}, stamps)
    assert shapes == audio.input_shapes() and (audio_dir / contract.PLAN_FILE).read_bytes() == b"plan"
    assert not build_audio_plan_artifact(GPU, audio, audio_dir, {}, stamps)  # stamped: up to date


def test_a_plan_is_refused_for_shapes_out_of_order_or_not_the_graphs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    audio = AudioTrtProfile(mel_bins=128, frames=3000).input_shapes()
    out_of_order = {**audio, contract.FEATURE_LENGTHS: ((2,), (1,), (2,))}
    with pytest.raises(ValueError, match="'feature_lengths': need positive min <= opt <= max"):
        build_tensorrt_plan(tmp_path / "model.onnx", tmp_path / "model.plan", out_of_order)
    with_fake_tensorrt(monkeypatch, contract.VIT_ENCODER_TENSORRT.input_names)
    with pytest.raises(EncoderBuildError, match="takes inputs .*'pixel_values'.* the profile .*'input_features'"):
        build_tensorrt_plan(tmp_path / "model.onnx", tmp_path / "model.plan", audio)


def test_without_tensorrt_the_audio_plan_waits_for_a_gpu_with_a_warning(
    audio_model: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    reason = "tensorrt is not importable here (No module named 'tensorrt'); build plans in the NGC Triton image"
    monkeypatch.setattr(builders.tensorrt_plan, "tensorrt_unavailable_reason", lambda: reason)
    version_dir = tmp_path / "audio_encoder" / "1"
    with caplog.at_level(logging.WARNING, logger="builders.artifacts"):
        built = build_audio_plan_artifact(GPU, audio_plan_profile(GPU, audio_model), version_dir, {}, tmp_path)
    assert not built and not (version_dir / contract.PLAN_FILE).exists()
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert record.getMessage().startswith(f"audio_encoder/1/model.plan not built: {reason}. Run `python -m")
    assert "Triton cannot load audio_encoder" in record.getMessage()


# ---------------------------------------------------------------------------------------------
# The gpu repository of an audio checkpoint


def test_an_audio_checkpoints_gpu_repository_serves_the_plan(
    audio_model: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Written over the cpu one, as a switch of target leaves it: ``audio_encoder`` is the plan's
    config (its generated model.py gone, the ONNX graph and the features pipeline kept), content
    keys cover the plan, the store is CUDA memory on the encode GPU, and the engines take the gpu
    target's args; the plan is left for the first start (no TensorRT here), with a warning."""
    from tests.unit.repository_helpers import fake_audio_build

    monkeypatch.setattr("builders.repository.build_audio_artifacts", fake_audio_build)
    monkeypatch.setattr(builders.tensorrt_plan, "tensorrt_unavailable_reason", lambda: "no TensorRT in this test")
    out, stamps = tmp_path / "repository", tmp_path / "stamps"
    write_repository("cpu", audio_model, out, stamps)
    version_dir = out / contract.AUDIO_ENCODER_MODEL / "1"
    assert (version_dir / "model.py").is_file()
    write_repository("gpu", audio_model, out, stamps)
    assert sorted(p.name for p in version_dir.iterdir()) == [contract.AUDIO_DALI_FILE, contract.ONNX_FILE]

    configs = {c.name: c for c in generated_configs(out)}
    encoders = GPU.cache.encoder_models
    assert set(configs) == {contract.LLM_MODEL, contract.AUDIO_ENCODER_MODEL, *encoders, *PD_MODELS}
    encoder = configs[contract.AUDIO_ENCODER_MODEL]
    assert declared_interface(encoder) == contract.AUDIO_ENCODER_TENSORRT
    assert encoder.platform == "tensorrt_plan" and list(encoder.instance_group[0].gpus) == [0]
    for name, config in configs.items():  # every parameter is one the contract gives the model
        interface = declared_interface(config)
        assert all(interface.accepts_parameter(key) for key in config.parameters), name
    plan = f"{contract.AUDIO_ENCODER_MODEL}/1/{contract.PLAN_FILE}"
    for name in (*encoders, contract.EPD_MODEL):
        values = {key: entry.string_value for key, entry in configs[name].parameters.items()}
        assert values[contract.ENCODER_FILE] == plan, name
        assert values[contract.STORE_DEVICE] == GPU.cache.device == "cuda:0", name
    for role in (contract.LLM_MODEL, *PD_MODELS):
        args = json.loads((out / role / "1" / "engine_args.json").read_text())
        assert args["dtype"] == GPU.engine_args["dtype"] and 0 < args["gpu_memory_utilization"] < 1, role
        assert args["limit_mm_per_prompt"] == {"audio": 2}, role

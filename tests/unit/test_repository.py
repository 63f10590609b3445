"""The generated repository for both targets: every config parses as Triton's ModelConfig, the
encode models are wired consistently (ensemble tensors match the models they connect), the
description is the only source, placeholders cannot survive, the folder is written idempotently
(artefacts: test_artifacts.py)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from builders import repository
from builders.model_configs import epd_video_limits
from builders.repository import (
    TARGETS,
    CachePolicy,
    Target,
    render_template,
    repository_files,
    write_repository,
)
from python_backends import contract
from python_backends.contract import ContractError
from python_backends.encode.vit_onnx import INPUT_NAMES as VIT_INPUT_NAMES
from python_backends.encode.vit_onnx import OUTPUT_NAME as VIT_OUTPUT_NAME
from python_backends.encode.vit_onnx import VisionShape, encoder_calls
from tests.unit.repository_helpers import FACTS

Config = model_config_pb2.ModelConfig
DataType = model_config_pb2.DataType


def configs(target: str, model_dir: Path) -> dict[str, Config]:
    files = repository_files(TARGETS[target], model_dir, FACTS)
    return {
        path.split("/")[0]: text_format.Parse(text, Config())
        for path, text in files.items()
        if path.endswith("config.pbtxt")
    }


def tensor(config: Config, name: str) -> model_config_pb2.ModelInput | model_config_pb2.ModelOutput:
    for entry in (*config.input, *config.output):
        if entry.name == name:
            return entry
    raise AssertionError(f"{config.name} has no tensor {name}")


def full_shape(config: Config, entry: model_config_pb2.ModelInput | model_config_pb2.ModelOutput) -> list[int]:
    """The shape on the wire: the batch dimension first when the model batches."""
    return ([-1] if config.max_batch_size > 0 else []) + list(entry.dims)


def compatible(a: list[int], b: list[int]) -> bool:
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------------------------------
# Files and backends per target
# ---------------------------------------------------------------------------------------------


def test_files_of_each_target(model_dir: Path) -> None:
    cpu = set(repository_files(TARGETS["cpu"], model_dir, FACTS))
    gpu = set(repository_files(TARGETS["gpu"], model_dir, FACTS))
    common = {
        "llm/config.pbtxt",
        "llm/1/engine_args.json",
        "preprocess/config.pbtxt",
        "vit_encoder/config.pbtxt",
        "encode/config.pbtxt",
    }
    common |= {  # EPD stages: generated configs + engine args (their model.py files are kept)
        "prefill/config.pbtxt",
        "prefill/1/engine_args.json",
        "decode/config.pbtxt",
        "decode/1/engine_args.json",
        "epd/config.pbtxt",
        "epd/1/engine_args.json",  # its colocated path's engine
    }
    common |= {"ensemble/config.pbtxt"}  # static DAG: encode's steps -> llm
    # encoder_0/1/model.py is kept (the source every encoder_<i> copies), not generated
    common |= {"encoder_0/config.pbtxt", "encoder_1/config.pbtxt", "encoder_1/1/model.py"}
    assert cpu == common
    assert gpu == common | {"vit_positions/config.pbtxt", "vit_positions/1/model.py"}
    for target in TARGETS.values():  # the description's model list is what gets written
        assert {p.split("/")[0] for p in repository_files(target, model_dir, FACTS)} == set(target.models)


GENERATE_AND_DIGEST = """
import hashlib, json, sys
from pathlib import Path
from builders.repository import TARGETS, EncoderFacts, repository_files
facts = EncoderFacts(**json.loads(sys.argv[2]))
files = {t: repository_files(TARGETS[t], Path(sys.argv[1]), facts) for t in sorted(TARGETS)}
print(hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest())
"""


def test_generation_is_the_same_in_every_process(model_dir: Path) -> None:
    """Stamps and the idempotent write rely on it: a config whose text depends on the process
    (set or hash order, e.g. parameters rendered from a set) would be rewritten by every build
    and restart every server that watches the repository. String hashing differs per
    PYTHONHASHSEED, so processes with different seeds must write the same bytes."""
    import json
    import subprocess
    import sys

    def digest(seed: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", GENERATE_AND_DIGEST, str(model_dir), json.dumps(vars(FACTS))],
            env={**os.environ, "PYTHONHASHSEED": seed},
            cwd=Path(repository.__file__).resolve().parent.parent,
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout.strip()

    digests = {seed: digest(seed) for seed in ("1", "2", "3")}
    assert len(set(digests.values())) == 1, digests


def test_cpu_preprocess_is_the_python_model_one_request_at_a_time(model_dir: Path) -> None:
    """Not batched: a request's 0..N encoded images (BYTES, optional, as llm takes them) -> every
    image's folded rows concatenated and one grid row per image."""
    config = configs("cpu", model_dir)["preprocess"]
    assert config.backend == "python" and config.max_batch_size == 0
    assert not config.HasField("dynamic_batching")
    image = tensor(config, "image")
    assert image.data_type == DataType.TYPE_STRING and list(image.dims) == [-1] and image.optional
    assert not image.allow_ragged_batch
    assert list(tensor(config, "pixel_values").dims) == [-1, FACTS.image_patch_dim]  # folded image rows
    assert list(tensor(config, "image_grid_thw").dims) == [-1, 3]
    assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["image_backend"] == "torchvision"
    assert params["pipeline_file"] == "model.dali"
    assert Path(params["preprocessor_config"]) == model_dir / "preprocessor_config.json"
    limits = TARGETS["cpu"].limits
    assert int(params["max_image_pixels"]) == limits["max_image_pixels"]
    assert int(params["max_image_bytes"]) == limits["max_image_bytes"]
    per_request = int(params["max_images_per_request"])  # llm enforces its own max_images on the embeddings
    assert per_request == contract.default_of(contract.MAX_IMAGES_PER_REQUEST) >= limits["max_images"]
    text = repository_files(TARGETS["cpu"], model_dir, FACTS)["preprocess/config.pbtxt"]
    assert "Not batched" in text and "dynamic_batching" not in text


def test_gpu_preprocess_is_the_dali_backend(model_dir: Path) -> None:
    gpu = configs("gpu", model_dir)["preprocess"]
    assert gpu.backend == "dali" and gpu.HasField("dynamic_batching")
    assert gpu.max_batch_size == TARGETS["gpu"].encode.max_batch_size > 0
    assert gpu.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    # The DALI backend's interface: one image per batch row, its bytes as UINT8, rows ragged.
    image = tensor(gpu, "image")
    assert image.data_type == DataType.TYPE_UINT8 and list(image.dims) == [-1] and image.allow_ragged_batch
    assert list(tensor(gpu, "pixel_values").dims) == [-1, FACTS.image_patch_dim]
    assert list(tensor(gpu, "image_grid_thw").dims) == [3]
    # Output order is the pipeline's (the DALI backend maps outputs by position).
    from python_backends.preprocess.image_pipeline import OUTPUT_NAMES

    assert tuple(o.name for o in gpu.output) == OUTPUT_NAMES


def test_cpu_vit_encoder_runs_onnx_runtime_one_request_at_a_time(model_dir: Path) -> None:
    config = configs("cpu", model_dir)["vit_encoder"]
    assert config.backend == "python" and config.max_batch_size == 0 and not config.HasField("dynamic_batching")
    pixels = tensor(config, "pixel_values")
    assert not pixels.allow_ragged_batch and list(pixels.dims) == [-1, -1]  # folded image or full video rows
    assert list(tensor(config, "image_grid_thw").dims) == [-1, 3]
    assert list(tensor(config, "image_embeds").dims) == [1, -1, FACTS.hidden_size]  # every image's tokens
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["onnx_file"] == "model.onnx" and params["vit_threads"] == "0"
    for name, value in vars(FACTS).items():  # shapes checked at load, provenance shown as metrics
        assert params[name] == str(value)


def test_cpu_encode_takes_a_requests_images(model_dir: Path) -> None:
    config = configs("cpu", model_dir)["encode"]
    assert config.platform == "ensemble" and config.max_batch_size == 0
    image = tensor(config, "image")
    assert image.data_type == DataType.TYPE_STRING and list(image.dims) == [-1]
    assert list(tensor(config, "image_embeds").dims) == [1, -1, FACTS.hidden_size]
    assert list(tensor(config, "image_grid_thw").dims) == [-1, 3]
    text = repository_files(TARGETS["cpu"], model_dir, FACTS)["encode/config.pbtxt"]
    assert "0..N encoded images per request" in text


def one_image_grid(patches: int, merge_size: int) -> np.ndarray:
    """A one-frame grid of ``patches`` patches (sides multiples of the merge size)."""
    return np.array([[1, merge_size, patches // merge_size]], dtype=np.int64)


def engine_input_shapes(patches: int) -> dict[str, list[int]]:
    """The plan's input shapes for one image of ``patches`` patches, as the serving code builds
    them: python_backends.encode.vit_onnx.encoder_calls, the function that feeds the exported graph
    (the ONNX Runtime model and, through vit_positions, the plan), with folded image rows as
    preprocess sends them. Independent of the builder."""
    grid = one_image_grid(patches, FACTS.merge_size)
    shape = VisionShape(FACTS.merge_size, FACTS.patch_dim, FACTS.patch_dim // FACTS.image_patch_dim, FACTS.hidden_size)
    (call,) = encoder_calls(np.zeros((patches, FACTS.image_patch_dim), np.float32), grid, shape)
    return {name: list(getattr(call, name).shape) for name in VIT_INPUT_NAMES}


def test_gpu_vit_encoder_is_the_tensorrt_plan(model_dir: Path) -> None:
    config = configs("gpu", model_dir)["vit_encoder"]
    profile = TARGETS["gpu"].encode.trt_profile
    assert config.platform == "tensorrt_plan" and config.max_batch_size == 0
    # The engine's inputs and output are the exported graph's (vit_onnx names them).
    assert [i.name for i in config.input] == list(VIT_INPUT_NAMES)
    assert [o.name for o in config.output] == [VIT_OUTPUT_NAME]
    # One image per request: pixel_values is the engine's own [frames 1, patches, folded row]
    # (no reshape); image_embeds has a leading 1 on the wire, the engine's [tokens, hidden] inside.
    pixels, positions = tensor(config, "pixel_values"), tensor(config, "rotary_pos_ids")
    embeds = tensor(config, "image_embeds")
    assert list(pixels.dims) == [1, -1, FACTS.image_patch_dim] and not pixels.HasField("reshape")
    assert list(positions.dims) == [-1, 2] and not positions.HasField("reshape")
    assert list(embeds.dims) == [1, -1, FACTS.hidden_size] and list(embeds.reshape.shape) == [-1, FACTS.hidden_size]
    # CUDA graphs are captured at the shapes the TensorRT backend gives setInputShape: the
    # engine's own, as vit_onnx.encoder_calls builds them (a graph in other dims would never
    # match the engine's inputs, and would silently never be captured); opt == max: one graph.
    cuda = config.optimization.cuda
    assert cuda.graphs
    graphs = [{name: list(shape.dim) for name, shape in spec.input.items()} for spec in cuda.graph_spec]
    assert graphs == [engine_input_shapes(p) for p in sorted({profile.opt_patches, profile.max_patches})]
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["precision"] == TARGETS["gpu"].encode.trt_precision
    assert params["profile_max_patches"] == str(profile.max_patches)
    assert "profile_max_images" not in params  # one image per call: nothing to size by images


def test_gpu_vit_positions_feeds_the_plan(model_dir: Path) -> None:
    """``vit_positions`` gives the plan one image's rotary ids, the rows vit_onnx.encoder_calls
    feeds the ONNX graph, and refuses a grid the plan's profile (one frame) cannot take."""
    import types

    from python_backends.errors import EpdError

    config = configs("gpu", model_dir)["vit_positions"]
    assert config.backend == "python" and config.max_batch_size == 0
    assert list(tensor(config, "image_grid_thw").dims) == [1, 3]
    assert [o.name for o in config.output] == ["rotary_pos_ids"]
    assert list(tensor(config, "rotary_pos_ids").dims) == [-1, 2]
    module = types.ModuleType("vit_positions_model")
    exec(repository_files(TARGETS["gpu"], model_dir, FACTS)["vit_positions/1/model.py"], module.__dict__)
    model = module.TritonPythonModel()
    model.merge_size = FACTS.merge_size  # what setup reads from the config's parameters
    grid = one_image_grid(24, FACTS.merge_size)
    shape = VisionShape(FACTS.merge_size, FACTS.patch_dim, FACTS.patch_dim // FACTS.image_patch_dim, FACTS.hidden_size)
    (call,) = encoder_calls(np.zeros((24, FACTS.image_patch_dim), np.float32), grid, shape)
    bad = ([[1, 2, 2], [1, 2, 2]], [[2, 2, 2]], [[1, 3, 2]])  # two images, a video, a side off the merge grid
    results = model.run([{"image_grid_thw": grid}, *({"image_grid_thw": np.array(g)} for g in bad)])
    np.testing.assert_array_equal(results[0]["rotary_pos_ids"], call.rotary_pos_ids)
    for result in results[1:]:
        assert isinstance(result, EpdError) and "one image's grid" in str(result)


def assert_wired(models: dict[str, Config], name: str) -> list[str]:
    """What Triton checks at load, checked here for the target we cannot load (gpu): every
    ensemble tensor has one producer, reaches its consumers with the same type and a
    compatible shape, every required input of a step is fed (optional ones may be left out),
    and the ensemble's own inputs/outputs match the models they touch. Returns the steps."""
    ensemble = models[name]
    assert ensemble.platform == "ensemble"
    known: dict[str, tuple[int, list[int]]] = {
        i.name: (i.data_type, full_shape(ensemble, i)) for i in ensemble.input
    }
    for step in ensemble.ensemble_scheduling.step:
        model = models[step.model_name]
        assert ensemble.max_batch_size <= model.max_batch_size or model.max_batch_size == 0
        for model_input, ensemble_name in step.input_map.items():
            assert ensemble_name in known, f"{step.model_name}.{model_input} reads {ensemble_name} before it exists"
            data_type, shape = known[ensemble_name]
            entry = tensor(model, model_input)
            assert entry.data_type == data_type, f"{step.model_name}.{model_input}"
            assert compatible(full_shape(model, entry), shape), f"{step.model_name}.{model_input}: {shape}"
        assert {i.name for i in model.input if not i.optional} <= set(step.input_map) <= {i.name for i in model.input}
        for model_output, ensemble_name in step.output_map.items():
            assert ensemble_name not in known, f"{ensemble_name} is produced twice"
            entry = tensor(model, model_output)
            known[ensemble_name] = (entry.data_type, full_shape(model, entry))
    for output in ensemble.output:
        data_type, shape = known[output.name]
        assert output.data_type == data_type and compatible(full_shape(ensemble, output), shape), output.name
    return [s.model_name for s in ensemble.ensemble_scheduling.step]


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_encode_ensemble_is_wired_consistently(target: str, model_dir: Path) -> None:
    models = configs(target, model_dir)
    steps = assert_wired(models, "encode")
    assert steps == [m for m in TARGETS[target].encode.models if m != "encode"]
    for step in models["encode"].ensemble_scheduling.step:  # every encode input is fed
        assert {i.name for i in models[step.model_name].input} == set(step.input_map)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_ensemble_is_encode_then_llm_with_embeddings_by_value(target: str, model_dir: Path) -> None:
    models = configs(target, model_dir)
    ensemble, encode, llm = models["ensemble"], models["encode"], models["llm"]
    steps = assert_wired(models, "ensemble")
    assert steps == [s.model_name for s in encode.ensemble_scheduling.step] + ["llm"]
    assert list(ensemble.ensemble_scheduling.step)[:-1] == list(encode.ensemble_scheduling.step)
    last = ensemble.ensemble_scheduling.step[-1]
    # Embeddings by value into llm; the raw image never reaches it.
    assert last.input_map["image_embeds"] == "image_embeds" and last.input_map["image_grid_thw"] == "image_grid_thw"
    assert "image" not in last.input_map
    assert ensemble.max_batch_size == 0
    image = tensor(ensemble, "image")
    text = repository_files(TARGETS[target], model_dir, FACTS)["ensemble/config.pbtxt"]
    llm_inputs = {i.name: i for i in llm.input}
    if target == "cpu":
        # 0 to max_images images per request, exactly as llm takes them (optional BYTES [n]).
        assert image.data_type == DataType.TYPE_STRING and list(image.dims) == [-1] and image.optional
        assert image == llm_inputs["image"]
        assert "0 to max_images encoded images per request" in text
    else:
        # One image per request, as the gpu target's encode takes it (a static DAG cannot loop).
        assert image.data_type == DataType.TYPE_UINT8 and list(image.dims) == [1, -1] and not image.optional
        assert "exactly one image per request" in text
    # The user interface is llm's, less the alternatives to images.
    assert [o for o in ensemble.output] == [o for o in llm.output]
    for entry in ensemble.input:
        if entry.name != "image":
            assert entry == llm_inputs[entry.name], entry.name
    # ... and less the in-band abort: a control request could not get through encode's steps.
    assert {i.name for i in llm.input} - {i.name for i in ensemble.input} == {
        "image_embeds", "image_grid_thw", "video", "request_id", "abort"
    }
    # Streaming through the ensemble: its last step is the decoupled llm.
    assert llm.model_transaction_policy.decoupled


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_llm_takes_embeddings_checked_against_the_encoder(target: str, model_dir: Path) -> None:
    import json

    files = repository_files(TARGETS[target], model_dir, FACTS)
    llm = configs(target, model_dir)["llm"]
    embeds, grid, image = tensor(llm, "image_embeds"), tensor(llm, "image_grid_thw"), tensor(llm, "image")
    assert embeds.optional and grid.optional and image.optional
    assert embeds.data_type == DataType.TYPE_FP32 and list(embeds.dims) == [-1, -1, FACTS.hidden_size]
    assert grid.data_type == DataType.TYPE_INT64 and list(grid.dims) == [-1, 3]
    params = {k: v.string_value for k, v in llm.parameters.items()}
    assert params["image_embeds_hidden_size"] == str(FACTS.hidden_size)
    assert params["spatial_merge_size"] == str(FACTS.merge_size)
    assert json.loads(files["llm/1/engine_args.json"])["enable_mm_embeds"] is True


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_llm_and_epd_take_video_with_their_limits(target: str, model_dir: Path) -> None:
    import json

    from python_backends.request.videos import CPU_CODECS, GPU_CODECS, VideoLimits, VideoSamplingConfig

    files = repository_files(TARGETS[target], model_dir, FACTS)
    llm = configs(target, model_dir)["llm"]
    video = tensor(llm, "video")
    assert video.optional and video.data_type == DataType.TYPE_STRING and list(video.dims) == [-1]
    params = {k: v.string_value for k, v in llm.parameters.items()}
    limits, sampling = VideoLimits(), VideoSamplingConfig()
    assert params["max_videos"] == str(limits.max_videos)
    assert params["max_video_bytes"] == str(limits.max_video_bytes)
    assert float(params["max_video_seconds"]) == limits.max_video_seconds
    assert params["max_frames"] == str(sampling.max_frames)
    assert params["video_codecs"] == ",".join(CPU_CODECS if target == "cpu" else GPU_CODECS)
    engine = json.loads(files["llm/1/engine_args.json"])
    assert engine["limit_mm_per_prompt"] == {"image": 4, "video": limits.max_videos}
    # epd takes video on cpu (its engines profile it; its encoders encode it); not on gpu, where
    # it would need the DALI backend's NVDEC pipeline (issue 16).
    epd_videos = limits.max_videos if target == "cpu" else 0
    built = configs(target, model_dir)
    for other in ("prefill", "decode", "epd"):
        mm_limits = json.loads(files[f"{other}/1/engine_args.json"])["limit_mm_per_prompt"]
        assert mm_limits == ({"image": 4, "video": epd_videos} if epd_videos else {"image": 4}), other
    for model in ("epd", *TARGETS[target].cache.encoder_models):
        # Declared where the model takes video only (test_video_input_is_declared_iff_max_videos_above_0).
        assert ("video" in {i.name for i in built[model].input}) == (epd_videos > 0), model
        model_params = {k: v.string_value for k, v in built[model].parameters.items()}
        assert model_params["max_videos"] == str(epd_videos), model
        assert model_params["max_frames"] == str(sampling.max_frames), model  # the keys' sampling = llm's
    for stage in ("prefill", "decode"):  # references only, never media
        assert "video" not in {i.name for i in built[stage].input}, stage


def video_inputs(target: Target, model_dir: Path) -> dict[str, bool]:
    """Model name -> whether its generated config declares the ``video`` input."""
    files = repository_files(target, model_dir, FACTS)
    parsed = [text_format.Parse(text, Config()) for path, text in files.items() if path.endswith("config.pbtxt")]
    return {config.name: "video" in {i.name for i in config.input} for config in parsed}


@pytest.mark.parametrize("max_videos", [None, 0, 1])
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_video_input_is_declared_iff_max_videos_above_0(target: str, max_videos: int | None, model_dir: Path) -> None:
    """A model that takes no video (``max_videos`` 0) does not declare ``video``: perf_analyzer
    2.41's ``--shared-memory`` refuses a model whose optional inputs its data leaves out (issue 15),
    and a video sent anyway is refused by Triton as an unexpected input."""
    import json

    described = TARGETS[target]
    if max_videos is not None:
        described = dataclasses.replace(
            described, video_limits={**described.video_limits, contract.MAX_VIDEOS: max_videos}
        )
    llm_videos = int(described.video_limits[contract.MAX_VIDEOS])
    epd_videos = int(epd_video_limits(described)[contract.MAX_VIDEOS])
    assert epd_videos == (0 if target == "gpu" else llm_videos)  # epd takes no video on gpu (issue 16)
    declared = video_inputs(described, model_dir)
    assert declared["llm"] == (llm_videos > 0)
    for model in ("epd", *described.cache.encoder_models):
        assert declared[model] == (epd_videos > 0), model
    assert {model for model, has in declared.items() if has} <= {"llm", "epd", *described.cache.encoder_models}
    files = repository_files(described, model_dir, FACTS)
    for model, videos in (("llm", llm_videos), ("epd", epd_videos), ("prefill", epd_videos), ("decode", epd_videos)):
        engine = json.loads(files[f"{model}/1/engine_args.json"])
        assert engine["limit_mm_per_prompt"].get("video", 0) == videos, model


def test_write_repository_max_videos_0_is_an_image_only_repository(
    tmp_path: Path, model_dir: Path, fast_build: None
) -> None:
    out, stamps = tmp_path / "repo", tmp_path / "stamps"
    write_repository("cpu", model_dir, out, stamps, max_videos=0)
    for model in ("llm", "epd", "encoder_0", "encoder_1"):
        config = text_format.Parse((out / model / "config.pbtxt").read_text(), Config())
        assert "video" not in {i.name for i in config.input}, model
        assert {k: v.string_value for k, v in config.parameters.items()}["max_videos"] == "0", model
    write_repository("cpu", model_dir, out, stamps)  # the target's again: video declared
    assert 'name: "video"' in (out / "epd" / "config.pbtxt").read_text()
    with pytest.raises(ValueError, match="max_videos must be 0 \\(no video\\) or more, not -1"):
        write_repository("cpu", model_dir, out, stamps, max_videos=-1)


def test_max_videos_option_reaches_the_repository(
    monkeypatch: pytest.MonkeyPatch, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from builders import launcher

    calls: list[dict[str, object]] = []
    monkeypatch.setattr(repository, "write_repository", lambda *a, **kw: calls.append(kw) or [])
    repository.main(["--model", str(model_dir), "--out", str(tmp_path), "--max-videos", "0"])
    assert launcher.parse_args(["--max-videos", "0"]).max_videos == 0
    launcher.prepare("cpu", model_dir, tmp_path, max_videos=0)
    repository.main(["--model", str(model_dir), "--out", str(tmp_path)])
    assert [call["max_videos"] for call in calls] == [0, 0, None]  # None: the target's
    with pytest.raises(SystemExit):
        launcher.parse_args(["--max-videos", "-1"])
    assert "--max-videos: must be 0 (no video) or more, not -1" in capsys.readouterr().err


def test_one_image_request_has_the_same_output_shapes_on_both_targets(model_dir: Path) -> None:
    """``encode``'s outputs for one image have the same wire shapes on both targets; the input
    differs: a request's images as BYTES [n] on cpu, one image's bytes as UINT8 [1, bytes] on gpu
    (the encoders pick by their ``encode_one_image`` parameter)."""
    cpu, gpu = configs("cpu", model_dir)["encode"], configs("gpu", model_dir)["encode"]
    assert cpu.max_batch_size == gpu.max_batch_size == 0
    for name in ("image_embeds", "image_grid_thw"):
        assert compatible(list(tensor(cpu, name).dims), list(tensor(gpu, name).dims)), name
        assert tensor(cpu, name).data_type == tensor(gpu, name).data_type
    assert tensor(cpu, "image").data_type == DataType.TYPE_STRING and list(tensor(cpu, "image").dims) == [-1]
    assert tensor(gpu, "image").data_type == DataType.TYPE_UINT8 and list(tensor(gpu, "image").dims) == [1, -1]
    for target, one_image in (("cpu", "False"), ("gpu", "True")):
        encoder = configs(target, model_dir)["encoder_0"]
        assert encoder.parameters["encode_one_image"].string_value == one_image, target


# ---------------------------------------------------------------------------------------------
# Templates
# ---------------------------------------------------------------------------------------------


def test_missing_placeholder_value_fails(tmp_path: Path) -> None:
    (tmp_path / "t.pbtxt").write_text('name: "${name}"\nmax_batch_size: ${max_batch_size}\n')
    with pytest.raises(ValueError, match="no value for placeholder 'max_batch_size'"):
        render_template("t.pbtxt", {"name": "x"}, templates=tmp_path)


def test_leftover_placeholder_fails(tmp_path: Path) -> None:
    (tmp_path / "t.pbtxt").write_text('name: "${name}"\n')
    # A value that itself holds a placeholder (e.g. a half-rendered fragment) must not pass.
    with pytest.raises(ValueError, match=r"unfilled placeholders \['\$\{patch_dim\}'\]"):
        render_template("t.pbtxt", {"name": "${patch_dim}"}, templates=tmp_path)


def test_every_real_template_needs_its_values(model_dir: Path) -> None:
    for template in sorted(repository.TEMPLATES.glob("*.pbtxt")):
        with pytest.raises(ValueError, match="no value for placeholder"):
            render_template(template.name, {})


# ---------------------------------------------------------------------------------------------
# The repository folder
# ---------------------------------------------------------------------------------------------


def test_write_repository_switches_targets_cleanly(tmp_path: Path, model_dir: Path, fast_build: None) -> None:
    out, stamps = tmp_path / "repo", tmp_path / "stamps"
    write_repository("gpu", model_dir, out, stamps)
    assert (out / "vit_positions" / "1" / "model.py").is_file()
    assert (out / "encode" / "1").is_dir()  # Triton needs the ensemble's version folder
    written = write_repository("cpu", model_dir, out, stamps, cache=CachePolicy(encoders=3))
    assert (out / "encoder_2" / "config.pbtxt").is_file()
    written = write_repository("cpu", model_dir, out, stamps)
    assert not (out / "vit_positions").exists()  # gpu-only model gone, nothing half-left
    assert not (out / "encoder_2").exists()  # an encoder the description no longer has
    assert all(path.exists() for path in written)
    assert 'backend: "python"' in (out / "preprocess" / "config.pbtxt").read_text()
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    write_repository("cpu", model_dir, out, stamps)  # idempotent: nothing rewritten
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_every_store_user_gets_the_one_cache_policy(target: str, model_dir: Path) -> None:
    parsed = configs(target, model_dir)
    policy = TARGETS[target].cache
    users = ["epd", "prefill", "decode", *policy.encoder_models]
    for name in users:
        params = {k: v.string_value for k, v in parsed[name].parameters.items()}
        for key, value in policy.to_parameters().items():
            assert params[key] == str(value), (name, key)
    epd = {k: v.string_value for k, v in parsed["epd"].parameters.items()}
    encoder = {k: v.string_value for k, v in parsed["encoder_0"].parameters.items()}
    assert epd["encoder_models"] == "encoder_0,encoder_1"
    # Both compute content keys from the same files: the same image is the same key.
    for key in ("encoder_file", "preprocessor_config"):
        assert epd[key] == encoder[key], key
    assert encoder["encoder_file"].endswith("model.plan" if target == "gpu" else "model.onnx")
    assert parsed["encoder_0"].model_transaction_policy.decoupled
    assert [t.name for t in parsed["encoder_0"].output] == [
        "references", "mm_hash", "cache_hit", "error", "image_embeds", "image_grid_thw", "embedding_digest"
    ]  # fmt: skip
    for stage in ("encoder_0", "prefill", "decode"):  # epd asks BLS stages for errors as outputs
        assert tensor(parsed[stage], "errors_as_outputs").optional
        assert tensor(parsed[stage], "error").data_type == DataType.TYPE_STRING


def test_cache_policy_overrides_and_checks(model_dir: Path) -> None:
    target = dataclasses.replace(TARGETS["cpu"], cache=CachePolicy(scope="instance", encoders=3, ttl_s=60))
    files = repository_files(target, model_dir, FACTS)
    assert "encoder_2/config.pbtxt" in files
    epd = text_format.Parse(files["epd/config.pbtxt"], Config())
    params = {k: v.string_value for k, v in epd.parameters.items()}
    assert params["cache_scope"] == "instance" and params["store_ttl_s"] == "60"
    with pytest.raises(ContractError, match="encoders must be at least 1"):
        CachePolicy(encoders=0)
    with pytest.raises(ContractError, match="scope must be 'node' or 'instance'"):
        CachePolicy(scope="cluster")  # type: ignore[arg-type]


def test_unknown_target_is_refused(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown target 'tpu'"):
        write_repository("tpu", model_dir, tmp_path)


def test_gpu_plan_config_follows_the_checkpoints_pixel_limits(model_dir: Path) -> None:
    """What write_repository serves: the target fitted to the checkpoint; the plan's profile and
    its CUDA graphs come from the checkpoint's min/max pixels, graphs in the engine's input dims."""
    target = TARGETS["gpu"].fitted_to_checkpoint(model_dir)
    profile = target.encode.trt_profile
    assert (profile.min_patches, profile.opt_patches) == (16, 1024)  # 56*56 and 448*448 pixels / 14**2
    config = text_format.Parse(repository_files(target, model_dir, FACTS)["vit_encoder/config.pbtxt"], Config())
    specs = config.optimization.cuda.graph_spec
    graphs = [{name: list(shape.dim) for name, shape in spec.input.items()} for spec in specs]
    assert graphs == [engine_input_shapes(1024)]  # opt == max: one image at max_pixels
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["profile_min_patches"] == "16" and params["profile_max_patches"] == "1024"


def test_engine_threads_reach_every_engine(tmp_path: Path, model_dir: Path, fast_build: None) -> None:
    out, stamps = tmp_path / "repo", tmp_path / "stamps"
    engines = ("llm", "epd", "prefill", "decode")

    def omp_threads() -> set[str | None]:
        values = set()
        for model in engines:
            config = text_format.Parse((out / model / "config.pbtxt").read_text(), Config())
            parameters = {k: v.string_value for k, v in config.parameters.items()}
            values.add(parameters.get("OMP_NUM_THREADS"))
        return values

    write_repository("cpu", model_dir, out, stamps)
    assert omp_threads() == {"1"}  # the cpu target's default
    write_repository("cpu", model_dir, out, stamps, engine_threads=0)
    assert omp_threads() == {None}  # torch's default: the variable is not set at all
    write_repository("cpu", model_dir, out, stamps, engine_threads=2)
    assert omp_threads() == {"2"}
    with pytest.raises(SystemExit):
        repository.main(["--model", str(model_dir), "--out", str(out), "--engine-threads", "-1"])


def test_vit_precision_reaches_the_encoder_and_every_content_key(
    tmp_path: Path, model_dir: Path, fast_build: None
) -> None:
    """bf16 (OpenVINO) embeddings are other embeddings of the same graph file: the encoder runs it
    and every model that computes content keys covers it; the gpu target refuses it (its plan
    has a precision of its own)."""
    out, stamps = tmp_path / "repo", tmp_path / "stamps"

    def precision_of(model: str) -> str | None:
        config = text_format.Parse((out / model / "config.pbtxt").read_text(), Config())
        return {k: v.string_value for k, v in config.parameters.items()}.get("vit_precision")

    write_repository("cpu", model_dir, out, stamps)
    assert {precision_of(m) for m in ("vit_encoder", "encoder_0", "epd")} == {"fp32"}
    repository.main(["--model", str(model_dir), "--out", str(out), "--vit-precision", "bf16"])
    assert {precision_of(m) for m in ("vit_encoder", "encoder_0", "epd")} == {"bf16"}
    with pytest.raises(ValueError, match="for the cpu target"):
        write_repository("gpu", model_dir, tmp_path / "gpu", stamps, vit_precision="bf16")


def parameters_of(config: Config) -> dict[str, str]:
    return {k: v.string_value for k, v in config.parameters.items()}


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_llm_and_epd_carry_the_generation_config_auto_by_default(target: str, model_dir: Path) -> None:
    parsed = configs(target, model_dir)
    for model in ("llm", "epd"):
        assert parameters_of(parsed[model])[contract.GENERATION_CONFIG] == "auto", model
    for model in ("prefill", "decode"):  # epd applies the defaults before it forwards a request
        assert contract.GENERATION_CONFIG not in parameters_of(parsed[model]), model


def test_generation_config_reaches_llm_and_epd(tmp_path: Path, model_dir: Path, fast_build: None) -> None:
    out, stamps = tmp_path / "repo", tmp_path / "stamps"
    folder = tmp_path / "generation"
    folder.mkdir()
    (folder / "generation_config.json").write_text('{"temperature": 0.01, "top_k": 1}')

    def setting_of(model: str) -> str:
        return parameters_of(text_format.Parse((out / model / "config.pbtxt").read_text(), Config()))[
            contract.GENERATION_CONFIG
        ]

    for setting, expected in (("vllm", "vllm"), (str(folder), str(folder.resolve())), (None, "auto")):
        write_repository("cpu", model_dir, out, stamps, generation_config=setting)
        assert {setting_of("llm"), setting_of("epd")} == {expected}, setting
    with pytest.raises(ValueError, match="neither 'auto', 'vllm' nor a folder: pass 'auto'"):
        write_repository("cpu", model_dir, out, stamps, generation_config="greedy")
    (tmp_path / "empty").mkdir()  # a folder neither model could read fails the build, not the load
    with pytest.raises(ValueError, match="holds neither generation_config.json nor config.json"):
        write_repository("cpu", model_dir, out, stamps, generation_config=str(tmp_path / "empty"))


def test_generation_config_option_of_the_launcher_and_the_builder_reaches_the_repository(
    monkeypatch: pytest.MonkeyPatch, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from builders import launcher

    calls: list[dict[str, object]] = []
    monkeypatch.setattr(repository, "write_repository", lambda *a, **kw: calls.append(kw) or [])
    (tmp_path / "generation").mkdir()
    monkeypatch.chdir(tmp_path)  # a relative folder is made absolute
    absolute = str((tmp_path / "generation").resolve())
    repository.main(["--model", str(model_dir), "--out", str(tmp_path), "--generation-config", "vllm"])
    repository.main(["--model", str(model_dir), "--out", str(tmp_path), "--generation-config", "generation"])
    repository.main(["--model", str(model_dir), "--out", str(tmp_path)])
    assert launcher.parse_args([]).generation_config == "auto"  # vllm serve's default
    assert launcher.parse_args(["--generation-config", "generation"]).generation_config == absolute
    launcher.prepare("cpu", model_dir, tmp_path, generation_config=absolute)
    assert [call["generation_config"] for call in calls] == ["vllm", absolute, "auto", absolute]
    for parse in (launcher.parse_args, lambda argv: repository.main(["--model", str(model_dir), *argv])):
        with pytest.raises(SystemExit):
            parse(["--generation-config", "greedy"])
        assert "--generation-config: generation_config 'greedy' is neither 'auto', 'vllm' nor a folder: pass" in (
            capsys.readouterr().err
        )
    with pytest.raises(SystemExit):
        launcher.parse_args(["--help"])
    assert "If set to 'vllm', no generation config is loaded, vLLM defaults will be used." in " ".join(
        capsys.readouterr().out.split()
    )


def test_main_of_the_launcher_passes_the_generation_config_to_prepare(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from builders import launcher

    seen: dict[str, object] = {}

    def fake_prepare(*args: object, **kwargs: object) -> Path:
        seen.update(kwargs)
        raise KeyboardInterrupt  # stop before anything starts

    monkeypatch.setattr(launcher, "prepare", fake_prepare)
    monkeypatch.setattr(launcher, "install_stop_handlers", lambda: None)
    assert launcher.main(["--generation-config", "vllm", "--model-repository", str(tmp_path)]) == 130
    assert seen["generation_config"] == "vllm"


def test_an_audio_checkpoints_llm_and_epd_carry_the_generation_config() -> None:
    from builders.default_model import DEFAULT_AUDIO_MODEL_DIR, build_default_model
    from builders.model_configs import audio_repository_files

    audio_model = build_default_model(DEFAULT_AUDIO_MODEL_DIR, recipe="qwen2-audio")
    target = TARGETS["cpu"].with_generation_config("vllm")
    files = audio_repository_files(target, audio_model)
    for model in ("llm", "epd"):
        config = text_format.Parse(files[f"{model}/config.pbtxt"], Config())
        assert parameters_of(config)[contract.GENERATION_CONFIG] == "vllm", model

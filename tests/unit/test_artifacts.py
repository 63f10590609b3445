"""Binary artefacts of the repository (builders/artifacts.py): built once, rebuilt when an input
or a built file changed, never left half-built; the DALI pipeline per target; checkpoint sizes
read from safetensors headers alone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from builders.artifacts import (
    build_dali_artifact,
    build_video_dali_artifact,
    ensure_artifact,
    safetensors_tensor_bytes,
)
from builders.targets import TARGETS

PATCH_DIM = 588  # the default model's folded rows: 3 * 14 * 14


def test_artifact_is_built_once_and_rebuilt_when_stale(tmp_path: Path) -> None:
    builds: list[int] = []

    def build(scratch: Path) -> dict:
        builds.append(1)
        (scratch / "model.bin").write_bytes(b"x" * (10 + len(builds)))
        return {"builds": len(builds)}

    version_dir, stamps = tmp_path / "m" / "1", tmp_path / "stamps"
    assert ensure_artifact(version_dir, "bin", {"a": 1}, build, stamps) == ({"builds": 1}, True)
    assert ensure_artifact(version_dir, "bin", {"a": 1}, build, stamps) == ({"builds": 1}, False)
    assert ensure_artifact(version_dir, "bin", {"a": 2}, build, stamps)[1]  # an input changed
    (version_dir / "model.bin").write_bytes(b"edited by hand")
    assert ensure_artifact(version_dir, "bin", {"a": 2}, build, stamps)[1]  # the file changed
    (version_dir / "model.bin").unlink()
    assert ensure_artifact(version_dir, "bin", {"a": 2}, build, stamps)[1]  # the file is gone
    assert len(builds) == 4 and (version_dir / "model.bin").is_file()
    assert not [p for p in stamps.iterdir() if p.is_dir()]  # no scratch folder left behind


def test_failed_build_leaves_no_stamp(tmp_path: Path) -> None:
    def broken(scratch: Path) -> dict:
        (scratch / "model.bin").write_bytes(b"half")
        raise RuntimeError("exporter crashed")

    with pytest.raises(RuntimeError, match="exporter crashed"):
        ensure_artifact(tmp_path / "m" / "1", "bin", {}, broken, tmp_path / "stamps")
    assert not (tmp_path / "m" / "1" / "model.bin").exists()
    assert not list((tmp_path / "stamps").glob("*.json"))


def test_dali_artifact_per_target(tmp_path: Path, model_dir: Path) -> None:
    version_dir, stamps = tmp_path / "preprocess" / "1", tmp_path / "stamps"
    report, built = build_dali_artifact(TARGETS["cpu"], model_dir, version_dir, stamps)
    assert built and report["device"] == "cpu" and report["patch_dim"] == PATCH_DIM
    cpu_bytes = (version_dir / "model.dali").read_bytes()
    assert not build_dali_artifact(TARGETS["cpu"], model_dir, version_dir, stamps)[1]
    assert build_dali_artifact(TARGETS["gpu"], model_dir, version_dir, stamps)[1]  # another device
    gpu_bytes = (version_dir / "model.dali").read_bytes()
    assert b"mixed" in gpu_bytes and b"mixed" not in cpu_bytes


def test_video_dali_artifact_per_target_and_it_runs(tmp_path: Path, model_dir: Path) -> None:
    """video.dali beside model.dali: built once per target, and the cpu one serves a clip
    exactly as the pipeline serialized in process does."""
    from python_backends.preprocess.video_pipeline import VideoTransformConfig
    from python_backends.preprocess.videos import DaliVideoPreprocessor
    from tests.videos import ClipSpec, make_clip

    version_dir, stamps = tmp_path / "preprocess" / "1", tmp_path / "stamps"
    report, built = build_video_dali_artifact(TARGETS["cpu"], model_dir, version_dir, stamps)
    assert built and report["device"] == "cpu"
    cpu_bytes = (version_dir / "video.dali").read_bytes()
    assert not build_video_dali_artifact(TARGETS["cpu"], model_dir, version_dir, stamps)[1]
    transform = VideoTransformConfig.from_file(model_dir)
    clip = make_clip(ClipSpec("vp9", 96, 64, 10, 1))
    from_file = DaliVideoPreprocessor(cpu_bytes, transform).preprocess([clip])
    in_process = DaliVideoPreprocessor.for_config(transform).preprocess([clip])
    assert (from_file.pixel_values_videos == in_process.pixel_values_videos).all()
    assert build_video_dali_artifact(TARGETS["gpu"], model_dir, version_dir, stamps)[1]  # another device
    gpu_bytes = (version_dir / "video.dali").read_bytes()
    assert b"mixed" in gpu_bytes and b"mixed" not in cpu_bytes


def test_dali_artifact_is_rebuilt_when_the_importable_dali_changes(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gpu image's DALI is the dali backend's bundled copy (no nvidia-dali-cuda120 there): the
    stamp follows whatever ``import nvidia.dali`` finds, so a new image over an old repository
    volume serializes the pipeline again with its own DALI."""
    import builders.preflight

    version_dir, stamps = tmp_path / "preprocess" / "1", tmp_path / "stamps"
    assert build_dali_artifact(TARGETS["gpu"], model_dir, version_dir, stamps)[1]
    assert not build_dali_artifact(TARGETS["gpu"], model_dir, version_dir, stamps)[1]
    assert build_video_dali_artifact(TARGETS["gpu"], model_dir, version_dir, stamps)[1]
    monkeypatch.setattr(builders.preflight, "importable_dali_version", lambda: "1.51.2")
    for build in (build_dali_artifact, build_video_dali_artifact):
        assert build(TARGETS["gpu"], model_dir, version_dir, stamps)[1]
        assert not build(TARGETS["gpu"], model_dir, version_dir, stamps)[1]


def test_safetensors_bytes_from_header(model_dir: Path) -> None:
    from safetensors import safe_open

    shard = next(model_dir.glob("*.safetensors"))
    with safe_open(str(shard), framework="pt") as handle:
        expected = sum(handle.get_tensor(k).numel() * handle.get_tensor(k).element_size() for k in handle.keys())
    assert safetensors_tensor_bytes(shard) == expected
    assert expected <= os.path.getsize(shard)

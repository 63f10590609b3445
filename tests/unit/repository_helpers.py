"""What the tests of the generated repository share (test_repository, test_roles, test_contract,
test_gpu_target): the encoder facts of the tiny default model and a stand-in for the artefact
builds. Their fixtures (``model_dir``, ``fast_build``) are in conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from builders import repository
from builders.repository import EncoderFacts
from python_backends import contract

# What the tiny default model's encoder export reports, without exporting it.
FACTS = EncoderFacts(
    patch_dim=1176,
    image_patch_dim=588,
    hidden_size=128,
    merge_size=2,
    vision_shards=1,
    checkpoint_shards=2,
    vision_weight_bytes=3_502_592,
    checkpoint_weight_bytes=5_800_960,
)


def fake_onnx_build(model_dir: Path, version_dir: Path, stamp_dir: Path) -> tuple[EncoderFacts, dict, bool]:
    """Stands in for ``repository.build_onnx_artifact``: a placeholder model.onnx, written (and
    reported built) only when there is none, like the real build when nothing changed."""
    version_dir.mkdir(parents=True, exist_ok=True)
    onnx = version_dir / contract.ONNX_FILE
    built = not onnx.exists()
    if built:
        onnx.write_bytes(b"onnx")
    return FACTS, {"parity_max_abs": 0.0}, built


def fake_audio_build(model_dir: Path, version_dir: Path, stamp_dir: Path) -> dict:
    """Stands in for ``repository.build_audio_artifacts``: placeholder model.onnx and audio.dali."""
    version_dir.mkdir(parents=True, exist_ok=True)
    for name in (contract.ONNX_FILE, contract.AUDIO_DALI_FILE):
        (version_dir / name).write_bytes(b"placeholder")
    return {"parity_max_abs": 0.0}


def fake_artifact_builds(patch: pytest.MonkeyPatch) -> None:
    """The ONNX exports (seconds; tested in test_encoder_export.py, test_tiny_audio.py and by the
    server sessions) and the TensorRT build replaced; the rest of ``write_repository`` is the real
    build."""
    patch.setattr(repository, "build_onnx_artifact", fake_onnx_build)
    patch.setattr(repository, "build_audio_artifacts", fake_audio_build)
    patch.setattr(repository, "build_plan_artifact", lambda *args, **kwargs: False)
    patch.setattr(repository, "build_audio_plan_artifact", lambda *args, **kwargs: False)

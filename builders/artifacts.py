"""Binary artefacts of the repository, built once: ``model.dali``, ``model.onnx``, ``model.plan``.

A stamp under ``build/stamps/`` records a digest of everything an artefact depends on
(checkpoint files, preprocessor config, builder sources, library versions), so a rebuild of
an up-to-date repository takes well under a second and a changed input rebuilds only what
depends on it. Heavy libraries (DALI, torch, TensorRT) are imported only when a build runs.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from builders.checkpoint import EncoderFacts
from builders.targets import RepositoryBuildError, Target
from builders.tensorrt_config import AudioTrtProfile, ShapeRange
from python_backends import contract

if TYPE_CHECKING:
    from builders.checkpoint import Precision

LOGGER = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_STAMPS = REPO_ROOT / "build" / "stamps"


# ---------------------------------------------------------------------------------------------
# Stamps
# ---------------------------------------------------------------------------------------------


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _dali_version() -> str:
    """The version of the DALI that ``import nvidia.dali`` finds, whichever distribution holds it (the
    NGC image's is the dali backend's bundled copy, found through PYTHONPATH)."""
    from builders.preflight import importable_dali_version  # it imports this module

    return importable_dali_version() or "absent"


def _tensorrt_version() -> str:
    """TensorRT's own version: PyPI's tensorrt-cu13 installs no distribution named ``tensorrt``."""
    from builders.preflight import installed_version

    return installed_version("tensorrt") or "absent"


def _source_digest(*relative: str) -> str:
    return _digest({name: file_sha256(REPO_ROOT / name) for name in relative})


def ensure_artifact(
    version_dir: Path,
    kind: str,
    inputs: dict[str, Any],
    build: Callable[[Path], dict[str, Any]],
    stamp_dir: Path = DEFAULT_STAMPS,
) -> tuple[dict[str, Any], bool]:
    """Run ``build(scratch_dir)`` and move what it wrote into ``version_dir``, unless the stamp
    of ``version_dir``/``kind`` says the same ``inputs`` built the files that are there now.

    Returns (the build's report, whether it built). A file changed or removed since its build
    (size or mtime differ) makes the artefact stale too.
    """
    version_dir = Path(version_dir).resolve()
    digest = _digest(inputs)
    stamp_path = stamp_dir / f"{kind}-{hashlib.sha1(str(version_dir).encode()).hexdigest()[:16]}.json"
    stamp = json.loads(stamp_path.read_text()) if stamp_path.is_file() else None
    if stamp and stamp.get("inputs") == digest and _files_unchanged(version_dir, stamp.get("files", {})):
        return stamp["report"], False
    stamp_dir.mkdir(parents=True, exist_ok=True)
    version_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=stamp_dir, prefix=f"{kind}-") as scratch:
        report = build(Path(scratch))
        produced = sorted(p for p in Path(scratch).iterdir() if p.is_file())
        if not produced:
            raise RepositoryBuildError(f"building {kind} for {version_dir} wrote no file")
        for path in produced:
            shutil.move(str(path), str(version_dir / path.name))
    files = {p.name: _file_state(version_dir / p.name) for p in produced}
    stamp_path.write_text(json.dumps({"inputs": digest, "files": files, "report": report}, indent=2) + "\n")
    return report, True


def _file_state(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def _files_unchanged(version_dir: Path, files: dict[str, list[int]]) -> bool:
    return bool(files) and all(
        (version_dir / name).is_file() and _file_state(version_dir / name) == state for name, state in files.items()
    )


def safetensors_tensor_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file, from its header alone."""
    with path.open("rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_len))
    return sum(
        end - begin for key, entry in header.items() if key != "__metadata__" for begin, end in [entry["data_offsets"]]
    )


def checkpoint_fingerprint(model_dir: Path) -> dict[str, Any]:
    """What the exported encoder depends on in a checkpoint, without reading weights."""
    small = {
        name: file_sha256(model_dir / name)
        for name in ("config.json", "preprocessor_config.json", "model.safetensors.index.json")
        if (model_dir / name).is_file()
    }
    shards = {p.name: _file_state(p) for p in sorted(model_dir.glob("*.safetensors"))}
    return {"files": small, "shards": shards}


# ---------------------------------------------------------------------------------------------
# The three artefacts
# ---------------------------------------------------------------------------------------------


def build_dali_artifact(
    target: Target, model_dir: Path, version_dir: Path, stamp_dir: Path = DEFAULT_STAMPS
) -> tuple[dict[str, Any], bool]:
    from python_backends.preprocess.image_pipeline import write_pipeline
    from python_backends.preprocess.processor import ImageTransformConfig

    serving = target.encode
    config = ImageTransformConfig.from_file(model_dir)
    inputs = {
        "transform": asdict(config),
        "device": serving.device,
        "max_batch_size": serving.max_batch_size,
        # The DALI that serializes: the cpu target's nvidia-dali-cuda120, the gpu image's dali backend copy.
        "dali": _dali_version(),
        "source": _source_digest(
            "python_backends/preprocess/image_pipeline.py", "python_backends/preprocess/processor.py"
        ),
    }

    def build(scratch: Path) -> dict[str, Any]:
        path = write_pipeline(scratch / contract.DALI_FILE, config, serving.device, serving.max_batch_size)
        LOGGER.info("serialized the DALI pipeline for %s (%d bytes)", serving.device, path.stat().st_size)
        return {"device": serving.device, "bytes": path.stat().st_size, "patch_dim": config.folded_patch_dim}

    return ensure_artifact(version_dir, "dali", inputs, build, stamp_dir)


def build_video_dali_artifact(
    target: Target, model_dir: Path, version_dir: Path, stamp_dir: Path = DEFAULT_STAMPS
) -> tuple[dict[str, Any], bool]:
    """``video.dali`` beside ``model.dali``: the video pipeline for the target's decoder (cpu,
    or mixed/NVDEC on gpu), from the checkpoint's video processor config."""
    from python_backends.preprocess.video_pipeline import VideoTransformConfig, write_video_pipeline

    serving = target.encode
    config = VideoTransformConfig.from_file(model_dir)
    inputs = {
        "transform": asdict(config),
        "device": serving.device,
        "dali": _dali_version(),
        "source": _source_digest(
            "python_backends/preprocess/video_pipeline.py", "python_backends/preprocess/image_pipeline.py",
            "python_backends/preprocess/processor.py",
        ),
    }

    def build(scratch: Path) -> dict[str, Any]:
        path = write_video_pipeline(scratch / contract.VIDEO_DALI_FILE, config, serving.device)
        LOGGER.info("serialized the DALI video pipeline for %s (%d bytes)", serving.device, path.stat().st_size)
        return {"device": serving.device, "bytes": path.stat().st_size}

    return ensure_artifact(version_dir, "dali-video", inputs, build, stamp_dir)


def build_onnx_artifact(
    model_dir: Path, version_dir: Path, stamp_dir: Path = DEFAULT_STAMPS
) -> tuple[EncoderFacts, dict[str, Any], bool]:
    inputs = {
        "checkpoint": checkpoint_fingerprint(model_dir),
        "source": _source_digest("builders/encoder.py", "builders/checkpoint.py", "python_backends/encode/vit_onnx.py"),
        "versions": {p: _version(p) for p in ("torch", "onnx", "onnxscript", "transformers", "onnxruntime")},
    }

    def build(scratch: Path) -> dict[str, Any]:
        # torch and transformers: only when the encoder is exported.
        from builders.encoder import (
            export_onnx,
            load_vision_tower,
            load_vision_weights,
            tower_dims,
            validate_onnx,
            vision_shard_plan,
        )
        from python_backends.preprocess.processor import ImageTransformConfig

        weights = load_vision_weights(model_dir)
        tower = load_vision_tower(model_dir, weights)
        dims = tower_dims(tower)
        transform_patch_dim = ImageTransformConfig.from_file(model_dir).patch_dim
        if dims["patch_dim"] != transform_patch_dim:
            raise RepositoryBuildError(
                f"{model_dir}: the vision config gives {dims['patch_dim']} values per patch, "
                f"preprocessor_config.json {transform_patch_dim}; the checkpoint is inconsistent"
            )
        path = export_onnx(tower, scratch)
        parity = validate_onnx(path, tower)
        if not parity.ok:
            raise RepositoryBuildError(
                f"ONNX Runtime differs from torch by {parity.worst:.2e} (> {parity.tolerance:.0e}) on {model_dir}"
            )
        _, total = vision_shard_plan(model_dir)
        shard_files = sorted({p.name for p in model_dir.glob("*.safetensors")})
        facts = EncoderFacts(
            patch_dim=dims["patch_dim"],
            image_patch_dim=dims["patch_dim"] // dims["temporal_patch_size"],
            hidden_size=dims["hidden_size"],
            merge_size=dims["merge_size"],
            vision_shards=len(weights.shard_files_read),
            checkpoint_shards=total,
            vision_weight_bytes=sum(t.numel() * t.element_size() for t in weights.tensors.values()),
            checkpoint_weight_bytes=sum(safetensors_tensor_bytes(model_dir / name) for name in shard_files),
        )
        LOGGER.info(
            "exported the vision encoder: %d of %d shard files read (%s) in %.2f s, "
            "%.1f MB of %.1f MB weights; ONNX Runtime vs torch max-abs %.1e over %d grid batches",
            facts.vision_shards, facts.checkpoint_shards, ", ".join(weights.shard_files_read), weights.seconds,
            facts.vision_weight_bytes / 1e6, facts.checkpoint_weight_bytes / 1e6, parity.worst, len(parity.grids),
        )
        return {
            **asdict(facts),
            "shard_files_read": list(weights.shard_files_read),
            "vision_load_seconds": weights.seconds,
            "parity_max_abs": parity.worst,
        }

    report, built = ensure_artifact(version_dir, "onnx", inputs, build, stamp_dir)
    return EncoderFacts.from_report(report), report, built


def build_plan_artifact(
    target: Target,
    facts: EncoderFacts,
    version_dir: Path,
    onnx_report: dict[str, Any],
    stamp_dir: Path = DEFAULT_STAMPS,
) -> bool:
    """``vit_encoder``'s TensorRT plan where TensorRT imports (the NGC image); elsewhere a warning, no plan."""
    profile = target.encode.trt_profile
    return _plan_artifact(
        contract.VIT_ENCODER_MODEL, version_dir, onnx_report, stamp_dir, kind="plan",
        input_shapes=lambda: profile.input_shapes(facts.image_patch_dim), profile=asdict(profile),
        precision=target.encode.trt_precision, export_sources=("builders/encoder.py",),
    )  # fmt: skip


def build_audio_plan_artifact(
    target: Target,
    profile: AudioTrtProfile,
    version_dir: Path,
    onnx_report: dict[str, Any],
    stamp_dir: Path = DEFAULT_STAMPS,
) -> bool:
    """``audio_encoder``'s TensorRT plan (``profile``: ``model_configs.audio_plan_profile``), as
    :func:`build_plan_artifact` builds ``vit_encoder``'s: where TensorRT and a GPU exist, else a
    warning and no plan (it is built at the first start on a GPU)."""
    return _plan_artifact(
        contract.AUDIO_ENCODER_MODEL, version_dir, onnx_report, stamp_dir, kind="plan-audio",
        input_shapes=profile.input_shapes, profile=asdict(profile), precision=target.encode.trt_precision,
        export_sources=("builders/audio_encoder.py",),
    )  # fmt: skip


def _plan_artifact(
    model: str,
    version_dir: Path,
    onnx_report: dict[str, Any],
    stamp_dir: Path,
    *,
    kind: str,
    input_shapes: Callable[[], dict[str, ShapeRange]],
    profile: dict[str, Any],
    precision: Precision,
    export_sources: tuple[str, ...],
) -> bool:
    """``model``'s ``model.plan`` from the ``model.onnx`` beside it, stamped as ``kind`` with the
    graph's digest, the profile (``profile``, recorded; ``input_shapes``, its engine shapes), the
    precision and TensorRT's version. Returns whether it built; False with a warning (not an
    error: the image build has TensorRT but no GPU) where TensorRT or a GPU is missing."""
    from builders.tensorrt_plan import build_tensorrt_plan, tensorrt_unavailable_reason

    reason = tensorrt_unavailable_reason()
    if reason:
        LOGGER.warning(
            "%s/1/%s not built: %s. Run `python -m builders.repository --target gpu` there; "
            "Triton cannot load %s (nor the models that call it) until then.", model, contract.PLAN_FILE, reason, model,
        )  # fmt: skip
        return False
    onnx_path = Path(version_dir) / contract.ONNX_FILE
    inputs = {
        "onnx": file_sha256(onnx_path),
        "precision": precision,
        "profile": profile,
        "tensorrt": _tensorrt_version(),
        "source": _source_digest(*export_sources, "builders/tensorrt_plan.py", "builders/tensorrt_config.py"),
    }

    def build(scratch: Path) -> dict[str, Any]:
        build_tensorrt_plan(onnx_path, scratch / contract.PLAN_FILE, input_shapes(), precision)
        return {"precision": precision, "profile": profile, "onnx_parity": onnx_report.get("parity_max_abs")}

    _, built = ensure_artifact(version_dir, kind, inputs, build, stamp_dir)
    return built


# ONNX Runtime against torch on the audio encoder: measured within 2e-5 (docs/benchmarks/audio-parity.md).
AUDIO_ONNX_TOLERANCE = 1e-4


def build_audio_artifacts(model_dir: Path, version_dir: Path, stamp_dir: Path = DEFAULT_STAMPS) -> dict[str, Any]:
    """An audio checkpoint's ``audio_encoder/1``: ``model.onnx`` (encoder + projector with vLLM's
    padding mask, from the encoder shard only; checked against torch) and ``audio.dali`` (the
    Whisper features pipeline from the checkpoint's feature extractor config). Returns the ONNX
    build's report."""
    from python_backends.preprocess.audio_pipeline import AudioFeatureConfig, serialize_audio_pipeline

    config = AudioFeatureConfig.from_dict(json.loads((model_dir / "preprocessor_config.json").read_text()))
    dali_inputs = {
        "features": asdict(config),
        "dali": _dali_version(),
        "source": _source_digest("python_backends/preprocess/audio_pipeline.py"),
    }

    def build_dali(scratch: Path) -> dict[str, Any]:
        path = scratch / contract.AUDIO_DALI_FILE
        path.write_bytes(serialize_audio_pipeline(config, decode=False))
        return {"bytes": path.stat().st_size}

    ensure_artifact(version_dir, "dali-audio", dali_inputs, build_dali, stamp_dir)
    onnx_inputs = {
        "checkpoint": checkpoint_fingerprint(model_dir),
        "source": _source_digest("builders/audio_encoder.py", "builders/checkpoint.py", "builders/tiny_audio.py"),
        "versions": {p: _version(p) for p in ("torch", "onnx", "onnxscript", "transformers", "onnxruntime")},
    }

    def build_onnx(scratch: Path) -> dict[str, Any]:
        import numpy as np

        from builders.audio_encoder import export_onnx, max_abs_difference

        path = export_onnx(model_dir, scratch)
        rng = np.random.default_rng(0)
        features = rng.standard_normal((3, config.feature_size, config.frames)).astype(np.float32)
        lengths = np.array([config.frames, config.frames // 3, 101], dtype=np.int64)
        difference = max_abs_difference(model_dir, path, features, lengths)
        if difference > AUDIO_ONNX_TOLERANCE:
            raise RepositoryBuildError(
                f"the audio encoder under ONNX Runtime differs from torch by {difference:.2e} on {model_dir}"
            )
        LOGGER.info("exported the audio encoder; ONNX Runtime vs torch max-abs %.1e", difference)
        return {"parity_max_abs": difference}

    report, _ = ensure_artifact(version_dir, "onnx-audio", onnx_inputs, build_onnx, stamp_dir)
    return report

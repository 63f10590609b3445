"""Write the Triton model repository for a target (``cpu`` or ``gpu``).

One description per target (``builders/targets.py``, :data:`TARGETS`) is the single source of
truth; the builder is split along its seams:

- ``python_backends/contract.py``: every model's tensors and parameter keys with their defaults
  (the runtime reads the same module);
- ``builders/targets.py``: what differs per target, and the cache policy's command-line overrides;
- ``builders/pbtxt.py``: the strict template renderer (``builders/templates/*.pbtxt``; any
  unfilled placeholder fails the build), tensors, parameters, ensemble steps;
- ``builders/model_configs.py``: each model's files;
- ``builders/tensorrt_config.py``: the gpu ``vit_encoder`` and ``audio_encoder`` (TensorRT plan) configs;
- ``builders/artifacts.py``: ``model.dali``, ``model.onnx`` and ``model.plan``, built once
  (stamps under ``build/stamps/``).

This module writes them into the repository folder (the generated files are git-ignored) and
is the command line: ``python -m builders.repository --target cpu --model DIR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

from builders.artifacts import (
    DEFAULT_STAMPS,
    REPO_ROOT,
    EncoderFacts,
    build_audio_artifacts,
    build_audio_plan_artifact,
    build_dali_artifact,
    build_onnx_artifact,
    build_plan_artifact,
    build_video_dali_artifact,
    ensure_artifact,
    safetensors_tensor_bytes,
)
from builders.default_model import is_audio_checkpoint
from builders.model_configs import audio_plan_profile, audio_repository_files, repository_files
from builders.pbtxt import TEMPLATES, render_template
from builders.roles import ROLES, Role, add_cpus_argument, model_cpu_sets, role_models
from builders.targets import (
    PD_MODELS,
    TARGETS,
    EncodeServing,
    PdServing,
    RepositoryBuildError,
    Target,
    add_cache_arguments,
    add_colocated_encodes_argument,
    add_engine_threads_argument,
    add_generation_config_argument,
    add_gpus_argument,
    add_max_videos_argument,
    add_vit_precision_argument,
    cache_policy_from,
    resolved_target,
)
from python_backends import contract
from python_backends.contract import DALI_FILE, DISAGGREGATED_PATH, ONNX_FILE, VIDEO_DALI_FILE, CachePolicy

# What callers of this module (the launcher, benchmarks, tests) import from it.
__all__ = [
    "DEFAULT_REPOSITORY",
    "DEFAULT_STAMPS",
    "TARGETS",
    "TEMPLATES",
    "CachePolicy",
    "EncodeServing",
    "EncoderFacts",
    "PdServing",
    "ROLES",
    "RepositoryBuildError",
    "Role",
    "Target",
    "add_cache_arguments",
    "add_colocated_encodes_argument",
    "add_vit_precision_argument",
    "add_cpus_argument",
    "add_engine_threads_argument",
    "add_generation_config_argument",
    "add_gpus_argument",
    "add_max_videos_argument",
    "build_audio_plan_artifact",
    "build_dali_artifact",
    "build_onnx_artifact",
    "build_plan_artifact",
    "cache_policy_from",
    "ensure_artifact",
    "main",
    "render_template",
    "repository_files",
    "safetensors_tensor_bytes",
    "write_repository",
]

LOGGER = logging.getLogger(__name__)

DEFAULT_REPOSITORY = REPO_ROOT / "model_repository"


def _prune_other_models(models: Iterable[str], out: Path) -> list[Path]:
    """Remove generated files of models other than ``models`` (e.g. gpu's ``vit_positions`` when
    the cpu repository is written over a gpu one, or every image model for an audio checkpoint)."""
    removed = []
    encoders = {p.name for p in out.glob("encoder_*") if re.fullmatch(r"encoder_\d+", p.name)}
    others = ({m for t in TARGETS.values() for m in t.models} | encoders) - set(models)
    for model in sorted(others):
        model_dir = out / model
        candidates = [model_dir / "config.pbtxt", model_dir / "1" / "model.py"]
        for path in candidates:
            if path.is_file():
                path.unlink()
                removed.append(path)
        for folder in (model_dir / "1" / "__pycache__", model_dir / "1", model_dir):
            if folder.is_dir() and folder.name == "__pycache__":
                shutil.rmtree(folder)
            elif folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
    return removed


def _model_of(relative: str) -> str:
    return relative.split("/", 1)[0]


def write_repository(
    target_name: str,
    model_dir: Path,
    out: Path = DEFAULT_REPOSITORY,
    stamp_dir: Path = DEFAULT_STAMPS,
    cache: CachePolicy | None = None,
    kv_store_path: str | Path | None = None,
    role: Role = "all",
    gpus: int | None = None,
    remote_encoders: str = "",
    path_policy: str | None = None,
    test_pauses: dict[str, str] | None = None,
    max_videos: int | None = None,
    engine_threads: int | None = None,
    cpus: Sequence[str] = (),
    colocated_encodes: str | None = None,
    vit_precision: str | None = None,
    generation_config: str | None = None,
) -> list[Path]:
    """Build the artefacts (once) and write every generated file; returns the paths written.
    ``cache`` replaces the target's cache policy (e.g. per-instance caches for a benchmark),
    ``kv_store_path`` its prefill -> decode KV transfer folder (e.g. one per test server).
    ``role`` (``builders/roles.py``): write only that role's models and remove the generated
    files of the others; the encoder artefacts stay, as ``epd`` keys images by their digest.
    ``gpus``: the gpu target's number of GPUs (``Target.with_gpus``).
    ``remote_encoders``: epd's remote encoder servers (``python_backends/scaleout/endpoints.py``).
    ``path_policy``: epd's path policy (``PdServing.path_policy``; None: the target's, except
    that a server with remote encoders is ``disaggregated``: its encoders are what it scales
    out, and the colocated path would run a fourth engine that encodes in place).
    ``test_pauses``: test servers only, model name -> ``test_pauses`` JSON (stage_pauses.py).
    ``max_videos``: the videos per request of every model that takes video (None: the target's);
    0: an image-only repository, where no model declares the ``video`` input (perf_analyzer
    2.41's ``--shared-memory`` needs every optional input covered by its data).
    ``engine_threads``: OpenMP threads per vLLM engine (None: the target's; 0: torch's default).
    ``cpus``: ``--cpus`` specs, the models' CPU sets (``builders/roles.py`` model_cpu_sets).
    ``colocated_encodes``: who encodes epd's colocated misses (``PdServing.colocated_encodes``).
    ``vit_precision``: the cpu target's vision encoder precision (``EncodeServing.vit_precision``).
    ``generation_config``: ``llm``'s and ``epd``'s sampling defaults, ``auto``, ``vllm`` or a folder
    (``Target.with_generation_config``; None: the target's, ``auto``)."""
    target = resolved_target(target_name, model_dir, cache, kv_store_path, gpus)
    if max_videos is not None:
        if max_videos < 0:
            raise ValueError(f"max_videos must be 0 (no video) or more, not {max_videos}")
        target = dataclasses.replace(target, video_limits={**target.video_limits, contract.MAX_VIDEOS: max_videos})
    if engine_threads is not None:
        target = target.with_engine_threads(engine_threads)
    if remote_encoders:
        # An ``all`` server serves its own encoder models: epd falls back to them when no remote
        # encoder is left; a ``pd`` server has none and answers UNAVAILABLE instead.
        pd = dataclasses.replace(target.pd, remote_encoders=remote_encoders, remote_local_fallback=role == "all")
        target = dataclasses.replace(target, pd=pd)
    if path_policy is None and remote_encoders:
        path_policy = DISAGGREGATED_PATH
    if path_policy is not None:
        target = dataclasses.replace(target, pd=dataclasses.replace(target.pd, path_policy=path_policy))
    if test_pauses:
        target = dataclasses.replace(target, test_pauses=dict(test_pauses))
    if colocated_encodes is not None:
        target = dataclasses.replace(target, pd=dataclasses.replace(target.pd, colocated_encodes=colocated_encodes))
    if vit_precision is not None:
        target = target.with_vit_precision(vit_precision)
    if generation_config is not None:
        target = target.with_generation_config(generation_config)
    if cpus:
        target = dataclasses.replace(target, cpu_sets=model_cpu_sets(target, cpus, role))
    model_dir = Path(model_dir).resolve()
    out = Path(out)
    if is_audio_checkpoint(model_dir):
        return _write_audio_repository(target, model_dir, out, role, stamp_dir)
    _prune_other_models(target.models, out)

    _, dali_built = build_dali_artifact(target, model_dir, out / "preprocess" / "1", stamp_dir)
    build_video_dali_artifact(target, model_dir, out / "preprocess" / "1", stamp_dir)
    facts, onnx_report, onnx_built = build_onnx_artifact(model_dir, out / "vit_encoder" / "1", stamp_dir)
    LOGGER.info(
        "%s: %s; %s", target.name,
        f"{DALI_FILE} " + ("built" if dali_built else "up to date"),
        f"{ONNX_FILE} " + ("built" if onnx_built else "up to date"),
    )
    if target.encode.device == "gpu":
        build_plan_artifact(target, facts, out / "vit_encoder" / "1", onnx_report, stamp_dir)

    written = [
        out / "preprocess" / "1" / DALI_FILE,
        out / "preprocess" / "1" / VIDEO_DALI_FILE,
        out / "vit_encoder" / "1" / ONNX_FILE,
    ]
    return written + _write_files(out, role_models(target, role), repository_files(target, model_dir, facts))


def _write_audio_repository(
    target: Target, model_dir: Path, out: Path, role: Role, stamp_dir: Path = DEFAULT_STAMPS
) -> list[Path]:
    """An audio checkpoint's repository: ``llm`` with the ``audio`` input, ``audio_encoder``, the
    ``encoder_<i>`` models that write clips' embeddings to the store, and ``epd`` with ``prefill``
    and ``decode`` serving from their references. The image models (their artefacts are the
    vision tower's) are not written, and their folders go.

    On gpu ``audio_encoder`` is the TensorRT plan of the same ONNX graph, built here where
    TensorRT and a GPU exist (else at the first start on one); the engines' args and the store
    (CUDA memory) are the target's, as for an image checkpoint."""
    if role != "all":
        raise RepositoryBuildError(
            f"an audio checkpoint is served by one server (--role all), not --role {role}: "
            "its encode path does not run on encoder servers yet"
        )
    if out.resolve() == DEFAULT_REPOSITORY.resolve():
        raise RepositoryBuildError(
            f"an audio checkpoint's repository goes in a folder of its own (e.g. --model-repository "
            f"build/repo-audio): {DEFAULT_REPOSITORY.name}/ holds the image models' code"
        )
    served = (contract.LLM_MODEL, contract.AUDIO_ENCODER_MODEL, *target.cache.encoder_models, *PD_MODELS)
    # Triton loads every folder of the repository: an image model's artefacts left behind (its
    # model.onnx, model.dali) would be a model without a config, and the server would not start.
    image_models = {m for t in TARGETS.values() for m in t.models} | {p.name for p in out.glob("encoder_*")}
    for model in sorted(image_models - set(served)):
        shutil.rmtree(out / model, ignore_errors=True)
    artefacts = out / contract.AUDIO_ENCODER_MODEL / "1"
    onnx_report = build_audio_artifacts(model_dir, artefacts, stamp_dir)
    written = [artefacts / contract.ONNX_FILE, artefacts / contract.AUDIO_DALI_FILE]
    if target.encode.device == "gpu":
        build_audio_plan_artifact(target, audio_plan_profile(target, model_dir), artefacts, onnx_report, stamp_dir)
        # The cpu target's generated model.py, if that repository was here: the plan needs none.
        (artefacts / "model.py").unlink(missing_ok=True)
    return written + _write_files(out, served, audio_repository_files(target, model_dir))


def _write_files(out: Path, served: Sequence[str], files: dict[str, str]) -> list[Path]:
    """Write the generated ``files`` of the ``served`` models (and their kept model code when the
    repository is not model_repository/); remove the generated files of the others."""
    for model in served:  # an ensemble needs its (empty) version folder too
        (out / model / "1").mkdir(parents=True, exist_ok=True)
    written = _copy_kept_model_code(out, served)
    for relative in files:  # generated files only: kept model code and artefacts stay
        if _model_of(relative) not in served and (out / relative).is_file():
            (out / relative).unlink()
    for relative, content in files.items():
        if _model_of(relative) not in served:
            continue
        path = out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != content:
            path.write_text(content)
        written.append(path)
    return written


def _copy_kept_model_code(out: Path, served: Iterable[str]) -> list[Path]:
    """A repository other than model_repository/ (a role server's, a test's) gets the kept
    ``model.py`` of each model it serves, so that ``--model-repository DIR`` works anywhere."""
    if out.resolve() == DEFAULT_REPOSITORY.resolve():
        return []
    copied = []
    for model in served:
        source = DEFAULT_REPOSITORY / model / "1" / "model.py"
        if source.is_file():
            target = out / model / "1" / "model.py"
            if not target.is_file() or target.read_bytes() != source.read_bytes():
                shutil.copy2(source, target)
            copied.append(target)
    return copied


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=sorted(TARGETS), default="cpu")
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--out", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--role", choices=ROLES, default="all", help="write only this server role's models")
    add_cache_arguments(parser)
    add_gpus_argument(parser)
    parser.add_argument(
        "--path-policy", choices=contract.PATH_POLICIES, help="epd's path policy (default: the target's, adaptive)"
    )
    add_max_videos_argument(parser)
    add_engine_threads_argument(parser)
    add_cpus_argument(parser)
    add_colocated_encodes_argument(parser)
    add_vit_precision_argument(parser)
    add_generation_config_argument(parser)
    args = parser.parse_args(argv)
    if args.gpus is not None and args.target != "gpu":
        parser.error("--gpus is for --target gpu")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("onnx_ir").setLevel(logging.WARNING)  # one line per folded constant
    policy = cache_policy_from(args, args.target)
    written = write_repository(
        args.target, args.model, args.out, cache=policy, role=args.role, gpus=args.gpus, path_policy=args.path_policy,
        max_videos=args.max_videos, engine_threads=args.engine_threads, cpus=args.cpus,
        colocated_encodes=args.colocated_encodes, vit_precision=args.vit_precision,
        generation_config=args.generation_config,
    )
    for path in written:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

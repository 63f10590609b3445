"""Preflight of the ``gpu`` target: what must hold before tritonserver starts, each with a fix.

``triton-epd-serve --target gpu --check`` prints the report and exits; every gpu start runs it
after the repository is written and refuses to start tritonserver on a failed check (Triton
would stop at the first model it cannot load, with a message far from the cause).

The checks are plain functions of a :class:`Machine` (backend folder, installed packages, GPUs,
``/dev/shm``, the TensorRT plan loader), so tests give them fake backend folders and fake GPU
inventories; :func:`probe_machine` fills one in from the real machine. Where no GPU is visible
the checks that need one are reported as skipped, by name.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from builders.checkpoint import checkpoint_positions
from builders.default_model import is_audio_checkpoint
from builders.targets import ENCODE_ROLE, ENGINE_ROLES, Target, resolved_target
from python_backends import contract
from python_backends.contract import CachePolicy
from python_backends.engines.async_llm import ENGINE_START_ENV

# Triton backends the gpu repository loads: python (llm, prefill, decode, epd, encoders),
# dali (preprocess), tensorrt (vit_encoder's plan), onnxruntime (the ONNX fallback, the GPU check).
REQUIRED_BACKENDS = ("python", "dali", "tensorrt", "onnxruntime")
# The DALI that the NGC 25.10 image's dali backend runs: triton-inference-server/dali_backend's
# DALI_VERSION file reads 1.51.2 on its r25.10 branch (PR 277, 2025-08-28; 1.53.0 came with PR 282).
# The backend's build pip-installs that DALI into its own folder and the image puts the folder
# first on PYTHONPATH (server's build.py), so the image's `import nvidia.dali` is that copy: it
# serializes the pipeline, and nothing here installs another (requirements/gpu.txt says why).
# A pipeline serialized by another DALI may not load in the backend: `check_dali` compares them.
DALI_BACKEND_VERSION = "1.51.2"
DALI_PACKAGE = "nvidia-dali-cuda130"
DALI_BACKEND_PYTHONPATH = "/opt/tritonserver/backends/dali/wheel/dali"
# Package -> pinned version: vllm as requirements/gpu.txt pins it, tensorrt as docker/Dockerfile's
# TENSORRT_VERSION (unit tests keep them equal). DALI is the backend's own (`check_dali`).
PINNED_PACKAGES = {"vllm": "0.32.0", "tensorrt": "10.13.3.9"}
# Triton's python backend, the TransferIdConnector's KV folder and LMDB's metadata share
# /dev/shm with the store: room asked for on top of the store's capacity.
SHM_HEADROOM_BYTES = 1 << 30
DOCKER_FIX = "use the image built from docker/Dockerfile (README, Containers)"

Status = Literal["pass", "fail", "skip"]


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    compute_capability: str  # "9.0"


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""

    def describe(self) -> str:
        line = f"{self.status.upper():4} {self.name}: {self.detail}"
        return line + (f"\n     fix: {self.fix}" if self.status == "fail" and self.fix else "")


@dataclass
class Machine:
    """What the checks look at. ``gpus`` None: no GPU could be queried (no driver / nvidia-smi).
    ``plan_error``: loads a TensorRT plan on this GPU, returns why it cannot (None: it loads)."""

    backend_dir: Path
    versions: dict[str, str | None]
    gpus: list[Gpu] | None
    shm_total_bytes: int | None
    plan_error: Callable[[Path], str | None] | None = None
    gpu_probe_note: str = ""
    # The TensorRT the tensorrt backend links (from its libnvinfer file name), if found.
    backend_tensorrt: str | None = None
    # The DALI the dali backend runs, and the one ``import nvidia.dali`` finds (it serializes the
    # pipeline; the NGC image also puts the backend's own DALI on PYTHONPATH), if found.
    backend_dali: str | None = None
    importable_dali: str | None = None


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    no_gpu_note: str = ""

    @property
    def ok(self) -> bool:
        return all(check.status != "fail" for check in self.checks)

    @property
    def skipped(self) -> list[str]:
        return [check.name for check in self.checks if check.status == "skip"]

    def describe(self) -> str:
        lines = [check.describe() for check in self.checks]
        if self.no_gpu_note:
            lines.append(f"no GPU present ({self.no_gpu_note}): skipped {', '.join(self.skipped)}")
        failed = [check.name for check in self.checks if check.status == "fail"]
        lines.append(f"preflight: {'FAILED (' + ', '.join(failed) + ')' if failed else 'ok'}")
        return "\n".join(lines)


def check_backends(machine: Machine) -> Check:
    missing = [
        name for name in REQUIRED_BACKENDS if not (machine.backend_dir / name / f"libtriton_{name}.so").is_file()
    ]
    if missing:
        return Check(
            "backends", "fail", f"{', '.join(missing)} missing in {machine.backend_dir}",
            f"{DOCKER_FIX}: its NGC base ships python, dali, tensorrt and onnxruntime in /opt/tritonserver/backends",
        )
    return Check("backends", "pass", f"{', '.join(REQUIRED_BACKENDS)} in {machine.backend_dir}")


def check_packages(machine: Machine) -> Check:
    wrong = []
    for package, pinned in PINNED_PACKAGES.items():
        found = machine.versions.get(package)
        if found != pinned:
            wrong.append(f"{package} {found or 'not installed'} (pinned {pinned})")
    built_by, served_by = machine.versions.get("tensorrt"), machine.backend_tensorrt
    if built_by and served_by and not built_by.startswith(served_by):
        wrong.append(f"tensorrt {built_by} builds the plan but the tensorrt backend links TensorRT {served_by}")
    if wrong:
        return Check(
            "packages", "fail", "; ".join(wrong),
            f"pip install -r requirements/gpu.txt and tensorrt-cu13 (docker/Dockerfile), or {DOCKER_FIX}",
        )
    return Check("packages", "pass", ", ".join(f"{p}=={v}" for p, v in PINNED_PACKAGES.items()))


def check_dali(machine: Machine) -> Check:
    """The DALI that serializes the pipeline must be the one the dali backend runs."""
    backend, importable = machine.backend_dali, machine.importable_dali
    fix = f"use the dali backend's own DALI: put {DALI_BACKEND_PYTHONPATH} first on PYTHONPATH (the NGC image " \
          f"does) and pip uninstall any other {DALI_PACKAGE}; then rebuild the repository " \
          "(triton-epd-build-repo --target gpu) so that DALI serializes the pipeline"
    if backend is None:
        return Check("dali", "fail", f"no DALI version found in {machine.backend_dir / 'dali'}",
                     f"{DOCKER_FIX}: its dali backend bundles DALI {DALI_BACKEND_VERSION}")
    if importable is None:
        return Check("dali", "fail", f"nvidia.dali is not importable (the dali backend runs DALI {backend})", fix)
    if importable != backend:
        return Check("dali", "fail", f"nvidia.dali {importable} serializes the pipeline but the dali backend runs "
                     f"DALI {backend}: a pipeline from another DALI may not load", fix)
    return Check("dali", "pass", f"nvidia.dali {importable} = the dali backend's DALI")


def check_gpus(machine: Machine, target: Target) -> Check:
    assert target.gpu_budget is not None
    needed = target.gpu_budget.gpus
    if machine.gpus is None:
        return Check("gpus", "skip", "no GPU visible")
    if len(machine.gpus) < needed:
        return Check(
            "gpus", "fail", f"{len(machine.gpus)} GPU(s) visible, the layout uses {needed}",
            f"expose {needed} GPUs (docker run --gpus all, CUDA_VISIBLE_DEVICES) or choose the "
            f"{len(machine.gpus)}-GPU layout (Target.with_gpus)",
        )
    return Check("gpus", "pass", f"{len(machine.gpus)} visible, layout {target.gpu_budget.device_of}")


def check_memory(machine: Machine, target: Target) -> Check:
    """Planned share per GPU under the bound, the store's capacity inside the encode reserve,
    and the planned bytes free now (vLLM checks its share against free memory at start)."""
    budget = target.gpu_budget
    assert budget is not None
    if machine.gpus is None:
        return Check("memory", "skip", "no GPU visible")
    problems, planned = [], budget.planned_use()
    gpus = {gpu.index: gpu for gpu in machine.gpus}
    for index, share in planned.items():
        gpu = gpus.get(index)
        if gpu is None:
            continue  # reported by the gpus check
        if share > budget.bound:
            problems.append(f"GPU {index}: {share:.2f} of its memory planned")
        if gpu.free_bytes < share * gpu.total_bytes:
            problems.append(f"GPU {index}: {share:.2f} planned but {gpu.free_bytes / gpu.total_bytes:.2f} free")
    store_gpu = gpus.get(budget.device_of[ENCODE_ROLE])
    if store_gpu is not None and target.cache.device.startswith("cuda"):
        reserve = budget.encode_reserve * store_gpu.total_bytes
        if target.cache.capacity_bytes > reserve / 2:  # the other half: TensorRT, DALI, contexts
            problems.append(
                f"store capacity {target.cache.capacity_bytes} B is over half the encode reserve ({reserve:.0f} B)"
            )
    if problems:
        return Check(
            "memory", "fail", "; ".join(problems),
            "free the GPU (other processes), lower --cache-capacity-bytes, or raise GpuBudget.encode_reserve "
            "/ lower GpuBudget.bound in builders/targets.py",
        )
    shares = ", ".join(f"GPU {i}: {s:.2f}" for i, s in planned.items())
    return Check("memory", "pass", f"planned {shares} (bound {budget.bound} + encode reserve {budget.encode_reserve})")


def check_max_model_len(target: Target, model_dir: Path, repository: Path) -> Check:
    """Each engine's ``max_model_len`` (the written engine args, else the target's) vs positions."""
    positions = checkpoint_positions(model_dir)
    if positions is None:
        return Check("max_model_len", "skip", f"no max_position_embeddings in {model_dir}/config.json")
    over = []
    for role in ENGINE_ROLES:
        written = repository / role / "1" / "engine_args.json"
        config = repository / role / "config.pbtxt"
        # The written args when the repository is this target's, else what it would write.
        ours = config.is_file() and f"from the {target.name!r} target" in config.read_text()
        if ours and written.is_file():
            args = json.loads(written.read_text())
        else:
            args = target.engine_args_for(role, positions)
        if int(args.get("max_model_len", 0)) > positions:
            over.append(f"{role} {args['max_model_len']}")
    if over:
        return Check(
            "max_model_len", "fail", f"{', '.join(over)} > the checkpoint's {positions} positions",
            "regenerate the repository (triton-epd-build-repo --target gpu, or start triton-epd-serve once)",
        )
    return Check("max_model_len", "pass", f"every engine <= {positions} positions")


def check_plan(machine: Machine, repository: Path, model: str = contract.VIT_ENCODER_MODEL) -> Check:
    """``model``'s plan: ``vit_encoder``'s, or an audio checkpoint's ``audio_encoder``'s."""
    plan = repository / model / "1" / contract.PLAN_FILE
    if machine.gpus is None or machine.plan_error is None:
        return Check("plan", "skip", "no GPU (or no TensorRT) to load the plan on")
    if not plan.is_file():
        return Check(
            "plan", "fail", f"{plan} is missing",
            "start triton-epd-serve --target gpu once where TensorRT imports (the plan is built there, "
            "in the mounted repository volume)",
        )
    error = machine.plan_error(plan)
    if error:
        return Check("plan", "fail", f"{plan} does not load on this GPU: {error}",
                     f"remove {plan} and start again: it is rebuilt for this GPU")
    return Check("plan", "pass", f"{plan.name} loads on GPU {machine.gpus[0].name if machine.gpus else '?'}")


def check_shm(machine: Machine, target: Target) -> Check:
    if machine.shm_total_bytes is None:
        return Check("shm", "skip", "/dev/shm not found")
    needed = SHM_HEADROOM_BYTES + (0 if target.cache.device.startswith("cuda") else target.cache.capacity_bytes)
    if machine.shm_total_bytes < needed:
        return Check(
            "shm", "fail", f"/dev/shm is {machine.shm_total_bytes} B, the store and the python backend need {needed} B",
            f"docker run --shm-size={-(-needed // (1 << 30))}g (Docker's default is 64 MB)",
        )
    return Check("shm", "pass", f"/dev/shm {machine.shm_total_bytes} B >= {needed} B")


def check_spawn(target: Target) -> Check:
    # Our own start setting wins over vLLM's variable (python_backends/engines/async_llm.py).
    methods = {
        role: env.get(ENGINE_START_ENV) or env.get("VLLM_WORKER_MULTIPROC_METHOD")
        for role, env in ((role, target.role_environment(role)) for role in ENGINE_ROLES)
    }
    forked = [role for role, method in methods.items() if method != "spawn"]
    if forked:
        return Check("spawn", "fail", f"{', '.join(forked)} may fork a CUDA-initialised process",
                     "set VLLM_WORKER_MULTIPROC_METHOD=spawn in the target's vllm_env")
    return Check("spawn", "pass", "VLLM_WORKER_MULTIPROC_METHOD=spawn for every engine")


def run_checks(machine: Machine, target: Target, model_dir: Path, repository: Path) -> Report:
    report = Report(
        checks=[
            check_backends(machine),
            check_packages(machine),
            check_dali(machine),
            check_gpus(machine, target),
            check_memory(machine, target),
            check_plan(
                machine, repository,
                contract.AUDIO_ENCODER_MODEL if is_audio_checkpoint(model_dir) else contract.VIT_ENCODER_MODEL,
            ),  # fmt: skip
            check_max_model_len(target, model_dir, repository),
            check_shm(machine, target),
            check_spawn(target),
        ]
    )
    if machine.gpus is None:
        report.no_gpu_note = machine.gpu_probe_note or "no GPU could be queried"
    return report


def installed_version(package: str) -> str | None:
    """The installed version of ``package`` (None: not installed)."""
    if package == "tensorrt":  # PyPI's tensorrt-cu13 installs it under other distribution names
        if importlib.util.find_spec("tensorrt") is None:
            return None
        import tensorrt

        return str(tensorrt.__version__)
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def backend_tensorrt_version(backend_dir: Path) -> str | None:
    """``10.13.3`` from the newest ``libnvinfer.so.X.Y.Z`` next to the tensorrt backend or in the
    system library folder (where the NGC image keeps it)."""
    for folder in (backend_dir / "tensorrt", Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib/aarch64-linux-gnu")):
        found = sorted(folder.glob("libnvinfer.so.*.*.*")) if folder.is_dir() else []
        if found:
            return found[-1].name.removeprefix("libnvinfer.so.")
    return None


_DALI_VERSION_LINE = re.compile(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", re.M)


def dali_version_in(package_init: Path) -> str | None:
    """``__version__`` of a ``nvidia/dali/__init__.py``, read as text: importing DALI here could
    pick another copy and would load its CUDA libraries."""
    try:
        match = _DALI_VERSION_LINE.search(package_init.read_text(errors="replace"))
    except OSError:
        return None
    return match.group(1) if match else None


def backend_dali_version(backend_dir: Path) -> str | None:
    """The DALI bundled with the dali backend (its ``nvidia/dali`` package, e.g. under ``wheel/``)."""
    folder = backend_dir / "dali"
    if not folder.is_dir():
        return None
    for init in sorted(folder.glob("**/nvidia/dali/__init__.py")):
        version = dali_version_in(init)
        if version:
            return version
    return None


def importable_dali_version() -> str | None:
    spec = importlib.util.find_spec("nvidia.dali") if importlib.util.find_spec("nvidia") else None
    return dali_version_in(Path(spec.origin)) if spec is not None and spec.origin else None


def query_gpus() -> tuple[list[Gpu] | None, str]:
    """GPUs from nvidia-smi (no CUDA context made here); (None, why) where it cannot tell."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, "nvidia-smi not found"
    fields = "index,name,memory.total,memory.free,compute_cap"
    result = subprocess.run(
        [smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30
    )
    if result.returncode != 0:
        return None, f"nvidia-smi failed: {result.stderr.strip() or result.stdout.strip()}"
    gpus = []
    for line in result.stdout.strip().splitlines():
        index, name, total, free, capability = (part.strip() for part in line.split(","))
        gpus.append(Gpu(int(index), name, int(total) << 20, int(free) << 20, capability))
    return (gpus, "") if gpus else (None, "nvidia-smi lists no GPU")


def tensorrt_plan_error(plan: Path) -> str | None:
    """Why TensorRT cannot deserialize ``plan`` on GPU 0 (None: it can)."""
    import tensorrt as trt

    runtime = trt.Runtime(trt.Logger(trt.Logger.ERROR))
    engine = runtime.deserialize_cuda_engine(plan.read_bytes())
    return None if engine is not None else "deserialize_cuda_engine returned None (built for another GPU or TensorRT)"


def probe_machine(backend_dir: Path) -> Machine:
    gpus, note = query_gpus()
    shm = Path("/dev/shm")
    stats = os.statvfs(shm) if shm.is_dir() else None
    has_tensorrt = importlib.util.find_spec("tensorrt") is not None
    return Machine(
        backend_dir=backend_dir,
        versions={package: installed_version(package) for package in PINNED_PACKAGES},
        gpus=gpus,
        shm_total_bytes=stats.f_blocks * stats.f_frsize if stats else None,
        plan_error=tensorrt_plan_error if has_tensorrt else None,
        gpu_probe_note=note,
        backend_tensorrt=backend_tensorrt_version(backend_dir),
        backend_dali=backend_dali_version(backend_dir),
        importable_dali=importable_dali_version(),
    )


def preflight(target: Target, model_dir: Path, repository: Path, backend_dir: Path | None = None) -> Report:
    """Every check on this machine. ``backend_dir``: Triton's (default: the one the launcher uses)."""
    if backend_dir is None:
        from builders.tritonserver import NGC_BACKEND_DIR, find_tritonserver

        try:
            backend_dir = find_tritonserver().backend_dir
        except (RuntimeError, FileNotFoundError):
            backend_dir = NGC_BACKEND_DIR
    return run_checks(probe_machine(backend_dir), target, model_dir, repository)


def check_for_launch(
    target_name: str, model: Path | None, repository: Path, cache: CachePolicy | None = None, gpus: int | None = None
) -> Report:
    """The launcher's preflight: the target as ``write_repository`` resolves it (``gpus``: its
    GPU layout; ``model`` None: the tiny default model's folder, built or not)."""
    from builders.default_model import DEFAULT_MODEL_DIR

    if target_name != "gpu":
        return Report([Check("target", "fail", f"the preflight checks the gpu target, not {target_name!r}",
                             "triton-epd-serve --target gpu --check")])
    model_dir = Path(model) if model else DEFAULT_MODEL_DIR
    target = resolved_target(target_name, model_dir, cache, gpus=gpus)
    return preflight(target, model_dir, repository)


def print_report(report: Report) -> bool:
    print(report.describe(), flush=True)
    return report.ok

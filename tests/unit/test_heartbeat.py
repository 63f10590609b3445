"""A stub's heartbeat (python_backends/runtime/heartbeat.py) stops when its Python stops running.

Real processes: one holds the GIL in a C call that never gives it back (``ctypes.PyDLL`` keeps the
GIL during the call, as the deadlocked stub's thread did in ``Stub::GetResponseIterator``), the
other sleeps the ordinary way. Only the first one's heartbeat goes stale.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from python_backends.runtime.heartbeat import HEARTBEAT_DIR_ENV, heartbeat_age_s, start_heartbeat

PROCESS = """
import ctypes, sys, time
from pathlib import Path
from python_backends.runtime.heartbeat import Heartbeat
Heartbeat(Path(sys.argv[1]), period_s=0.1)
print("beating", flush=True)
time.sleep(1.0)
if sys.argv[2] == "hold-the-gil":
    ctypes.PyDLL(None).sleep(60)  # libc's sleep with the GIL held: no other thread of ours runs
else:
    time.sleep(60)
"""


def test_no_heartbeat_without_its_folder_and_none_left_after_stop(tmp_path: Path) -> None:
    assert start_heartbeat({}) is None
    heartbeat = start_heartbeat({HEARTBEAT_DIR_ENV: str(tmp_path)})
    assert heartbeat is not None and heartbeat.path == tmp_path / str(os.getpid())
    assert heartbeat_age_s(tmp_path, os.getpid()) is not None
    heartbeat.stop()
    assert heartbeat_age_s(tmp_path, os.getpid()) is None


@pytest.fixture
def processes(tmp_path: Path):
    started: dict[str, subprocess.Popen] = {}
    repo = Path(__file__).resolve().parents[2]
    for how in ("hold-the-gil", "sleep"):
        started[how] = subprocess.Popen(
            [sys.executable, "-c", PROCESS, str(tmp_path), how], stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(repo)},
        )
        assert started[how].stdout is not None and started[how].stdout.readline().strip() == "beating"
    yield started
    for process in started.values():
        process.kill()
        process.wait(10)


def test_a_process_whose_python_cannot_run_stops_beating(processes, tmp_path: Path) -> None:
    time.sleep(4.0)  # 3 s past the point where one of them took the GIL for good
    held = heartbeat_age_s(tmp_path, processes["hold-the-gil"].pid)
    sleeping = heartbeat_age_s(tmp_path, processes["sleep"].pid)
    assert held is not None and sleeping is not None
    assert processes["hold-the-gil"].poll() is None  # alive: only the heartbeat can tell
    # A relation, not a clock: the held process's file stopped 3 s ago, the other's keeps moving.
    assert held - sleeping > 1.5, (held, sleeping)

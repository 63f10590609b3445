"""StageWatch finds a server's stubs and engine cores by role and notices one dying; the launcher
stops a server that lost a stage. Real processes stand in for Triton's: a child of this test whose
command line is a stub's (``triton_python_backend_stub <repo>/<model>/1/model.py``), with an
"EngineCore" grandchild."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from builders import launcher
from builders.stage_watch import StageWatch, find_role, server_processes

FAKE_STUB = """
import subprocess, sys, time
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "VLLM::EngineCore"])
time.sleep(600)
"""


@pytest.fixture
def fake_stubs(tmp_path: Path):
    """Two fake stubs (encoder_0, decode with an engine core) as children of this process."""
    stub_binary = tmp_path / "triton_python_backend_stub"  # the interpreter, under the stub's name
    stub_binary.symlink_to(os.path.realpath(sys.executable))
    started = []
    for model in ("encoder_0", "decode"):
        script = tmp_path / "repo" / model / "1" / "model.py"
        script.parent.mkdir(parents=True)
        script.write_text(FAKE_STUB)
        # Its command line is a stub's; the interpreter runs the model file named in argv[1].
        started.append(subprocess.Popen([str(stub_binary), str(script)]))
    deadline = time.monotonic() + 30
    while len([p for p in server_processes(os.getpid()) if p.role.startswith("engine:")]) < 2:
        assert time.monotonic() < deadline, server_processes(os.getpid())
        time.sleep(0.05)
    engines = [psutil.Process(p.pid) for p in server_processes(os.getpid()) if p.role.startswith("engine:")]
    yield started
    for process in started:
        process.kill()
        process.wait(10)
    for engine in engines:  # orphans once their stub is gone
        with contextlib.suppress(psutil.NoSuchProcess):
            engine.kill()


def test_roles_are_found_and_a_killed_stub_or_engine_is_lost(fake_stubs):
    roles = sorted(p.role for p in server_processes(os.getpid()))
    assert roles == ["engine:decode", "engine:encoder_0", "stub:decode", "stub:encoder_0", "tritonserver"]
    watch = StageWatch(os.getpid())
    assert watch.lost() == []
    os.kill(find_role(os.getpid(), "stub:encoder_0"), signal.SIGKILL)
    fake_stubs[0].wait(10)
    assert watch.lost() == ["stub:encoder_0"]
    engine = find_role(os.getpid(), "engine:decode")
    os.kill(engine, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while "engine:decode" not in watch.lost():  # reaped by its parent, or a zombie: lost either way
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(LookupError, match="stub:prefill"):
        find_role(os.getpid(), "stub:prefill")


def test_the_launcher_stops_a_server_that_lost_a_stage(fake_stubs, capsys):
    stops = []
    server = SimpleNamespace(stop=lambda timeout_s: stops.append(timeout_s))
    code = launcher.stop_after_stage_crash(server, ["stub:encoder_0", "stub:encoder_0"])
    assert code == launcher.STAGE_CRASHED != 0
    assert stops == [launcher.STOP_AFTER_CRASH_S]
    assert "stage crashed: stub:encoder_0 died" in capsys.readouterr().out

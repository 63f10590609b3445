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
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from builders import launcher
from builders.stage_watch import (
    StageWatch,
    StageWatchThread,
    StuckStubLaunch,
    find_role,
    pids_waited_on,
    server_processes,
)

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


def test_a_live_stub_whose_heartbeat_is_stale_is_hung_and_the_launcher_stops_its_server(
    fake_stubs, tmp_path: Path, capsys
):
    encoder, decode = fake_stubs
    beats = tmp_path / "heartbeats"
    beats.mkdir()
    watch = StageWatch(os.getpid(), beats, hung_after_s=60)
    assert watch.hung() == []  # no heartbeat file: not judged
    (beats / str(encoder.pid)).touch()
    (beats / str(decode.pid)).touch()
    assert watch.hung() == []  # fresh
    stale = time.time() - 75
    os.utime(beats / str(decode.pid), (stale, stale))
    assert watch.hung() == ["stub:decode (no heartbeat for 75 s)"]
    assert StageWatch(os.getpid(), beats, hung_after_s=0).hung() == []  # --hung-stage-s 0: off
    assert StageWatch(os.getpid()).hung() == []  # no heartbeat folder (a server not started by the launcher)
    decode.kill()
    decode.wait(10)
    assert watch.hung() == [] and watch.lost() == ["stub:decode"]  # dead is lost, not hung

    stops = []
    server = SimpleNamespace(stop=lambda timeout_s: stops.append(timeout_s))
    assert launcher.stop_after_stage_crash(server, [], ["stub:epd (no heartbeat for 75 s)"]) == launcher.STAGE_CRASHED
    assert stops == [launcher.STOP_AFTER_CRASH_S]
    out = capsys.readouterr().out
    assert "stage hung: stub:epd (no heartbeat for 75 s)" in out and "stage crashed" not in out


def test_a_watch_thread_says_once_which_stage_died_and_runs_its_failure_action_once(fake_stubs):
    failures = []
    thread = StageWatchThread(StageWatch(os.getpid()), lambda lost, hung: failures.append((lost, hung)), 0.05)
    thread.start()
    time.sleep(0.3)
    assert thread.reason is None and failures == []  # every stage alive: nothing said
    os.kill(find_role(os.getpid(), "stub:encoder_0"), signal.SIGKILL)
    fake_stubs[0].wait(10)
    deadline = time.monotonic() + 10
    while thread.reason is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert thread.reason == "the server lost a stage: stub:encoder_0 died"
    time.sleep(0.3)
    thread.stop()
    assert failures == [(["stub:encoder_0"], [])]


def test_a_stub_the_server_waits_on_for_good_is_killed_after_the_grace(fake_stubs):
    """Triton 2.51's python backend waits (wait4) for a stub whose launch it gave up on while
    the stub waits for a command: this process plays tritonserver, a thread of it blocks in
    ``wait()`` on the decode stub. The watch kills that stub after ``after_s``, never the other."""
    encoder, decode = fake_stubs
    waiter = threading.Thread(target=decode.wait, daemon=True)
    waiter.start()
    deadline = time.monotonic() + 10
    while decode.pid not in pids_waited_on(os.getpid()):
        assert time.monotonic() < deadline, "the waiting thread never showed up in /proc"
        time.sleep(0.02)
    assert encoder.pid not in pids_waited_on(os.getpid())

    now = [1000.0]
    watch = StuckStubLaunch(os.getpid(), after_s=60.0, clock=lambda: now[0])
    assert watch.check() == []  # first seen now
    now[0] += 59.0
    assert watch.check() == [] and decode.poll() is None
    now[0] += 1.0
    killed = watch.check()
    assert len(killed) == 1 and killed[0].startswith(f"stub:decode (pid {decode.pid})"), killed
    waiter.join(10)
    assert not waiter.is_alive() and decode.returncode == -signal.SIGKILL
    assert encoder.poll() is None  # not waited on: left alone
    assert watch.check() == []


def test_nothing_is_waited_on_where_the_machine_is_unknown():
    assert pids_waited_on(os.getpid(), machine="sparc64") == set()
    assert pids_waited_on(2**30) == set()  # no such process


def test_a_killed_servers_stub_regions_are_removed_from_shm(fake_stubs, tmp_path: Path):
    """A stub names its shared-memory region on its command line; a SIGKILLed server never
    unlinks them (builders/tritonserver.py)."""
    from builders.tritonserver import SHM_REGION_PREFIX, remove_shm_regions, stub_shm_regions

    assert stub_shm_regions(os.getpid()) == []  # these fake stubs name none
    stub = tmp_path / "triton_python_backend_stub"
    script = tmp_path / "repo" / "epd" / "1" / "model.py"
    script.parent.mkdir(parents=True)
    script.write_text("import time; time.sleep(600)")
    region = f"{SHM_REGION_PREFIX}0123"
    named = subprocess.Popen([str(stub), str(script), region])
    try:
        deadline = time.monotonic() + 10
        while stub_shm_regions(os.getpid()) != [region]:
            assert time.monotonic() < deadline, server_processes(os.getpid())
            time.sleep(0.05)
    finally:
        named.kill()
        named.wait(10)
    (tmp_path / region).write_bytes(b"\0" * 16)
    assert remove_shm_regions([region, f"{SHM_REGION_PREFIX}gone"], tmp_path) == [region]
    assert not (tmp_path / region).exists()

"""builders.processes with plain Python children: how a stop ends, what its report says."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from builders.processes import ProcessGroup, StartError, StartTimeout, wait_until_ready


def python(code: str, log: Path, **options: object) -> ProcessGroup:
    return ProcessGroup("child", [sys.executable, "-c", code], log_path=log, **options)  # type: ignore[arg-type]


READY = "import sys; print('up', flush=True); "


def wait_for_line(log: Path, text: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.exists() and text in log.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {log}")


def test_a_child_that_exits_on_the_signal_stops_cleanly(tmp_path: Path) -> None:
    group = python(READY + "import time; time.sleep(60)", tmp_path / "c.log").start()
    wait_for_line(tmp_path / "c.log", "up")
    report = group.stop(timeout_s=10)
    assert report is not None
    assert (report.killed, report.leftovers, report.problems) == (False, 0, ())
    assert report.exit_code == -signal.SIGTERM  # the default action of the signal we sent
    assert not report.clean  # only an exit code of 0 is clean


def test_sigint_to_the_leader_only_and_a_zero_exit_is_clean(tmp_path: Path) -> None:
    # "up" is printed inside the try: a SIGINT right after it must land in the handler (under load
    # it once came before the try and the child died of KeyboardInterrupt, exit code 1).
    code = "import sys, time\ntry:\n    print('up', flush=True)\n    time.sleep(60)\n"
    code += "except KeyboardInterrupt:\n    sys.exit(0)"
    group = python(code, tmp_path / "c.log", stop_signal=signal.SIGINT, signal_group=False).start()
    wait_for_line(tmp_path / "c.log", "up")
    report = group.stop(timeout_s=10)
    assert report is not None and report.clean, report
    assert "exited with code 0" in report.describe()


def test_a_child_that_ignores_the_signal_is_killed_and_the_report_says_so(tmp_path: Path) -> None:
    code = READY.replace("print", "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); print") + (
        "import time; time.sleep(60)"
    )
    group = python(code, tmp_path / "c.log").start()
    wait_for_line(tmp_path / "c.log", "up")
    report = group.stop(timeout_s=1)
    assert report is not None and report.killed and not report.clean
    assert report.exit_code == -signal.SIGKILL and 1 <= report.seconds < 10
    assert "SIGKILLed after the stop timeout" in report.describe()


LEADER_WITH_A_STUBBORN_CHILD = """
import subprocess, sys, time
child = "import os, signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print(os.getpid(), flush=True); "
child += "time.sleep(60)"
subprocess.Popen([sys.executable, "-c", child])
try:
    print("up", flush=True)
    time.sleep(60)
except KeyboardInterrupt:
    sys.exit(0)
"""


def test_processes_that_outlive_the_leader_are_counted_and_killed(tmp_path: Path) -> None:
    # Like tritonserver exiting on SIGINT while a stub of its group hangs on.
    log = tmp_path / "c.log"
    group = python(LEADER_WITH_A_STUBBORN_CHILD, log, stop_signal=signal.SIGINT, signal_group=False).start()
    wait_for_line(log, "up")
    deadline = time.monotonic() + 20
    while not (pids := [int(line) for line in log.read_text().split() if line.isdigit()]):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    report = group.stop(timeout_s=10)
    assert report is not None and report.exit_code == 0 and report.leftovers == 1
    assert "1 process(es) of its group outlived it" in report.describe()
    assert not alive(pids[0])


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie its new parent has not reaped yet."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_problem_lines_of_the_log_are_reported(tmp_path: Path) -> None:
    code = "print('fine'); print('!!!!!!! Segfault encountered !!!!!!!'); print('also fine')"
    group = python(code, tmp_path / "c.log").start()
    assert group.process is not None and group.process.wait(20) == 0
    report = group.stop(problem_markers=("Segfault encountered", "Exit timeout expired"))
    assert report is not None and not report.clean
    assert report.problems == ("!!!!!!! Segfault encountered !!!!!!!",)
    assert str(tmp_path / "c.log") in report.describe()


def test_stopping_a_group_that_never_started_reports_nothing(tmp_path: Path) -> None:
    assert python("pass", tmp_path / "c.log").stop() is None


def test_waiting_names_a_child_that_died_and_times_out_as_a_timeout(tmp_path: Path) -> None:
    dead = python("print('bad flag'); raise SystemExit(3)", tmp_path / "d.log").start()
    assert dead.process is not None
    dead.process.wait(20)
    with pytest.raises(StartError, match="child exited with code 3") as info:
        wait_until_ready(lambda: False, [dead], timeout_s=5, what="child")
    assert "bad flag" in str(info.value)
    alive = python("import time; time.sleep(60)", tmp_path / "a.log").start()
    try:
        with pytest.raises(TimeoutError) as timeout:
            wait_until_ready(lambda: False, [alive], timeout_s=0.3, what="child", poll_s=0.05)
        assert isinstance(timeout.value, StartTimeout) and "not ready after" in str(timeout.value)
    finally:
        alive.stop(timeout_s=5)


def test_a_group_given_cpus_starts_inside_them_and_its_children_too(tmp_path: Path) -> None:
    import os

    cpu = min(os.sched_getaffinity(0))
    code = "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); sys.stdout.flush(); " + (
        "subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'])"
    )
    group = python(code, tmp_path / "log", cpus=frozenset({cpu})).start()
    assert group.process is not None and group.process.wait(timeout=30) == 0
    assert (tmp_path / "log").read_text().split() == [f"[{cpu}]", f"[{cpu}]"]


def test_the_whole_servers_cpus_are_the_last_unnamed_spec() -> None:
    from builders.roles import server_cpus

    assert server_cpus(["encoders=0", "engines=1"]) is None
    assert server_cpus(["0-1", "llm=0", "1"]) == {1}


# --- Nothing outlives the process that started it (issue 51) ----------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[2]


def started_parent(code: str, *args: str, stderr: int = subprocess.DEVNULL) -> tuple[psutil.Popen, list[int]]:
    """A python process running ``code`` (which prints the pids to watch, one a line, then
    ``ready``), and those pids."""
    parent = psutil.Popen([sys.executable, "-c", code, *args], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                          stderr=stderr, text=True)  # fmt: skip
    pids = []
    assert parent.stdout is not None
    for line in parent.stdout:
        if line.strip() == "ready":
            return parent, pids
        pids.append(int(line))
    raise AssertionError(f"the parent exited with {parent.wait()} before it was ready")


def seconds_until_gone(pids: list[int], timeout_s: float) -> dict[int, float]:
    """Each pid's seconds until it was gone (or a zombie), polled from now; those still running
    after ``timeout_s`` are missing."""
    started = time.monotonic()
    gone: dict[int, float] = {}
    while len(gone) < len(pids) and time.monotonic() - started < timeout_s:
        for pid in pids:
            if pid not in gone and not alive(pid):
                gone[pid] = time.monotonic() - started
        time.sleep(0.005)
    return gone


def kill_parent(parent: psutil.Popen) -> None:
    parent.kill()  # SIGKILL: no handler, no atexit, as the OOM killer ends a process
    parent.wait(10)


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()


DYING_CHILD = """
import functools, os, subprocess, sys, time
from builders.processes import die_with_parent
die = functools.partial(die_with_parent, os.getpid())
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=die)
print(child.pid); print("ready", flush=True)
time.sleep(60)
"""


def test_die_with_parent_makes_a_child_die_when_its_parent_is_killed() -> None:
    parent, [child] = started_parent(DYING_CHILD)
    try:
        time.sleep(0.2)
        assert alive(child)
        kill_parent(parent)
        assert child in seconds_until_gone([child], timeout_s=1.0), "the child outlived its SIGKILLed parent by 1 s"
    finally:
        kill_all([child])


def test_die_with_parent_ends_a_child_whose_parent_died_before_the_prctl() -> None:
    # Its parent is this test, not pid 1: as if its parent had died and it had been re-parented.
    code = "from builders.processes import die_with_parent; die_with_parent(1); print('survived')"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGKILL, result
    assert "survived" not in result.stdout


LEADER_WITH_A_CHILD = (
    "import subprocess, sys, time; "
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'] + sys.argv[1:]); "
    "print(child.pid, flush=True); time.sleep(60)"
)


def group_parent(start: str, leader_args: tuple[str, ...] = (), then: str = "time.sleep(60)") -> str:
    """A parent that starts LEADER_WITH_A_CHILD (with ``leader_args``) as ``group`` (``start``
    starts it), prints its guard's, the leader's and the leader's child's pids and ``ready``,
    then runs ``then``. Its first argument: the leader's log."""
    return f"""
import sys, threading, time
from pathlib import Path
import builders.processes as processes
from builders.processes import ProcessGroup
log = Path(sys.argv[1])
group = ProcessGroup("leader", [sys.executable, "-c", {LEADER_WITH_A_CHILD!r}, *{leader_args!r}], log_path=log)
{start}
while not log.read_text().strip():
    time.sleep(0.01)
print(processes._GUARD.process.pid); print(group.pid); print(int(log.read_text().split()[0]))
print("ready", flush=True)
{then}
"""


def test_a_group_dies_with_its_starter_its_leaders_children_too(tmp_path: Path) -> None:
    # The leader's child is what the parent-death signal alone leaves behind (Triton's stubs).
    parent, pids = started_parent(group_parent("group.start()"), str(tmp_path / "log"), stderr=subprocess.PIPE)
    try:
        kill_parent(parent)
        gone = seconds_until_gone(pids, timeout_s=3.0)
        assert set(gone) == set(pids), f"still running: {set(pids) - set(gone)}; gone after {gone}"
        guard, leader, child = pids
        assert gone[leader] < 1.0, gone  # its parent-death signal, at once
        assert parent.stderr is not None
        assert "leader: the process that started it ended without stopping it" in parent.stderr.read()
    finally:
        kill_all(pids)


def test_a_group_started_from_a_thread_outlives_the_thread_not_the_process(tmp_path: Path) -> None:
    # The parent-death signal follows the forking thread: a group started from a worker thread
    # must not die when that thread ends, so it gets none; the guard still ends it with the process.
    start = "thread = threading.Thread(target=group.start); thread.start(); thread.join(); time.sleep(0.3)"
    parent, pids = started_parent(group_parent(start), str(tmp_path / "log"))
    try:
        assert all(alive(pid) for pid in pids), "the group died with the thread that started it"
        kill_parent(parent)
        gone = seconds_until_gone(pids, timeout_s=3.0)
        assert set(gone) == set(pids), f"still running: {set(pids) - set(gone)}"
    finally:
        kill_all(pids)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_the_guard_unlinks_the_shared_memory_regions_its_group_named(tmp_path: Path) -> None:
    # As a python-backend stub names its region on its command line; Triton unlinks them only at a clean stop.
    region = Path("/dev/shm") / f"triton_python_backend_shm_region_test-{uuid.uuid4().hex}"
    region.write_bytes(b"x")
    parent, pids = started_parent(group_parent("group.start()", (region.name,)), str(tmp_path / "log"))
    try:
        kill_parent(parent)
        assert set(seconds_until_gone(pids, timeout_s=3.0)) == set(pids)
        assert not region.exists()
    finally:
        kill_all(pids)
        region.unlink(missing_ok=True)


@pytest.mark.parametrize("stopped", [True, False], ids=["stopped", "left-running"])
def test_at_a_normal_exit_the_guard_ends_too_and_kills_only_a_group_left_running(tmp_path: Path, stopped: bool) -> None:
    code = group_parent("group.start()", then="group.stop(timeout_s=10)" if stopped else "")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "log")], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    pids = [int(line) for line in result.stdout.split() if line.isdigit()]
    try:
        assert result.returncode == 0, result.stderr
        assert not alive(pids[0]), "the parent's exit waits for its guard"
        assert set(seconds_until_gone(pids, timeout_s=3.0)) == set(pids)
        assert ("ended without stopping it" in result.stderr) is not stopped, result.stderr
    finally:
        kill_all(pids)


def test_a_group_that_need_not_die_with_its_parent_starts_no_guard(tmp_path: Path) -> None:
    code = group_parent("group.die_with_parent = False; group.start()").replace(
        "print(processes._GUARD.process.pid); ", "print(0 if processes._GUARD is None else 1); "
    )
    parent, (no_guard, leader, child) = started_parent(code, str(tmp_path / "log"))
    try:
        assert no_guard == 0
    finally:
        kill_parent(parent)
        kill_all([leader, child])

"""builders.processes with plain Python children: how a stop ends, what its report says."""

from __future__ import annotations

import signal
import sys
import time
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

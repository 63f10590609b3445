"""The processes of one running tritonserver, found by role, and what each one holds.

Used by the launcher (:class:`StageWatch`: stop the server when a stage died), the crash
harness (``tests.stress.crash``: which pid to SIGKILL) and the soak
(``tests.stress.soak``: RSS, open fds and threads of every process over time). Roles:

``tritonserver``       the server itself;
``stub:<model>``       the python-backend stub of ``<model>`` (one per instance; the first);
``engine:<model>``     the vLLM engine-core process under that model's stub (V1: a child process).
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from python_backends.runtime.heartbeat import heartbeat_age_s

STUB_BINARY = "triton_python_backend_stub"


@dataclass(frozen=True)
class ServerProcess:
    role: str
    pid: int


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def stub_model(process: psutil.Process) -> str | None:
    """The model a stub process serves (from its ``<repo>/<model>/1/model.py`` argument), else None."""
    args = _cmdline(process)
    if not args or not args[0].endswith(STUB_BINARY) or len(args) < 2:
        return None
    parts = args[1].split("/")
    return parts[-3] if len(parts) >= 3 else None


def _is_engine_core(process: psutil.Process) -> bool:
    # vLLM names its engine-core process "VLLM::EngineCore" (setproctitle); older builds keep python's name.
    try:
        name = process.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return "EngineCore" in name or any("EngineCore" in arg for arg in _cmdline(process))


def server_processes(server_pid: int) -> list[ServerProcess]:
    """tritonserver, each model's stub(s) and each vLLM engine core under a stub, by role."""
    found = [ServerProcess("tritonserver", server_pid)]
    try:
        children = psutil.Process(server_pid).children()
    except psutil.NoSuchProcess:
        return []
    for child in children:
        model = stub_model(child)
        if model is None:
            continue
        found.append(ServerProcess(f"stub:{model}", child.pid))
        try:
            descendants = child.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for grandchild in descendants:
            if _is_engine_core(grandchild):
                found.append(ServerProcess(f"engine:{model}", grandchild.pid))
    return found


def find_role(server_pid: int, role: str) -> int:
    """The pid of ``role`` (the first, when a model has several instances); LookupError if none."""
    for process in server_processes(server_pid):
        if process.role == role:
            return process.pid
    roles = sorted({p.role for p in server_processes(server_pid)})
    raise LookupError(f"no process {role!r} under tritonserver {server_pid}; found {roles}")


def _status_bytes(pid: int, field: str) -> int | None:
    """A ``kB`` field of ``/proc/<pid>/status`` in bytes, or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def anonymous_rss(pid: int) -> int | None:
    """``RssAnon`` of ``/proc/<pid>/status`` in bytes (heap, arenas, anonymous maps), or None.

    What a leak grows. Total RSS also counts file-backed pages (torch's and vLLM's shared
    libraries: hundreds of MiB per engine), which the kernel drops and faults back in as the
    machine's free memory comes and goes: on a crowded machine without swap, RSS moves with the
    neighbours' load (the first soak: -17% to -22% for the engines), not with ours."""
    return _status_bytes(pid, "RssAnon")


def peak_rss(pid: int) -> int | None:
    """``VmHWM``: the most RSS the process ever had, in bytes (what a transient decode costs)."""
    return _status_bytes(pid, "VmHWM")


def sample_process(pid: int) -> dict[str, Any] | None:
    """RSS and anonymous RSS (bytes), open fds and threads of one process, or None once it is gone."""
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            sample = {"rss": process.memory_info().rss, "fds": process.num_fds(), "threads": process.num_threads()}
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    anon = anonymous_rss(pid)
    if anon is not None:
        sample["anon"] = anon
    return sample


# A stub whose Python has not run for this long is hung (its heartbeat thread wakes every second).
HUNG_AFTER_S = 60.0


class StageWatch:
    """Notices a stage of a running tritonserver dying: a stub or a vLLM engine core that was
    there when the server became ready and is gone (or a zombie) now; and, given the servers'
    heartbeat folder, a stub that is alive but runs no Python any more (a deadlock inside
    Triton's python backend, python_backends/runtime/heartbeat.py).

    Why the launcher needs it: Triton 2.51's python backend neither restarts a dead stub nor
    marks its model not-ready; measured (docs/benchmarks/crashes.md): every later
    request to that model failed ("Stub process ... is not healthy") while ``/v2/health/ready``
    and the model's ready endpoint still answered 200. A crashed stage
    is only recovered by restarting the server, so the launcher stops tritonserver and exits
    non-zero: health checks then fail and an orchestrator restarts it on the same store.
    """

    def __init__(self, server_pid: int, heartbeat_dir: Path | None = None, hung_after_s: float = HUNG_AFTER_S) -> None:
        self.server_pid = server_pid
        self.watched = {p.role + f"#{p.pid}": p.pid for p in server_processes(server_pid) if p.role != "tritonserver"}
        self.heartbeat_dir = heartbeat_dir
        self.hung_after_s = hung_after_s

    def lost(self) -> list[str]:
        """The roles (``stub:<model>``, ``engine:<model>``) whose process died since the start."""
        return [role.split("#")[0] for role, pid in self.watched.items() if not _running(pid)]

    def hung(self) -> list[str]:
        """The stubs alive but running no Python: their heartbeat (python_backends/runtime/heartbeat.py)
        is older than ``hung_after_s``, each as ``stub:<model> (no heartbeat for N s)``. A stub
        without a heartbeat file (none started, or it unloaded) is not judged."""
        return list(self.hung_stubs().values())

    def hung_stubs(self) -> dict[int, str]:
        """:meth:`hung`, by pid."""
        if self.heartbeat_dir is None or self.hung_after_s <= 0:
            return {}
        hung = {}
        for role, pid in self.watched.items():
            age = heartbeat_age_s(self.heartbeat_dir, pid) if role.startswith("stub:") else None
            if age is not None and age >= self.hung_after_s and _running(pid):
                hung[pid] = f"{role.split('#')[0]} (no heartbeat for {age:.0f} s)"
        return hung

    def save_hung_stacks(self, folder: Path) -> Path | None:
        """The native and Python stacks of every hung stub (:func:`native_stacks`), in one file in
        ``folder``, before the server is stopped: the only record of what deadlocked (Triton's
        python backend, docs/benchmarks/bls-deadlock.md). None when no stub hangs."""
        hung = self.hung_stubs()
        if not hung:
            return None
        path = folder / f"hung-stage-stacks-{time.strftime('%Y%m%dT%H%M%S')}.txt"
        path.write_text("\n".join(f"==== {what}, pid {pid}\n{native_stacks(pid)}" for pid, what in hung.items()))
        return path


PY_SPY_ENV = "TRITON_EPD_PY_SPY"  # a py-spy binary to use instead of the one on PATH


def find_py_spy() -> str | None:
    """py-spy: ``TRITON_EPD_PY_SPY``, else on PATH, else beside this Python (requirements/cpu.txt
    installs it in the venv)."""
    beside_python = Path(sys.executable).parent / "py-spy"
    found = os.environ.get(PY_SPY_ENV) or shutil.which("py-spy")
    return found or (str(beside_python) if beside_python.exists() else None)


def native_stacks(pid: int, timeout_s: float = 90.0) -> str:
    """Every thread's stack of ``pid``: py-spy's Python and native frames (it shows threads that
    run Python only), then gdb's native frames of every thread (the python backend's own C++
    threads too), each where installed."""
    py_spy = find_py_spy()
    gdb = shutil.which("gdb")
    commands = [[py_spy, "dump", "--native", "--pid", str(pid)]] if py_spy else []
    commands += [[gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt 25"]] if gdb else []
    if not commands:
        return "<neither py-spy nor gdb is installed>"
    parts = []
    for command in commands:
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
            parts.append(f"--- {Path(command[0]).name}\n{result.stdout}{result.stderr}")
        except subprocess.TimeoutExpired:
            parts.append(f"--- {Path(command[0]).name}: took over {timeout_s:.0f} s")
    return "\n".join(parts)


class StageWatchThread:
    """A :class:`StageWatch` polled on a daemon thread, for callers that have other work on their
    main thread (the benchmark: a sweep). Once a stage died or hangs, :attr:`reason` says so and
    ``on_failure(lost, hung)`` runs once, on this thread (the benchmark: stop its own server)."""

    def __init__(
        self,
        watch: StageWatch,
        on_failure: Callable[[list[str], list[str]], object] | None = None,
        poll_s: float = 1.0,
        stacks_dir: Path | None = None,
    ) -> None:
        """``stacks_dir``: where a hung stub's stacks are saved before ``on_failure``."""
        self.watch = watch
        self.on_failure = on_failure
        self.poll_s = poll_s
        self.stacks_dir = stacks_dir
        self.reason: str | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stage-watch", daemon=True)

    def start(self) -> StageWatchThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling; an ``on_failure`` already running is waited for."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopping.wait(self.poll_s):
            lost, hung = self.watch.lost(), self.watch.hung()
            if lost or hung:
                self.reason = describe_stage_failure(lost, hung)
                stacks = self.watch.save_hung_stacks(self.stacks_dir) if hung and self.stacks_dir else None
                if stacks is not None:
                    self.reason += f" (its stacks: {stacks})"
                if self.on_failure is not None:
                    self.on_failure(lost, hung)
                return


def describe_stage_failure(lost: list[str], hung: list[str]) -> str:
    """One line: which stages of the server died and which hang."""
    parts = [f"{', '.join(sorted(set(lost)))} died"] if lost else []
    if hung:
        parts.append(f"{', '.join(sorted(set(hung)))} hung")
    return "the server lost a stage: " + "; ".join(parts)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# wait4's system call number, as /proc/<pid>/task/<tid>/syscall shows it (x86_64: asm/unistd_64.h;
# aarch64: the generic table).
WAIT4_SYSCALL = {"x86_64": 61, "aarch64": 260}


def pids_waited_on(pid: int, machine: str | None = None) -> set[int]:
    """The pids that a thread of process ``pid`` is blocked in ``wait4()`` on, read from
    ``/proc/<pid>/task/*/syscall`` (its first argument); empty where that cannot be read."""
    number = WAIT4_SYSCALL.get(machine or platform.machine())
    if number is None:
        return set()
    waited: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return waited
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall") as handle:
                fields = handle.read().split()
        except OSError:  # thread gone, or not allowed to look
            continue
        if len(fields) >= 2 and fields[0] == str(number):
            target = int(fields[1], 16)
            if 0 < target < 2**31:  # -1 (any child) and process groups are not one stub
                waited.add(target)
    return waited


@dataclass
class StuckStubLaunch:
    """Unsticks a model load that Triton 2.51's python backend would never finish.

    python_backend r24.10 (``src/stub_launcher.cc``, ``StubLauncher::Launch``): while a stub
    runs ``initialize`` the parent checks the stub's health flag in 1 s windows; one window
    in which the stub's health thread did not run (a starved machine: seen after a crash
    restart with load average 13 on 2 cores) fails the launch with "Stub process ... is not
    healthy". The launch's cleanup (a ``ScopedDefer``) then *waits* for the stub to exit, but
    nothing tells it to: the stub finishes ``initialize``, answers a parent that no longer
    listens, and waits for its next command for good. The model load never returns and the
    server is never ready (measured: 10 minutes, gdb: ``wait4(stub)`` under
    ``~ScopedDefer <- StubLauncher::Launch <- TRITONBACKEND_ModelInstanceInitialize``; the stub
    in ``Stub::PopMessage``). Upstream main still waits the same way.

    Used while the server starts: a live stub that a tritonserver thread has waited on for
    ``after_s`` is SIGKILLed, which lets the load fail with Triton's own error (the server
    then exits, and is restarted like after any failed start) instead of hanging.
    """

    server_pid: int
    after_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    kill: Callable[[int, int], None] = os.kill
    _since: dict[int, float] = field(default_factory=dict)

    def check(self) -> list[str]:
        """Look once; kill what has been stuck ``after_s``. Returns a line per stub killed."""
        now = self.clock()
        stubs = {p.pid: p.role for p in server_processes(self.server_pid) if p.role.startswith("stub:")}
        waited = {pid for pid in pids_waited_on(self.server_pid) if pid in stubs and _running(pid)}
        self._since = {pid: self._since.get(pid, now) for pid in waited}
        killed = []
        for pid, since in list(self._since.items()):
            if now - since >= self.after_s:
                try:
                    self.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                del self._since[pid]
                killed.append(
                    f"{stubs[pid]} (pid {pid}): tritonserver has waited {now - since:.0f} s for it to exit after "
                    "its launch failed (python backend r24.10 stub-launch hang); killed it so that the load fails "
                    "with Triton's error instead of never finishing"
                )
        return killed

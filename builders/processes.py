"""One way to run a server as a child process group: start it with a log file, wait until it
answers, stop it (a polite signal, a wait, then SIGKILL for the whole group) and say how it ended.

Used by :class:`builders.tritonserver.TritonServer` and by the benchmark's peer servers
(``vllm serve``, the EPD router). Each process leads its own session, so its group id is its
pid and a stop reaches every child it started (python-backend stubs, vLLM engine cores).

Nothing outlives the process that started it (issue 51), however that process ends (SIGKILL, the
OOM killer): the leader gets a parent-death signal (:func:`die_with_parent`, SIGKILL), and a small
guard process (:class:`_Guard`, one per starting process) SIGKILLs each group still started when
the starting process is gone -- the leader's own children too (Triton's stubs only notice a dead
tritonserver once something reaps it, which a container's PID 1 may never do), and unlinks the
stubs' shared-memory regions. A restarted launcher finds its ports free.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO


class StartError(RuntimeError):
    """A process that did not come up; the message carries its log's tail."""


class StartTimeout(StartError, TimeoutError):
    """Still not ready when the wait ran out."""


@dataclass(frozen=True)
class StopReport:
    """How a process group ended.

    ``killed``: the leader ignored the stop signal for the whole timeout and got SIGKILL.
    ``leftovers``: members of the group (stubs, engine cores) still alive after the leader
    exited, SIGKILLed then. ``problems``: log lines matching the caller's problem markers.
    """

    name: str
    exit_code: int | None
    killed: bool
    leftovers: int
    seconds: float
    problems: tuple[str, ...] = ()
    log_path: Path | None = None

    @property
    def clean(self) -> bool:
        return not self.killed and not self.problems and self.exit_code == 0

    def describe(self) -> str:
        how = "SIGKILLed after the stop timeout" if self.killed else f"exited with code {self.exit_code}"
        text = f"{self.name} {how} in {self.seconds:.1f} s"
        if self.leftovers:
            text += f"; {self.leftovers} process(es) of its group outlived it and were killed"
        if self.problems:
            text += f"; {len(self.problems)} problem line(s) in {self.log_path}:\n" + "\n".join(self.problems)
        return text


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _libc_prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, looked up here, in the parent: a child between fork and exec should not
    have to load anything. None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl  # type: ignore[no-any-return]


_PRCTL = _libc_prctl()


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """For a child between fork and exec (a ``preexec_fn``): the kernel sends it ``sig`` when its
    parent ends, however (``PR_SET_PDEATHSIG``, kept across exec, not passed on to its own
    children). The parent is the *thread* that forked: fork from one that lives as long as the
    process (the main thread). ``parent_pid``: the pid the parent had before the fork; if the child
    has another parent already (the parent died before the prctl), it dies at once.

    SIGKILL rather than SIGTERM: with its launcher gone nobody waits for a polite stop or reports
    it, and tritonserver's would take up to its exit timeout (30 s by default) while it keeps its
    ports; everything it writes is crash-safe (LMDB store, leases reclaimed from dead processes)."""
    if _PRCTL is None:
        return
    if _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_PDEATHSIG): {os.strerror(error)}")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
        os._exit(1)  # a signal we could not die of


def _in_child(cpus: frozenset[int] | None, parent_pid: int | None = None) -> None:
    """In the child before exec: SIGINT and SIGTERM back to their default actions (a process started
    with SIGINT ignored, from a background job or under nohup, passes that on, and a Python child
    then installs no KeyboardInterrupt handler: our SIGINT stop would do nothing to it); dying with
    ``parent_pid`` (:func:`die_with_parent`) unless None; and the child's CPU set, which exec keeps
    and every thread and process it starts inherits."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if parent_pid is not None:
        die_with_parent(parent_pid)
    if cpus:
        os.sched_setaffinity(0, cpus)


@dataclass
class ProcessGroup:
    """``command`` in its own session, stdout+stderr to ``log_path`` (or the terminal).

    ``stop_signal`` goes to the leader only (``signal_group=False``: tritonserver unloads its
    models, which stops their stubs itself) or to the whole group (``True``: vllm serve).

    ``die_with_parent`` (default): the group dies with this process, however it ends -- the leader
    by its parent-death signal (set only when started from the main thread: the signal follows the
    forking *thread*), the whole group by this process's guard (:class:`_Guard`), until ``stop``.
    """

    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    stop_signal: signal.Signals = signal.SIGTERM
    signal_group: bool = True
    log_command: bool = False  # first log line: "$ command" (peer logs read on their own)
    cpus: frozenset[int] | None = None  # the CPUs the process (and all it starts) runs on; None: any
    die_with_parent: bool = True
    process: subprocess.Popen[bytes] | None = None

    def start(self, base_env: Mapping[str, str] | None = None) -> ProcessGroup:
        """Start with ``base_env`` (default: this process's environment) updated by ``env``."""
        env = {**(os.environ if base_env is None else base_env), **self.env}
        guard = _guard() if self.die_with_parent else None  # first: no server starts unguarded
        main_thread = threading.current_thread() is threading.main_thread()
        parent = os.getpid() if self.die_with_parent and main_thread else None
        in_child = functools.partial(_in_child, self.cpus, parent)
        if self.log_path is None:
            self.process = subprocess.Popen(
                self.command, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=in_child,
            )
        else:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
                if self.log_command:
                    log.write(("$ " + " ".join(self.command) + "\n").encode())
                    log.flush()
                self.process = subprocess.Popen(
                    self.command, env=env, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=in_child,
                )
        if guard is not None:
            guard.watch(self.process.pid, self.name)
        return self

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def log_tail(self, lines: int = 25) -> str:
        if self.log_path is None:
            return "(log went to the terminal)"
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def log_lines_with(self, markers: Sequence[str]) -> tuple[str, ...]:
        return () if self.log_path is None else log_lines_with(self.log_path, markers)

    def stop(self, timeout_s: float = 30.0, problem_markers: Sequence[str] = ()) -> StopReport | None:
        """Stop signal, wait up to ``timeout_s``, then SIGKILL the group; ``None`` if never
        started. A process that had already exited is reported as it ended."""
        if self.process is None:
            return None
        started = time.monotonic()
        pgid = self.process.pid  # start_new_session: the group id is the leader's pid
        killed = False
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if self.signal_group:
                    os.killpg(pgid, self.stop_signal)
                else:
                    self.process.send_signal(self.stop_signal)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                killed = True
                _kill_group(pgid)
                self.process.wait(10)
        # Children that outlived the leader (same group) go too: never leave them behind.
        leftovers = _kill_group(pgid)
        if _GUARD is not None:
            _GUARD.unwatch(pgid)
        return StopReport(
            name=self.name,
            exit_code=self.process.returncode,
            killed=killed,
            leftovers=leftovers,
            seconds=time.monotonic() - started,
            problems=self.log_lines_with(problem_markers),
            log_path=self.log_path,
        )


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields after "(comm)": state ppid pgrp ...; zombies are gone already.
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _kill_group(pgid: int, settle_s: float = 5.0) -> int:
    """SIGKILL every process of the group and wait (up to ``settle_s``) until none runs, so that
    a caller that checks for leftovers right after a stop sees none; returns how many were alive."""
    alive = len(_group_members(pgid))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + settle_s
    while alive and _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return alive


# Shared-memory files that members of a group name on their command line and that nobody unlinks
# when the group is killed: Triton's python-backend stubs' regions (1-3 MiB each, for good).
SHM_DIR = Path("/dev/shm")
SHM_REGION_PREFIXES = ("triton_python_backend_shm_region_",)


def _shm_regions(pids: Sequence[int], folder: Path = SHM_DIR) -> list[Path]:
    regions = []
    for pid in pids:
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        names = (arg.decode(errors="replace") for arg in args)
        regions += [folder / name for name in names if name.startswith(SHM_REGION_PREFIXES) and "/" not in name]
    return regions


class _Guard:
    """This process's guard: a small process of its own session, started with the first group, that
    reads a pipe from us (``+PGID NAME`` when a group starts, ``-PGID`` when it was stopped). At end of
    file -- this process ended, however: only we hold the pipe's write end, and the kernel closes it
    -- it SIGKILLs every group still listed, waits until none of its processes runs, unlinks their
    shared-memory regions and exits.

    Needed beside the leader's parent-death signal because the leader's children outlive it: a
    python-backend stub checks every 0.3 s that tritonserver still *exists* (``kill(pid, 0)``), and
    a killed tritonserver exists, as a zombie, until its new parent reaps it. Under a PID 1 that
    never reaps (a sandbox's agent, a container's shell) the 8 stubs and 4 vLLM engine cores of an
    ``all`` server all still ran 20 s after tritonserver's SIGKILL; reaped at once, they went within
    1.5 s (stubs) and 2.3 s (engine cores), reaped late on a loaded machine within 5.4 s. The group
    kill needs no reaper: each of them was gone 0.02-1.5 s after the launcher's SIGKILL (2026-12-07,
    2 shared cores). The group is the one a stop kills too. At a normal exit (``atexit``) we close
    the pipe and wait for the guard, which then has nothing left to do."""

    def __init__(self) -> None:
        read_end, write_end = os.pipe()  # not inheritable: no child we start holds it
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", str(Path(__file__).resolve()), "--guard"],
                stdin=read_end, stdout=subprocess.DEVNULL, start_new_session=True,
            )
        finally:
            os.close(read_end)
        self.owner = os.getpid()
        self.watched: dict[int, str] = {}
        self._lock = threading.Lock()
        self._pipe: IO[str] | None = os.fdopen(write_end, "w", buffering=1)
        atexit.register(self.close)

    def _send(self, line: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # the guard is gone (killed): nothing to tell it
            if self._pipe is not None:
                self._pipe.write(line + "\n")

    def watch(self, pgid: int, name: str) -> None:
        with self._lock:
            self.watched[pgid] = name
            self._send(f"+{pgid} {' '.join(name.split())}")

    def unwatch(self, pgid: int) -> None:
        with self._lock:
            if self.watched.pop(pgid, None) is not None:
                self._send(f"-{pgid}")

    def close(self, timeout_s: float = 15.0) -> None:
        """End the guard: it kills what is still watched (nothing after clean stops) and exits."""
        with self._lock:
            if self._pipe is not None:
                with contextlib.suppress(OSError):
                    self._pipe.close()
                self._pipe = None
        if self.owner == os.getpid():  # a forked child closes only its copy of the pipe
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout_s)


_GUARD: _Guard | None = None
_GUARD_LOCK = threading.Lock()


def _guard() -> _Guard:
    """This process's guard, started on first use (again in a forked child: its own)."""
    global _GUARD
    with _GUARD_LOCK:
        if _GUARD is None or _GUARD.owner != os.getpid() or _GUARD.process.poll() is not None:
            # A guard that was killed: the new one takes over what it watched.
            watched = _GUARD.watched if _GUARD is not None and _GUARD.owner == os.getpid() else {}
            _GUARD = _Guard()
            for pgid, name in watched.items():
                _GUARD.watch(pgid, name)
        return _GUARD


def _guard_main(lines: Iterable[str]) -> int:
    """The guard process (:class:`_Guard`): ``lines`` is its pipe, read to the end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the launcher's to handle
    watched: dict[int, str] = {}
    for line in lines:
        word, _, name = line.strip().partition(" ")
        with contextlib.suppress(ValueError):
            if word.startswith("+"):
                watched[int(word[1:])] = name
            elif word.startswith("-"):
                watched.pop(int(word[1:]), None)
    # All at once, then wait: each group's processes gone before the next is killed would add up.
    alive = {pgid: _group_members(pgid) for pgid in watched}
    regions = _shm_regions([pid for members in alive.values() for pid in members])
    for pgid in watched:
        _kill_group(pgid, settle_s=0)
    for pgid, name in watched.items():
        _kill_group(pgid)  # waits until none of them runs
        if alive[pgid]:
            with contextlib.suppress(OSError):
                print(f"{name}: the process that started it ended without stopping it; killed {len(alive[pgid])} "
                      f"process(es) of its group (pgid {pgid})", file=sys.stderr, flush=True)
    for region in regions:
        with contextlib.suppress(OSError):
            region.unlink()
    return 0


def wait_until_ready(
    ready: Callable[[], bool],
    groups: Sequence[ProcessGroup],
    timeout_s: float,
    what: str,
    poll_s: float = 0.5,
    tail_lines: int = 25,
) -> float:
    """Poll ``ready`` until it is true; returns seconds waited. Raises :class:`StartError`
    (with the log's tail) as soon as one of ``groups`` exits, :class:`StartTimeout` at the end."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        for group in groups:
            code = group.exited()
            if code is not None:
                raise StartError(
                    f"{group.name} exited with code {code} before it was ready; log {group.log_path}, "
                    f"last lines:\n{group.log_tail(tail_lines)}"
                )
        if ready():
            return time.monotonic() - started
        time.sleep(poll_s)
    logs = "\n".join(f"--- {g.name} ({g.log_path}):\n{g.log_tail(tail_lines)}" for g in groups)
    raise StartTimeout(f"{what} not ready after {timeout_s:.0f} s.\n{logs}")


def log_lines_with(log_path: Path, markers: Sequence[str]) -> tuple[str, ...]:
    """The lines of a log that hold any of ``markers`` (none when the log cannot be read)."""
    if not markers:
        return ()
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return ()
    return tuple(line for line in text.splitlines() if any(marker in line for marker in markers))


if __name__ == "__main__" and sys.argv[1:] == ["--guard"]:
    sys.exit(_guard_main(sys.stdin))

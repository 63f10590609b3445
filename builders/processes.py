"""One way to run a server as a child process group: start it with a log file, wait until it
answers, stop it (a polite signal, a wait, then SIGKILL for the whole group) and say how it ended.

Used by :class:`builders.tritonserver.TritonServer` and by the benchmark's peer servers
(``vllm serve``, the EPD router). Each process leads its own session, so its group id is its
pid and a stop reaches every child it started (python-backend stubs, vLLM engine cores).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


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


def _in_child(cpus: frozenset[int] | None) -> None:
    """In the child before exec: SIGINT and SIGTERM back to their default actions (a process started
    with SIGINT ignored, from a background job or under nohup, passes that on, and a Python child
    then installs no KeyboardInterrupt handler: our SIGINT stop would do nothing to it); and the
    child's CPU set, which exec keeps and every thread and process it starts inherits."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if cpus:
        os.sched_setaffinity(0, cpus)


@dataclass
class ProcessGroup:
    """``command`` in its own session, stdout+stderr to ``log_path`` (or the terminal).

    ``stop_signal`` goes to the leader only (``signal_group=False``: tritonserver unloads its
    models, which stops their stubs itself) or to the whole group (``True``: vllm serve).
    """

    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    stop_signal: signal.Signals = signal.SIGTERM
    signal_group: bool = True
    log_command: bool = False  # first log line: "$ command" (peer logs read on their own)
    cpus: frozenset[int] | None = None  # the CPUs the process (and all it starts) runs on; None: any
    process: subprocess.Popen[bytes] | None = None

    def start(self, base_env: Mapping[str, str] | None = None) -> ProcessGroup:
        """Start with ``base_env`` (default: this process's environment) updated by ``env``."""
        env = {**(os.environ if base_env is None else base_env), **self.env}
        in_child = functools.partial(_in_child, self.cpus)
        if self.log_path is None:
            self.process = subprocess.Popen(
                self.command, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=in_child,
            )
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            if self.log_command:
                log.write(("$ " + " ".join(self.command) + "\n").encode())
                log.flush()
            self.process = subprocess.Popen(
                self.command, env=env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=in_child,
            )
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

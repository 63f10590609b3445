"""Nothing outlives its launcher (issue 51): ``triton-epd-serve`` killed with SIGKILL (as the OOM
killer ends it) takes its whole server along -- tritonserver, every python-backend stub, every
vLLM engine core, the OpenAI server -- within 5 s, and a launcher started again on the same ports
is ready there. Each role a scale-out node runs: ``all`` (with the OpenAI API), ``encoder``, ``pd``;
the launcher started again is an ``encoder`` one (ready in seconds), killed and checked the same way.

How (builders/processes.py): tritonserver and the OpenAI server get a parent-death signal
(SIGKILL), and the launcher's guard process SIGKILLs their process groups once the launcher is gone
(the stubs would wait for a reaper that may never come) and unlinks the stubs' shared memory.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from builders.stage_watch import server_processes
from builders.tritonserver import REPO_ROOT, SHM_DIR, Ports, free_port, stub_shm_regions
from tests.server.conftest import LAUNCHER_REPOSITORY, LOG_DIR, TEST_EXIT_TIMEOUT_S

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

GONE_WITHIN_S = 5.0
START_TIMEOUT_S = 600.0


@dataclass
class Launcher:
    process: subprocess.Popen[str]
    ports: Ports
    openai_port: int | None
    lines: queue.Queue[str | None]
    output: list[str]
    seen: list[psutil.Process]  # its descendants, when last looked at

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"the launcher exited with {self.process.wait()}:\n{''.join(self.output)}")
            if line.startswith("serving"):
                return
        raise AssertionError(f"the launcher was not serving after {timeout_s:.0f} s:\n{''.join(self.output)}")

    def wait_output_end(self, timeout_s: float = 10.0) -> str:
        """Its output to the end (the end comes when every process that shares it is gone)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                if self.lines.get(timeout=0.1) is None:
                    break
        return "".join(self.output)

    @property
    def port_list(self) -> list[int]:
        ports = [self.ports.http, self.ports.grpc, self.ports.metrics]
        return ports + ([self.openai_port] if self.openai_port is not None else [])


def launch(
    role: str, ports: Ports, openai_port: int | None, node_dir: Path, tag: str, extra: Sequence[str] = ()
) -> Launcher:
    """``triton-epd-serve`` as a user runs it, with its own store and KV folder. The repository is
    test_launcher's: each launcher writes its role's configs there, and a second folder would mean
    a second encoder export (~30 s)."""
    command = [
        sys.executable, "-m", "builders.launcher", "--role", role, "--node-id", f"death-{role}",
        "--http-port", str(ports.http), "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics),
        "--model-repository", str(LAUNCHER_REPOSITORY),
        "--cache-path", str(node_dir / f"death-{role}-embeddings"),
        "--kv-store-path", str(node_dir / f"death-{role}-kv"),
        "--log-file", str(LOG_DIR / f"launcher-death-{tag}-{role}.log"), "--exit-timeout-s", str(TEST_EXIT_TIMEOUT_S),
    ]  # fmt: skip
    if role == "pd":  # an address nobody serves: logged and skipped, the server starts all the same
        command += ["--remote-encoders", f"127.0.0.1:{free_port()}"]
    if openai_port is not None:
        command += ["--openai-port", str(openai_port)]
    command += extra
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str | None] = queue.Queue()
    output: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, name=f"launcher-{role}-{tag}", daemon=True).start()
    return Launcher(process, ports, openai_port, lines, output, [])


def describe(process: psutil.Process, roles: dict[int, str]) -> str:
    if process.pid in roles:
        return roles[process.pid]
    try:
        args = process.cmdline()
    except psutil.Error:
        return "?"
    if "client.openai_server" in args:
        return "openai-server"
    if "--guard" in args:
        return "guard"
    return process.name()


def running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def port_free(port: int) -> bool:
    """Nobody listens on it: a server (SO_REUSEADDR, as Triton's frontends bind) could bind it now."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


@dataclass
class Death:
    seconds: dict[str, float]  # each process (by role) -> seconds from the SIGKILL until it was gone
    left: list[str]
    busy_ports: list[int]
    shm_left: list[str]
    ports_free_s: float

    def describe(self) -> str:
        times = ", ".join(f"{name} {seconds:.2f}" for name, seconds in sorted(self.seconds.items(), key=lambda x: x[1]))
        return f"gone after (s): {times}; ports free after {self.ports_free_s:.2f} s"


def kill_and_watch(launcher: Launcher) -> Death:
    """SIGKILL the launcher; how long each process of its server took to go, and what stayed."""
    root = psutil.Process(launcher.process.pid)
    descendants = launcher.seen = root.children(recursive=True)
    server = next(p for p in root.children() if "tritonserver" in p.name())
    roles = {p.pid: p.role for p in server_processes(server.pid)}
    assert any(role.startswith("stub:") for role in roles.values()), roles
    regions = stub_shm_regions(server.pid)
    names = {p.pid: f"{describe(p, roles)} ({p.pid})" for p in descendants}
    started = time.monotonic()
    launcher.process.send_signal(signal.SIGKILL)
    launcher.process.wait(10)
    seconds: dict[str, float] = {}
    ports_free_s = -1.0
    while time.monotonic() - started < GONE_WITHIN_S:
        for process in descendants:
            if names[process.pid] not in seconds and not running(process):
                seconds[names[process.pid]] = time.monotonic() - started
        if ports_free_s < 0 and all(port_free(port) for port in launcher.port_list):
            ports_free_s = time.monotonic() - started
        if len(seconds) == len(descendants) and ports_free_s >= 0:
            break
        time.sleep(0.01)
    left = [names[p.pid] for p in descendants if running(p)]
    busy = [port for port in launcher.port_list if not port_free(port)]
    return Death(seconds, left, busy, [r for r in regions if (SHM_DIR / r).exists()], ports_free_s)


@contextlib.contextmanager
def cleaned_up(launchers: list[Launcher]) -> Iterator[None]:
    """Whatever the test asserted: nothing a launcher of it started is left running afterwards."""
    try:
        yield
    finally:
        for launcher in launchers:
            with contextlib.suppress(psutil.Error):
                launcher.seen += psutil.Process(launcher.process.pid).children(recursive=True)
            if launcher.process.poll() is None:
                launcher.process.kill()
                launcher.process.wait(10)
            for process in launcher.seen:
                with contextlib.suppress(psutil.Error):
                    process.kill()


@pytest.mark.parametrize("role", ["all", "encoder", "pd"])
def test_a_killed_launcher_takes_its_server_along_and_a_new_one_gets_its_ports(
    model_dir: Path, node_dir: Path, role: str
) -> None:
    ports = Ports.free()
    launchers: list[Launcher] = []
    report = []
    with cleaned_up(launchers):
        # Then a new launcher on the same ports, killed the same way: an encoder one, ready in
        # seconds (a second `all` or `pd` start would add up to a minute each on 2 busy cores).
        for tag, launch_role in (("first", role), ("again", "encoder")):
            openai_port = free_port() if launch_role == "all" else None
            launcher = launch(launch_role, ports, openai_port, node_dir, f"{role}-{tag}")
            launchers.append(launcher)
            started = time.monotonic()
            launcher.wait_serving()
            report.append(f"{launch_role} ({tag}): serving after {time.monotonic() - started:.1f} s")
            death = kill_and_watch(launcher)
            report.append(f"{launch_role} ({tag}): {death.describe()}")
            print("\n" + report[-1])
            assert not death.left, f"still running {GONE_WITHIN_S:.0f} s after the launcher's SIGKILL: {death.left}"
            assert not death.busy_ports, f"ports still held: {death.busy_ports}"
            assert not death.shm_left, f"stub shared memory left in {SHM_DIR}: {death.shm_left}"
            output = launcher.wait_output_end()  # the guard's lines come last
            assert "tritonserver: the process that started it ended without stopping it" in output, output
    (LOG_DIR / f"launcher-death-{role}.txt").write_text("\n".join(report) + "\n")

"""Find, configure, start and stop a real ``tritonserver`` process.

Used by the launcher (``triton-epd-serve``), the server tests and the benchmarks, so
that all of them start Triton the same way. Two installations are supported:

* the NGC Triton image: ``tritonserver`` on PATH, backends in /opt/tritonserver/backends;
* the ``nvidia-pytriton`` wheel (these CPU machines): its bundled binary, with a backend
  folder we assemble under ``build/`` because the python backend needs the stub built
  for *our* interpreter, and the loader needs the interpreter's libpython first on
  ``LD_LIBRARY_PATH`` (otherwise the stub picks up the system libpython and stdlib
  extensions fail with ``undefined symbol: _PyModule_Add``; see docs/facts.md).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from builders.processes import ProcessGroup, StartError, StartTimeout, StopReport, http_ok, wait_until_ready
from builders.stage_watch import StuckStubLaunch, server_processes

__all__ = [
    "PROBLEM_MARKERS", "REPO_ROOT", "Ports", "ServerOptions", "StartError", "StartTimeout", "StopReport",
    "TritonInstall", "TritonServer", "find_tritonserver", "free_port",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
NGC_BACKEND_DIR = Path("/opt/tritonserver/backends")


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path
    env: dict[str, str]


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002

    @classmethod
    def free(cls) -> Ports:
        """Three ports the OS says are free now (for tests that run beside a server)."""
        ports: list[int] = []
        while len(ports) < 3:
            port = free_port()
            if port not in ports:
                ports.append(port)
        return cls(*ports)


# Below Linux's ephemeral range (32768-60999): tritonserver binds its ports only after every
# model has loaded (tens of seconds), and meanwhile the vLLM engines it starts take ephemeral
# ports of their own (bind to port 0) -- a port the OS handed out as free could be gone.
_PORT_RANGE = (20000, 32000)


def free_port() -> int:
    """A port free now, outside the range the OS hands out for bind(0)."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(*_PORT_RANGE)
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORT_RANGE}")


def find_tritonserver(build_dir: Path = REPO_ROOT / "build") -> TritonInstall:
    """Prefer a system tritonserver (NGC image); fall back to the pytriton wheel's."""
    system_binary = shutil.which("tritonserver")
    if system_binary and NGC_BACKEND_DIR.is_dir():
        return TritonInstall(Path(system_binary), NGC_BACKEND_DIR, dict(os.environ))
    return _pytriton_install(build_dir)


def _pytriton_install(build_dir: Path) -> TritonInstall:
    # Locate the wheel without importing it: we only need its files, not its Python API.
    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "No tritonserver found: neither on PATH (NGC image) nor the nvidia-pytriton "
            "wheel in this Python. Run `make setup` first."
        )
    wheel_root = Path(spec.origin).resolve().parent / "tritonserver"
    libs_dir = wheel_root.parent.parent / "nvidia_pytriton.libs"
    backend_dir = _assemble_backend_dir(wheel_root, build_dir / "triton_backends")

    env = dict(os.environ)
    libpython_dir = str(sysconfig.get_config_var("LIBDIR"))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (libpython_dir, str(libs_dir), env.get("LD_LIBRARY_PATH", "")) if p
    )
    # The stub runs model.py with the interpreter it embeds; make our venv's packages
    # (and the project itself, for `python_backends`) importable there.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
    )
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    env.setdefault("VIRTUAL_ENV", sys.prefix)
    return TritonInstall(wheel_root / "bin" / "tritonserver", backend_dir, env)


def _assemble_backend_dir(wheel_root: Path, target: Path) -> Path:
    """backends/python with the stub for this interpreter's version (cheap, idempotent)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = wheel_root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise RuntimeError(f"The pytriton wheel has no python backend stub for Python {version}")
    python_dir = target / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    wheel_python = wheel_root / "backends" / "python"
    for source in (*wheel_python.iterdir(), stub):
        if source.is_dir():
            continue
        dest = python_dir / source.name
        if not dest.exists() or dest.stat().st_size != source.stat().st_size:
            shutil.copy2(source, dest)
    return target


@dataclass
class ServerOptions:
    model_repository: Path
    ports: Ports = field(default_factory=Ports)
    log_verbose: int = 0
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    # How long a stop waits for in-flight requests and model unloads before Triton gives up
    # ("Exit timeout expired", exit code 1); None: Triton's default, 30 s.
    exit_timeout_s: int | None = None
    # Triton's config auto-complete (its default): off, as the builders write every config in full
    # and it starts one more stub per python model (to import its model.py and ask it) before the
    # instance's own: a --role encoder server was ready in 3.1 s with it, 1.0 s without
    # (docs/benchmarks/cold-start.md).
    auto_complete_config: bool = False
    # The CPUs tritonserver, its frontends and every stub run on (``--cpus LIST``); None: any.
    cpus: frozenset[int] | None = None
    # The HTTP, gRPC and metrics address; None: Triton's default, every interface.
    host: str | None = None

    @property
    def stop_timeout_s(self) -> float:
        """How long to wait for tritonserver to exit before SIGKILL: past its own exit timeout."""
        return (30 if self.exit_timeout_s is None else self.exit_timeout_s) + 30.0


# Lines of a tritonserver log that mean the stop (or the run) was not clean: a python-backend
# stub crashed (a segfault, or glibc aborting on a corrupted heap), tritonserver itself crashed
# (its own handler's line, main.cc), or a model did not unload within Triton's exit timeout.
EXIT_TIMEOUT_MARKERS = ("Exit timeout expired", "failed to stop server")
HEAP_CORRUPTION_MARKERS = ("malloc(): ", "free(): ", "malloc_consolidate(): ", "double free or corruption",
                           "corrupted size vs. prev_size", "corrupted double-linked list")
PROBLEM_MARKERS = ("Segfault encountered", "Signal (11) received", *HEAP_CORRUPTION_MARKERS, *EXIT_TIMEOUT_MARKERS)


SHM_DIR = Path("/dev/shm")
SHM_REGION_PREFIX = "triton_python_backend_shm_region_"


def stub_shm_regions(server_pid: int) -> list[str]:
    """The shared-memory regions of the server's python-backend stubs (each stub's command line
    names its region)."""
    regions = []
    for process in server_processes(server_pid):
        if process.role.startswith("stub:"):
            with contextlib.suppress(psutil.Error):
                regions += [arg for arg in psutil.Process(process.pid).cmdline() if arg.startswith(SHM_REGION_PREFIX)]
    return regions


def remove_shm_regions(regions: list[str], folder: Path = SHM_DIR) -> list[str]:
    """Unlink what is left of ``regions``: a server stopped by SIGKILL never unlinks its stubs'
    (1-3 MiB each, for good in /dev/shm; 7 after one afternoon of halted benchmark runs). Returns
    the ones removed."""
    removed = []
    for name in regions:
        with contextlib.suppress(FileNotFoundError):
            (folder / name).unlink()
            removed.append(name)
    return removed


class TritonServer:
    """A tritonserver child process: ``with TritonServer(opts) as server: ...``.

    Callers own the lifetime; ``stop()`` sends SIGINT (Triton unloads models, which lets
    python models shut vLLM down), SIGKILLs the process group if it hangs, and returns a
    :class:`StopReport` (also kept as ``stop_report``) saying how the server ended.
    """

    def __init__(self, options: ServerOptions, log_path: Path | None = None) -> None:
        self.options = options
        self.install = find_tritonserver()
        self.log_path = log_path
        self.group = ProcessGroup(
            "tritonserver", self.command(), dict(options.extra_env), log_path,
            stop_signal=signal.SIGINT, signal_group=False, cpus=options.cpus,
        )
        self.stop_report: StopReport | None = None

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self.group.process

    @property
    def client_host(self) -> str:
        """Where this machine's clients reach the server: its address, or loopback when it listens
        on every interface."""
        return "127.0.0.1" if self.options.host in (None, "0.0.0.0", "::") else str(self.options.host)

    @property
    def http_url(self) -> str:
        return f"{self.client_host}:{self.options.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{self.client_host}:{self.options.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.client_host}:{self.options.ports.metrics}/metrics"

    def command(self) -> list[str]:
        opts = self.options
        return [
            str(self.install.binary),
            f"--model-repository={opts.model_repository}",
            f"--backend-directory={self.install.backend_dir}",
            f"--http-port={opts.ports.http}",
            f"--grpc-port={opts.ports.grpc}",
            f"--metrics-port={opts.ports.metrics}",
            *([] if opts.host is None else [f"--{api}-address={opts.host}" for api in ("http", "grpc", "metrics")]),
            f"--log-verbose={opts.log_verbose}",
            # A failing model must fail the server start, not leave it half-ready.
            "--exit-on-error=true",
            *([] if opts.auto_complete_config else ["--disable-auto-complete-config"]),
            *([] if opts.exit_timeout_s is None else [f"--exit-timeout-secs={opts.exit_timeout_s}"]),
            *opts.extra_args,
        ]

    def start(self) -> TritonServer:
        # The options may have changed since __init__.
        self.group.command, self.group.env = self.command(), dict(self.options.extra_env)
        self.group.cpus = self.options.cpus
        self.group.start(base_env=self.install.env)
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        """Block until /v2/health/ready and /metrics answer 200; returns seconds waited. Raises
        :class:`StartError` (a RuntimeError) if the server exits first, :class:`StartTimeout`
        (a TimeoutError) after ``timeout_s``; both carry the log's last lines."""
        url = f"http://{self.http_url}/v2/health/ready"
        stuck = StuckStubLaunch(self.process.pid) if self.process is not None else None

        def ready() -> bool:
            # A load that Triton's python backend would never finish (builders/stage_watch.py):
            # make it fail now, with Triton's error, rather than wait out ``timeout_s``.
            for line in stuck.check() if stuck is not None else []:
                print(f"tritonserver: {line}", file=sys.stderr, flush=True)
            # The metrics service starts ~0.1 s after HTTP and gRPC report ready: a caller that
            # reads /metrics at once (the scale-out tests do) was refused in that gap.
            return http_ok(url) and http_ok(self.metrics_url)

        return wait_until_ready(ready, [self.group], timeout_s, "tritonserver", poll_s=0.25, tail_lines=40)

    def stop(self, timeout_s: float | None = None) -> StopReport | None:
        """Stop and report how it went (``None`` if it was never started). SIGKILL after
        ``timeout_s`` (default: 30 s past Triton's own exit timeout)."""
        if self.stop_report is not None and self.process is not None and self.process.poll() is not None:
            return self.stop_report  # stopped before (e.g. after a stage crash): how that stop went
        regions = stub_shm_regions(self.process.pid) if self.process is not None else []
        report = self.group.stop(self.options.stop_timeout_s if timeout_s is None else timeout_s, PROBLEM_MARKERS)
        if report is not None:
            self.stop_report = report
            if report.killed or report.leftovers:
                remove_shm_regions(regions)
        return report

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""Diagnostics for a server stop (issue 17): what each process was doing around SIGINT.

Always on: a stop still running STUCK_AFTER_S after SIGINT gets the stacks of the stubs of the
models still loaded, summarized in the failed stop check's message (``watch_stuck_stop``).

Opt-in: set ``TRITON_EPD_STOP_DUMP=<folder>`` and every server the tests stop through ``serving()``
gets, in ``<folder>/<log stem>-<n>/``: Triton's model index and ``/metrics`` just before the
stop, and ``py-spy dump`` stacks of tritonserver and every process below it (python-backend
stubs, vLLM engine cores) before SIGINT and again some seconds after. py-spy is taken from
``TRITON_EPD_PY_SPY``, PATH or beside the test's Python (requirements/cpu.txt installs it);
without it only the index and metrics are written.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families

from builders.stage_watch import find_py_spy, native_stacks, server_processes
from builders.tritonserver import StopReport, TritonServer
from python_backends.runtime.heartbeat import heartbeat_age_s

DUMP_ENV = "TRITON_EPD_STOP_DUMP"
AFTER_SIGINT_S = (10.0, 45.0)
_counter = itertools.count()


def enabled() -> bool:
    return bool(os.environ.get(DUMP_ENV))


def _fetch(url: str) -> str:
    try:
        request = urllib.request.Request(url, method="POST" if url.endswith("/index") else "GET")
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.read().decode(errors="replace")
    except Exception as error:  # a diagnostic: record why it failed and go on
        return f"<failed: {error!r}>"


def _stacks(pid: int, py_spy: str | None) -> str:
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error as error:
        return f"<no process {pid}: {error!r}>"
    parts: list[str] = []
    for process in processes:
        try:
            header = f"==== pid {process.pid} ppid {process.ppid()} {' '.join(process.cmdline())[:200]}"
        except psutil.Error:
            continue
        parts.append(header)
        if py_spy is None:
            continue
        for extra in ((), ("--native",)) if "stub" in header else ((),):
            result = subprocess.run(
                [py_spy, "dump", "--pid", str(process.pid), *extra],
                capture_output=True, text=True, timeout=60, check=False,
            )
            parts.append(result.stdout + result.stderr)
    return "\n".join(parts)


def stop_with_dump(server: TritonServer) -> StopReport | None:
    """``server.stop()``, with the state dumps described above around it."""
    folder = Path(os.environ[DUMP_ENV]) / f"{server.log_path.stem if server.log_path else 'server'}-{next(_counter)}"
    folder.mkdir(parents=True, exist_ok=True)
    py_spy = find_py_spy()
    pid = server.group.pid
    (folder / "index.json").write_text(_fetch(f"http://{server.http_url}/v2/repository/index"))
    (folder / "metrics.txt").write_text(_fetch(server.metrics_url))
    if pid is not None:
        (folder / "stacks-before.txt").write_text(_stacks(pid, py_spy))
    start = time.monotonic()

    def later() -> None:
        for index, delay in enumerate(AFTER_SIGINT_S):
            time.sleep(max(0.0, start + delay - time.monotonic()))
            if pid is None or not psutil.pid_exists(pid):
                return
            (folder / f"stacks-after-{index}-{delay:.0f}s.txt").write_text(_stacks(pid, py_spy))

    watcher = threading.Thread(target=later, daemon=True)
    watcher.start()
    report = server.stop()
    (folder / "report.txt").write_text(repr(report))
    return report


# A stop that takes longer than this after SIGINT is stuck somewhere (a healthy one takes 5-20 s
# here): the stubs of the models still loaded get their stacks taken, so that a failed stop
# check (in CI too, where nothing but the failure message survives) says where they hung.
STUCK_AFTER_S = 40.0
SUMMARY_FRAMES = 3


def models_still_loaded(log_text: str) -> list[str]:
    """The models Triton's log shows loaded more often than unloaded."""
    loaded = Counter(re.findall(r"successfully loaded '([^']+)'", log_text))
    loaded.subtract(re.findall(r"successfully unloaded '([^']+)'", log_text))
    return sorted(model for model, count in loaded.items() if count > 0)


def _stub_pids(server_pid: int, models: list[str]) -> dict[str, list[int]]:
    """Each model's stub pids, from one walk of the server's process tree."""
    processes = server_processes(server_pid)
    return {model: [p.pid for p in processes if p.role == f"stub:{model}"] for model in models}


def _connections_to(port: int) -> int:
    try:
        return sum(1 for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == port)
    except psutil.Error:
        return -1


def _request_counters(metrics_text: str, models: list[str]) -> list[str]:
    """The /metrics lines (still served while Triton waits for its models) that say whether the
    models still loaded have requests: ours (running requests, open BLS streams) and Triton's."""
    wanted = [f"epd_{model}_" for model in models] + [f'model="{model}"' for model in models]
    return [
        "  " + line for line in metrics_text.splitlines()
        if not line.startswith("#") and any(w in line for w in wanted)
        and any(k in line for k in ("running_requests", "open_streams", "pending_request", "request_success",
                                     "request_failure", "inference_count"))
    ]


def _gauges(metrics_text: str) -> dict[str, float]:
    """Every sample that is not a counter's, by name (the first of each name); ValueError when
    ``metrics_text`` is not the metrics format."""
    gauges: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.type != "counter":
            for sample in family.samples:
                gauges.setdefault(sample.name, float(sample.value))
    return gauges


def held_by_triton(models: list[str], metrics_text: str, beating: dict[str, bool], connections: int) -> bool:
    """Whether only Triton itself can still hold ``models``: each is one of our decoupled models
    whose own counters say it holds nothing (``epd_<model>_running_requests`` 0, no open BLS
    stream), whose stub still runs Python and never began ``finalize`` (its heartbeat file is
    fresh: finalize removes it first), and no gRPC connection of this process to the server is
    left. That is Triton 2.51's gRPC frontend keeping a request of a cancelled stream alive
    (``make cancel-storm`` reproduces it on a tiny model; fixed upstream; docs/operations.md "Server stop").
    Anything else (a hung stub, a request of ours never ended, a stream a test left open) is not."""
    try:
        gauges = _gauges(metrics_text)
    except ValueError:  # /metrics did not answer (``_fetch``'s "<failed: ...>"): nothing is known
        return False

    def holds_nothing(model: str) -> bool:
        running = gauges.get(f"epd_{model}_running_requests")
        streams = gauges.get(f"epd_{model}_bls_open_streams")
        return running == 0 and not streams and beating.get(model, False)

    return bool(models) and connections == 0 and all(holds_nothing(model) for model in models)


def _beating(heartbeats: Path | None, pids: list[int], fresh_s: float = 5.0) -> bool:
    """Every stub of ``pids`` beat within ``fresh_s`` (no file: finalize began, it removes it first)."""
    if heartbeats is None or not pids:
        return False
    ages = [heartbeat_age_s(heartbeats, pid) for pid in pids]
    return all(age is not None and age < fresh_s for age in ages)


def summarize_stacks(stacks: str, frames: int = SUMMARY_FRAMES) -> list[str]:
    """Each thread of a ``py-spy dump`` with its first ``frames`` named frames (raw addresses
    skipped): enough to tell a lock wait, a GIL wait and an idle thread apart."""
    lines: list[str] = []
    shown = frames
    for line in stacks.splitlines():
        if line.startswith("Thread "):
            lines.append("  " + line.strip())
            shown = 0
        elif shown < frames and line.startswith("    ") and not line.strip().startswith("0x"):
            lines.append("      " + line.strip()[:160])
            shown += 1
    return lines


@dataclass
class StuckStop:
    """What ``watch_stuck_stop`` found: empty when the stop ended in time."""

    summary: list[str] = field(default_factory=list)
    held_by_triton: bool = False  # see held_by_triton()

    def describe(self) -> str:
        return "\n".join(self.summary)


@contextlib.contextmanager
def watch_stuck_stop(
    server: TritonServer, heartbeats: Path | None = None, after_s: float | None = None
) -> Iterator[StuckStop]:
    """Around ``server.stop()``: if the server still runs STUCK_AFTER_S later, the stacks of the
    stubs of the models still loaded go to ``<log>.stuck-stop.txt``, a summary into the result,
    and whether only Triton holds them (``heartbeats``: the server's heartbeat folder)."""
    found = StuckStop()
    after_s = STUCK_AFTER_S if after_s is None else after_s
    done = threading.Event()
    pid = server.group.pid

    def watch() -> None:
        if done.wait(after_s) or pid is None or not psutil.pid_exists(pid) or server.log_path is None:
            return
        models = models_still_loaded(server.log_path.read_text(errors="replace"))
        dump = []
        found.summary.append(f"still loaded {after_s:.0f} s after SIGINT: {', '.join(models) or 'none'}")
        # A gRPC stream a test left open holds its model live as much as a hung stub does.
        connections = _connections_to(server.options.ports.grpc)
        found.summary.append(f"this test process's connections to its gRPC port: {connections}")
        metrics_text = _fetch(server.metrics_url)
        found.summary.extend(_request_counters(metrics_text, models))
        stubs = _stub_pids(pid, models)
        beating = {model: _beating(heartbeats, pids) for model, pids in stubs.items()}
        found.summary.append(f"stubs still beating (no finalize began): {beating}")
        found.held_by_triton = held_by_triton(models, metrics_text, beating, connections)
        for model, pids in stubs.items():
            for stub in pids:
                stacks = native_stacks(stub)
                dump.append(f"==== {model}: stub pid {stub}\n{stacks}")
                found.summary.append(f"{model}'s stub (pid {stub}):")
                found.summary.extend(summarize_stacks(stacks))
        path = server.log_path.with_suffix(".stuck-stop.txt")
        path.write_text("\n".join(dump))
        found.summary.append(f"full stacks: {path}")

    watcher = threading.Thread(target=watch, name="stuck-stop-watch", daemon=True)
    watcher.start()
    try:
        yield found
    finally:
        done.set()
        watcher.join()

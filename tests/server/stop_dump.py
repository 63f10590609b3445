"""Opt-in diagnostics for a server stop (issue 17): what each process was doing around SIGINT.

Set ``TRITON_EPD_STOP_DUMP=<folder>`` and every server the tests stop through ``serving()``
gets, in ``<folder>/<log stem>-<n>/``: Triton's model index and ``/metrics`` just before the
stop, and ``py-spy dump`` stacks of tritonserver and every process below it (python-backend
stubs, vLLM engine cores) before SIGINT and again some seconds after. py-spy is taken from
``TRITON_EPD_PY_SPY`` or PATH; without it only the index and metrics are written.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import psutil

from builders.tritonserver import StopReport, TritonServer

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
    py_spy = os.environ.get("TRITON_EPD_PY_SPY") or shutil.which("py-spy")
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

"""CPU seconds of this process's descendants over time, split into a client's process tree and the
rest (the servers this process started), so that a window's CPU can be read off afterwards.

On a 2-core machine a load generator's own CPU is taken from the server it measures; this says
how much each client took within its measured window (``bench.aiperf_run``).
"""

from __future__ import annotations

import bisect
import threading
import time

import psutil

CLIENT, SERVER = "client", "server"


class CpuSampler:
    """A thread that every ``interval_s`` sums user + system CPU seconds per group. A process keeps
    its last reading once it has exited (at most one interval of its CPU is lost)."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []  # (time.time(), CPU s so far per group)
        self._last: dict[int, tuple[str, float]] = {}  # pid -> (group, CPU s)
        self._client_pid: int | None = None
        self.own_cpu_s = 0.0  # this thread's CPU: to take out of the sampling process's own
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def set_client(self, pid: int | None) -> None:
        """Processes first seen under ``pid`` (itself included) count as the client's from now on."""
        self._client_pid = pid
        self.sample()

    def sample(self) -> None:
        with self._lock:
            self._sample()

    def _sample(self) -> None:
        client = self._client_pid
        client_tree: set[int] = set()
        if client is not None:
            try:
                root = psutil.Process(client)
                client_tree = {client, *(p.pid for p in root.children(recursive=True))}
            except psutil.Error:
                pass
        for process in psutil.Process().children(recursive=True):
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            # A client process the thread saw before set_client() moves to the client (a few ms of CPU).
            group = CLIENT if process.pid in client_tree else self._last.get(process.pid, (SERVER, 0.0))[0]
            self._last[process.pid] = (group, times.user + times.system)
        totals = {CLIENT: 0.0, SERVER: 0.0}
        for group, seconds in self._last.values():
            totals[group] += seconds
        self.samples.append((time.time(), totals))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            started = time.thread_time()
            self.sample()
            self.own_cpu_s += time.thread_time() - started

    def used(self, group: str, start: float, end: float) -> float | None:
        """CPU seconds ``group`` used between two ``time.time()`` values (linear between samples);
        None when the samples do not cover the window."""
        if not self.samples or start < self.samples[0][0] or end > self.samples[-1][0]:
            return None
        return self._at(group, end) - self._at(group, start)

    def _at(self, group: str, when: float) -> float:
        times = [t for t, _ in self.samples]
        i = bisect.bisect_left(times, when)
        if times[i] == when or i == 0:
            return self.samples[i][1][group]
        (t0, a), (t1, b) = self.samples[i - 1], self.samples[i]
        return a[group] + (b[group] - a[group]) * (when - t0) / (t1 - t0)

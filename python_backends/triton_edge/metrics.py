"""A model's custom metrics on Triton's /metrics, created and released in one place.

Lifetime rule: Triton requires a ``MetricFamily`` to outlive its ``Metric``s, and both must go
while the stub is still alive. Left to the interpreter's exit, they are destroyed with the stub
(``Metric::Clear <- MetricFamily::~MetricFamily <- Stub::~Stub``) after its shared memory is
gone, and every server stop logged ``Segfault encountered``. So models never hold a
``pb_utils.Metric``: :class:`ModelMetrics` keeps them and hands out :class:`MetricHandle`s, and
:meth:`ModelMetrics.release` (called by the model's ``finalize``) drops every metric, then every
family.

Cost rule: every ``Metric.set``/``increment`` of the python backend is a blocking round trip from
the stub to the server process, on the event loop that streams every request's tokens. ``epd``
once sent 37 per request, then ~10 (every gauge whose value moved), and at c=8 with new images its
colocated path was 1.1-1.2x ``llm`` with them and level without (2026-12-02). So a gauge is sent
only when its value changes, and the gauges that follow epd's state (store, serving paths) go out
from one task every second on that loop, never per request; counters still go at once, as a
client that counts requests reads them right after its answers (tests/unit/test_path_metrics.py).

Lock rule: a gauge moves by ``increment`` of its difference, never by ``Metric.set`` (which keeps
the GIL while it waits for the stub's message mutex: a link of the BLS lock cycle), and every
``increment`` runs under one lock per model (two at once on one metric crash the server);
docs/upstream/python-backend-bls-deadlock.md.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import triton_python_backend_utils as pb_utils


class MetricHandle:
    """``set``/``increment`` on one metric; does nothing once its model's metrics are released."""

    def __init__(self, owner: ModelMetrics, key: tuple[str, tuple[tuple[str, str], ...]]) -> None:
        self._owner = owner
        self.key = key  # (name, labels)

    def set(self, value: float) -> None:
        """Send ``value``, unless the gauge already holds it (see the module's cost rule)."""
        self._owner.set(self.key, value)

    def increment(self, value: float = 1) -> None:
        self._owner.increment(self.key, value)


class ModelMetrics:
    def __init__(self, model_name: str) -> None:
        self._labels = {"model": model_name}
        self._families: dict[str, pb_utils.MetricFamily] = {}
        self._metrics: dict[tuple[str, tuple[tuple[str, str], ...]], pb_utils.Metric] = {}
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}  # what each gauge holds
        self._lock = threading.Lock()  # metrics move from several threads (execute, the event loop)

    def _handle(self, kind: Any, name: str, description: str, labels: dict[str, str]) -> MetricHandle:
        family = self._families.get(name)
        if family is None:  # Triton refuses a second family of one name
            family = pb_utils.MetricFamily(name=name, description=description, kind=kind)
            self._families[name] = family
        all_labels = {**self._labels, **labels}
        key = (name, tuple(sorted(all_labels.items())))
        if key not in self._metrics:
            self._metrics[key] = family.Metric(labels=all_labels)
        return MetricHandle(self, key)

    def gauge(self, name: str, description: str, **labels: str) -> MetricHandle:
        return self._handle(pb_utils.MetricFamily.GAUGE, name, description, labels)

    def counter(self, name: str, description: str, **labels: str) -> MetricHandle:
        return self._handle(pb_utils.MetricFamily.COUNTER, name, description, labels)

    def live(self, key: tuple[str, tuple[tuple[str, str], ...]]) -> pb_utils.Metric | None:
        return self._metrics.get(key)

    def set(self, key: tuple[str, tuple[tuple[str, str], ...]], value: float) -> None:
        """Move the gauge ``key`` to ``value``, by ``increment`` of the difference: a round trip to
        the server only when it changes, and never ``Metric.set``, which keeps the GIL while it
        waits for the stub's message mutex (one link of the BLS lock cycle,
        docs/upstream/python-backend-bls-deadlock.md); ``increment`` lets it go."""
        with self._lock:
            delta = value - self._values.get(key, 0.0)  # a new gauge starts at 0
            self._values[key] = value
            self._increment(key, delta)

    def increment(self, key: tuple[str, tuple[tuple[str, str], ...]], value: float) -> None:
        with self._lock:
            self._increment(key, value)

    def _increment(self, key: tuple[str, tuple[tuple[str, str], ...]], value: float) -> None:
        """Under ``_lock``: the python backend's ``Metric.increment`` lets the GIL go and then
        rewrites the metric's shared-memory members unlocked, so two threads incrementing one
        metric at once crash the server (docs/upstream/python-backend-bls-deadlock.md). A Python
        lock waits without the GIL, so holding it here closes no cycle."""
        metric = self._metrics.get(key)
        if metric is not None and value:  # adding 0 is a round trip for nothing
            metric.increment(value)

    def release(self) -> None:
        """Drop every metric, then every family, while the stub is still alive. Only this object
        holds them, so each is destroyed as its entry goes (no collection pass: that would also
        run the finalizers of whatever else is garbage, such as a shut-down vLLM engine's)."""
        self._metrics.clear()
        self._values.clear()
        self._families.clear()


class CacheMetrics:
    """The embedding cache on /metrics, for one model.

    Counters are what this model saw (``epd_cache_lookups{result=hit|miss|join}``,
    ``epd_cache_encodes``). With ``node_gauges`` (one model per node: ``epd``) it also exports
    the node store's state as ``epd_store_*`` gauges, refreshed by :meth:`refresh`.
    """

    STORE_GAUGES = {
        "bytes_used": "Embedding bytes held by the node's store",
        "capacity_bytes": "Capacity of the node's store in bytes",
        "entries": "Embeddings held by the node's store",
        "evictions": "Entries evicted (LRU) from the node's store since it was created",
        "expirations": "Entries dropped by TTL from the node's store since it was created",
        "active_leases": "Embedding store leases held by running requests (all processes)",
    }

    def __init__(self, metrics: ModelMetrics, store: Any, node_gauges: bool = False) -> None:
        self._store = store
        lookups = "Embedding cache lookups of this model's images, by result"
        self._lookups = {
            result: metrics.counter("epd_cache_lookups", lookups, result=result) for result in ("hit", "miss", "join")
        }
        self._encodes = metrics.counter("epd_cache_encodes", "Images this model encoded and wrote to the store")
        self._gauges = {
            name: metrics.gauge(f"epd_store_{name}", description)
            for name, description in (self.STORE_GAUGES.items() if node_gauges else ())
        }

    def count(self, result: str, n: int = 1) -> None:
        if n:
            self._lookups[result].increment(n)
            if result == "miss":
                self._encodes.increment(n)

    def refresh(self) -> None:
        if not self._gauges:
            return
        snapshot = self._store.metrics()
        for name, gauge in self._gauges.items():
            gauge.set(snapshot[name])

    async def refresh_every(
        self, period_s: float, reap_every_s: float = 5.0, also: Callable[[], None] | None = None
    ) -> None:
        """Keep the gauges current between requests (other processes change the store too), and
        (the node's one custodian) return what crashed processes left in the store every
        ``reap_every_s``: their leases, single-flight claims and reader slots. Without it a
        killed encoder's or stage's leases would pin their entries until the store filled up.
        ``also``: the model's other state gauges, refreshed in the same beat (the cost rule)."""
        reaped_at = float("-inf")
        while True:
            if self._gauges and time.monotonic() - reaped_at >= reap_every_s:
                reaped_at = time.monotonic()
                self.reap()
            self.refresh()
            if also is not None:
                also()
            await asyncio.sleep(period_s)

    def reap(self) -> None:
        try:
            report = self._store.reap_dead_processes()
        except Exception as exc:  # the store's own errors are coded; a failed round is retried later
            pb_utils.Logger.log_warn(f"embedding store: reaping dead processes failed: {exc!r}")
            return
        if report.leases or report.claims or report.readers:
            pb_utils.Logger.log_warn(
                f"embedding store: released {report.leases} leases, {report.claims} claims and "
                f"{report.readers} reader slots of processes that died"
            )

class PathMetrics:
    """``epd``'s serving paths on /metrics: what was chosen and why, and the cost model's inputs.

    - ``epd_path_requests{path, reason}``: requests served per path; reason ``predicted``,
      ``kept``, ``probe`` or ``dominates`` (adaptive; the last in the E|PD topology on shared
      engines), ``forced`` (request parameter ``path``), ``policy`` (a fixed policy), ``only`` (one
      path available), ``encoder pinned``;
    - ``epd_path_last_decision{path}``: 1 for the path of the latest decision, 0 for the other;
    - ``epd_path_predicted_ms{path}``: the latest adaptive decision's predictions (-1: unknown);
    - ``epd_path_in_flight{path}``: requests running on each path now;
    - ``epd_path_estimate_ms{path, stage, bucket}``: each stage estimate (median of its recent
      samples at any load), ms per unit of load;
    - ``epd_path_probe_interval_s{path}``: how old a path's estimate may get before a probe
      (longer while probes keep finding the path slower).

    The counter goes per request (:meth:`record`); the gauges are state, sent by :meth:`refresh`
    every second (the module's cost rule).
    """

    def __init__(self, metrics: ModelMetrics, paths: Any) -> None:
        self._metrics = metrics
        self._paths = tuple(paths)
        self._last: Any = None  # the latest decision (``path_cost.Decision``), not yet on /metrics
        self._last_predicted: Any = None  # the latest adaptive decision's

    def record(self, decision: Any) -> None:
        """After a decision (``path_cost.Decision``); the gauges follow at the next :meth:`refresh`."""
        self._metrics.counter("epd_path_requests", "Requests served per path, by why it was chosen",
                              path=decision.path, reason=decision.reason).increment()
        self._last = decision
        if decision.predicted_ms:
            self._last_predicted = decision

    def refresh(self, cost_model: Any) -> None:
        """Send what changed since the last refresh: the latest decision, the requests on each
        path and the cost model's estimates (``PathCostModel``)."""
        m = self._metrics
        for path in self._paths:
            if self._last is not None:
                m.gauge("epd_path_last_decision", "1 for the path of the latest decision", path=path).set(
                    float(path == self._last.path)
                )
            if self._last_predicted is not None:
                predicted = self._last_predicted.predicted_ms.get(path)
                m.gauge("epd_path_predicted_ms", "The latest adaptive decision's predicted completion time (-1: "
                        "unknown)", path=path).set(-1.0 if predicted is None else predicted)
            m.gauge("epd_path_in_flight", "Requests running on each serving path", path=path).set(
                cost_model.in_flight[path]
            )
            m.gauge("epd_path_probe_interval_s", "How old a path's estimate may get before a probe", path=path).set(
                cost_model.probe_intervals[path]
            )
        for (path, stage, bucket), value in cost_model.snapshot().items():
            m.gauge("epd_path_estimate_ms", "The cost model's stage estimates, ms per unit of load",
                    path=path, stage=stage, bucket=bucket).set(value)


class KvTransferMetrics:
    """``epd_kv_pending_transfers``: prefilled KV transfers in the node's KV folder that no decode
    has consumed or discarded yet (0 once every request, cancelled ones too, has ended)."""

    def __init__(self, metrics: ModelMetrics, pending: Callable[[], int]) -> None:
        self._count = pending  # ``pd.manifest.list_transfers`` of the KV folder, counted
        self._pending = metrics.gauge("epd_kv_pending_transfers", "Prefilled KV transfers not yet consumed or dropped")

    def refresh(self) -> None:
        self._pending.set(self._count())

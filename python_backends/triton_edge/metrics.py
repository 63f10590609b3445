"""A model's custom metrics on Triton's /metrics, created and released in one place.

Lifetime rule: Triton requires a ``MetricFamily`` to outlive its ``Metric``s, and both must go
while the stub is still alive. Left to the interpreter's exit, they are destroyed with the stub
(``Metric::Clear <- MetricFamily::~MetricFamily <- Stub::~Stub``) after its shared memory is
gone, and every server stop logged ``Segfault encountered`` (issue 17). So models never hold a
``pb_utils.Metric``: :class:`ModelMetrics` keeps them and hands out :class:`MetricHandle`s, and
:meth:`ModelMetrics.release` (called by the model's ``finalize``) drops every metric, then every
family.

Cost rule: every ``Metric.set``/``increment`` of the python backend is a blocking round trip from
the stub to the server process. ``epd`` sent 37 per request (with the 10 cost-model estimates of a
one-image-size workload), 17 of them before its engine started the request: every gauge and
estimate at each decision. Now a gauge is sent only when its value changes, a decision sends no
estimates, and epd records it after the first token (tests/unit/test_path_metrics.py).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import triton_python_backend_utils as pb_utils

from python_backends.pd.transfer import list_transfers


class MetricHandle:
    """``set``/``increment`` on one metric; does nothing once its model's metrics are released."""

    def __init__(self, owner: ModelMetrics, key: tuple[str, tuple[tuple[str, str], ...]]) -> None:
        self._owner = owner
        self.key = key  # (name, labels)

    def set(self, value: float) -> None:
        """Send ``value``, unless the gauge already holds it (see the module's cost rule)."""
        self._owner.set(self.key, value)

    def increment(self, value: float = 1) -> None:
        metric = self._owner.live(self.key)
        if metric is not None:
            metric.increment(value)


class ModelMetrics:
    def __init__(self, model_name: str) -> None:
        self._labels = {"model": model_name}
        self._families: dict[str, pb_utils.MetricFamily] = {}
        self._metrics: dict[tuple[str, tuple[tuple[str, str], ...]], pb_utils.Metric] = {}
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}  # last value each gauge was sent

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
        """Set the gauge ``key`` to ``value``: a round trip to the server only when it changes."""
        metric = self._metrics.get(key)
        if metric is None or self._values.get(key) == value:
            return
        metric.set(value)
        self._values[key] = value

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

    async def refresh_every(self, period_s: float, reap_every_s: float = 5.0) -> None:
        """Keep the gauges current between requests (other processes change the store too), and
        (the node's one custodian) return what crashed processes left in the store every
        ``reap_every_s``: their leases, single-flight claims and reader slots. Without it a
        killed encoder's or stage's leases would pin their entries until the store filled up."""
        reaped_at = float("-inf")
        while True:
            if self._gauges and time.monotonic() - reaped_at >= reap_every_s:
                reaped_at = time.monotonic()
                self.reap()
            self.refresh()
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
      ``kept`` or ``probe`` (adaptive), ``forced`` (request parameter ``path``), ``policy`` (a fixed policy),
      ``only`` (one path available);
    - ``epd_path_last_decision{path}``: 1 for the path of the latest decision, 0 for the other;
    - ``epd_path_predicted_ms{path}``: the latest adaptive decision's predictions (-1: unknown);
    - ``epd_path_in_flight{path}``: requests running on each path now;
    - ``epd_path_estimate_ms{path, stage, bucket}``: each stage estimate (median of its recent
      samples at any load), ms per unit of load.
    """

    def __init__(self, metrics: ModelMetrics, paths: Any) -> None:
        self._metrics = metrics
        self._paths = tuple(paths)

    def record(self, decision: Any, cost_model: Any) -> None:
        """After a decision (``path_cost.Decision``) and the model's state (``PathCostModel``).
        The estimates change only when a request finishes: :meth:`refresh` sends them then."""
        m = self._metrics
        m.counter("epd_path_requests", "Requests served per path, by why it was chosen",
                  path=decision.path, reason=decision.reason).increment()
        for path in self._paths:
            m.gauge("epd_path_last_decision", "1 for the path of the latest decision", path=path).set(
                float(path == decision.path)
            )
            if decision.predicted_ms:
                predicted = decision.predicted_ms.get(path)
                m.gauge("epd_path_predicted_ms", "The latest adaptive decision's predicted completion time (-1: "
                        "unknown)", path=path).set(-1.0 if predicted is None else predicted)
        self._in_flight(cost_model)

    def _in_flight(self, cost_model: Any) -> None:
        for path in self._paths:
            self._metrics.gauge("epd_path_in_flight", "Requests running on each serving path", path=path).set(
                cost_model.in_flight[path]
            )

    def refresh(self, cost_model: Any) -> None:
        m = self._metrics
        self._in_flight(cost_model)
        for (path, stage, bucket), value in cost_model.snapshot().items():
            m.gauge("epd_path_estimate_ms", "The cost model's stage estimates, ms per unit of load",
                    path=path, stage=stage, bucket=bucket).set(value)


class KvTransferMetrics:
    """``epd_kv_pending_transfers``: prefilled KV transfers in the node's KV folder that no decode
    has consumed or discarded yet (0 once every request, cancelled ones too, has ended)."""

    def __init__(self, metrics: ModelMetrics, store: Path) -> None:
        self._store = store
        self._pending = metrics.gauge("epd_kv_pending_transfers", "Prefilled KV transfers not yet consumed or dropped")

    def refresh(self) -> None:
        self._pending.set(len(list_transfers(self._store)))

    async def refresh_every(self, period_s: float) -> None:
        while True:
            self.refresh()
            await asyncio.sleep(period_s)

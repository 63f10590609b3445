"""The remote encoders' counters and their export as Triton metrics, in one place (the metric
names are listed in docs/scale-out.md).

Who calls what: membership (``scaleout/membership.py``) counts lookups and refusals, the remote
encode (``scaleout/remote.py``) counts calls, failures, retries, latency, local hits, fallbacks
and cross-node bytes, all in one :class:`ScaleoutStats`; :class:`MetricExport` turns those totals
and the router's (decisions, breakers) into ``ModelMetrics`` counters and gauges each refresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from python_backends.scaleout.routing import Router


@dataclass
class EndpointStats:
    requests: int = 0
    failures: int = 0
    retries: int = 0
    latency_s: float = 0.0


@dataclass
class ScaleoutStats:
    """Totals since start."""

    endpoints: dict[str, EndpointStats] = field(default_factory=dict)
    local_hits: int = 0  # cross-node path: another request of this node had stored it meanwhile
    local_fallbacks: int = 0  # encoded on this server's own encoder models: no remote encoder left
    cross_node_bytes: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    lookup_failures: int = 0  # source lookups that found no encoder (a DNS name resolving to nothing, ...)
    addresses_found: int = 0  # addresses the last lookup gave

    def of(self, address: str) -> EndpointStats:
        return self.endpoints.setdefault(address, EndpointStats())


class MetricExport:
    """Exports totals as Triton metrics; counters get the increase since the last export."""

    def __init__(self, stats: ScaleoutStats, router: Router) -> None:
        self.stats, self.router = stats, router
        self._exported: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def totals(self) -> list[tuple[str, str, dict[str, str], float]]:
        """Every counter now: name, help, labels, total."""
        stats, router = self.stats, self.router
        totals: list[tuple[str, str, dict[str, str], float]] = []
        for address in router.encoders:  # every admitted encoder's counters, from 0 on
            stats.of(address)
        for address, s in stats.endpoints.items():
            for name, calls in (("requests", s.requests), ("failures", s.failures), ("retries", s.retries)):
                totals.append((f"epd_remote_encoder_{name}", f"Remote encode calls: {name}", {"endpoint": address},
                               calls))  # fmt: skip
            totals.append(("epd_remote_encoder_latency_seconds", "Seconds in successful remote encodes",
                           {"endpoint": address}, s.latency_s))  # fmt: skip
        decisions = {**router.decisions, "local_hit": stats.local_hits, "local_fallback": stats.local_fallbacks}
        for decision, count in decisions.items():
            totals.append(("epd_routing_decisions", "Where remote-encoder routing sent an image",
                           {"decision": decision}, count))  # fmt: skip
        totals.append(("epd_cross_node_bytes", "Embedding bytes fetched from other nodes", {},
                       stats.cross_node_bytes))  # fmt: skip
        for address, state in router.encoders.items():
            totals.append(("epd_remote_encoder_breaker_opens", "Times an encoder's circuit breaker opened",
                           {"endpoint": address}, state.breaker.opens))  # fmt: skip
        totals.append(("epd_remote_encoder_lookup_failures", "Encoder lookups (DNS name, file) that found no encoder",
                       {}, stats.lookup_failures))  # fmt: skip
        for address, refusals in stats.refused.items():
            totals.append(("epd_remote_encoder_refused", "Encoder servers refused at admission",
                           {"endpoint": address}, refusals))  # fmt: skip
        return totals

    def export(self, metrics: Any) -> None:
        """Write every counter and gauge to ``metrics`` (a ``ModelMetrics``)."""
        for name, description, labels, value in self.totals():  # each exported from 0 on
            key = (name, tuple(sorted(labels.items())))
            last = self._exported.get(key, 0.0)
            handle = metrics.counter(name, description, **labels)
            if value > last:
                handle.increment(value - last)
                self._exported[key] = value
        metrics.gauge("epd_remote_encoder_endpoints", "Encoder addresses the last lookup gave").set(
            float(self.stats.addresses_found)
        )
        for address, state in self.router.encoders.items():
            metrics.gauge("epd_remote_encoder_breaker_state", "0 closed, 1 open, 2 half-open",
                          endpoint=address).set(float(state.breaker.state))  # fmt: skip

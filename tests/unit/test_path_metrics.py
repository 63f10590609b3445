"""epd's path metrics (python_backends/triton_edge/metrics.py) cost few stub-to-server round trips.

Each ``Metric.set``/``increment`` of the python backend is a blocking round trip from the stub
to the server process, on the event loop that streams every request's tokens. Once: 17 of them
per epd request ahead of its engine and 20 after it; then ~10 per request (every gauge whose value
moved). Now a request sends its counter only, and the gauges (state: the latest decision, requests
per path, the cost model's estimates) go out every second, each only when its value changed. The
conftest stub stands in for ``triton_python_backend_utils``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import triton_python_backend_utils as pb_utils

from python_backends.contract import COLOCATED_PATH, DISAGGREGATED_PATH
from python_backends.epd.path_cost import PathCostModel, RequestShape
from python_backends.triton_edge.metrics import ModelMetrics, PathMetrics

PATHS = (DISAGGREGATED_PATH, COLOCATED_PATH)
HIT = RequestShape(images=1, misses=0, largest_pixels=640 * 480, output_tokens=32)
MISS = RequestShape(images=1, misses=1, largest_pixels=640 * 480, output_tokens=32)


@pytest.fixture
def sent(monkeypatch) -> Iterator[list[tuple[str, float]]]:
    """Every value a metric sends to the server, as (kind, value)."""
    calls: list[tuple[str, float]] = []
    metric_type = type(pb_utils.MetricFamily("probe", "", pb_utils.MetricFamily.GAUGE).Metric(labels={}))
    for kind in ("set", "increment"):
        send = getattr(metric_type, kind)
        monkeypatch.setattr(metric_type, kind, lambda self, v, k=kind, f=send: (calls.append((k, v)), f(self, v)))
    yield calls


def test_a_gauge_is_sent_only_when_its_value_changes_and_never_by_metric_set(sent):
    metrics = ModelMetrics("epd")
    gauge = metrics.gauge("epd_test_gauge", "test", path="colocated")
    for value in (1.0, 1.0, 1.0, 2.0, 2.0, 1.0):
        gauge.set(value)
    # Metric.set keeps the GIL while it waits for the stub's message mutex (the BLS lock cycle):
    # a gauge moves by the increment of its difference instead.
    assert sent == [("increment", 1.0), ("increment", 1.0), ("increment", -1.0)]
    assert metrics.live(gauge.key).value == 1.0
    counter = metrics.counter("epd_test_counter", "test")
    counter.increment()
    counter.increment()
    assert sent[3:] == [("increment", 1), ("increment", 1)]  # counters count every call
    metrics.release()
    gauge.set(5.0)  # released: nothing is sent
    assert len(sent) == 5


def _served(cost: PathCostModel, metrics: PathMetrics, shape: RequestShape, sent: list) -> int:
    """One adaptive request as epd serves it; the values it sent."""
    before = len(sent)
    decision = cost.choose(shape, PATHS)
    load = cost.started(decision.path, probe=decision.reason == "probe").load
    metrics.record(decision)
    if decision.path == COLOCATED_PATH:
        cost.observe_colocated(shape, 15.0 + load, 120.0, 32, load)
    else:
        cost.observe_disaggregated(shape, {"encode": 30.0, "prefill": 20.0, "decode": 150.0}, 32, load, shape.misses)
    cost.finished(decision.path)
    return len(sent) - before


def _on_metrics(metrics: PathMetrics, name: str) -> dict[str, float]:
    """What /metrics shows of ``name``, by path (the stub keeps each metric's last value)."""
    found = metrics._metrics._metrics.items()
    return {dict(key[1])["path"]: metric.value for key, metric in found if key[0] == name}


def test_a_request_sends_its_counter_and_the_gauges_follow_each_second(sent):
    cost, metrics = PathCostModel(), PathMetrics(ModelMetrics("epd"), PATHS)
    per_request = [_served(cost, metrics, HIT if i % 2 else MISS, sent) for i in range(24)]
    assert per_request == [1] * 24  # epd_path_requests; before: ~10 gauges on top
    assert all(kind == "increment" for kind, _ in sent)
    estimates = len(cost.snapshot())
    assert estimates >= 8  # both paths probed and known, hits and misses: every estimate exists

    before = len(sent)
    metrics.refresh(cost)  # the periodic task: every gauge once, its latest value (0 is where it starts)
    gauges = [metric.value for key, metric in metrics._metrics._metrics.items() if key[0] != "epd_path_requests"]
    assert len(gauges) == 2 + 2 + 2 + 2 + estimates
    assert len(sent) - before == sum(1 for value in gauges if value != 0)
    last = cost.choose(HIT, PATHS)  # what epd decided for request 24 (a hit), not yet recorded
    assert _on_metrics(metrics, "epd_path_in_flight") == {path: 0.0 for path in PATHS}
    assert _on_metrics(metrics, "epd_path_probe_interval_s") == cost.probe_intervals
    assert _on_metrics(metrics, "epd_path_estimate_ms").keys() == set(PATHS)

    before = len(sent)
    metrics.refresh(cost)  # nothing changed: nothing sent
    assert len(sent) == before
    metrics.record(last)
    cost.started(last.path)
    metrics.refresh(cost)  # the decision's gauges and its path's in-flight request
    assert _on_metrics(metrics, "epd_path_last_decision") == {path: float(path == last.path) for path in PATHS}
    assert _on_metrics(metrics, "epd_path_in_flight")[last.path] == 1.0
    assert len(sent) - before <= 1 + 2 + 2 + 1

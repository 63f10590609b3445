"""epd's path metrics (python_backends/triton_edge/metrics.py) cost few stub-to-server round trips.

Each ``Metric.set``/``increment`` of the python backend is a blocking round trip from the stub
to the server process. Before: 17 of them per epd request ahead of its engine (every path's
gauges and every cost-model estimate, re-sent at each decision; 10 estimates) and 20 after it. Now a
gauge is sent only when its value changes, and a decision sends no estimates (they change only
when a request finishes). The conftest stub stands in for ``triton_python_backend_utils``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import triton_python_backend_utils as pb_utils

from python_backends.contract import COLOCATED_PATH, DISAGGREGATED_PATH
from python_backends.path_cost import PathCostModel, RequestShape
from python_backends.triton_edge.metrics import ModelMetrics, PathMetrics

PATHS = (DISAGGREGATED_PATH, COLOCATED_PATH)
HIT = RequestShape(images=1, misses=0, largest_pixels=640 * 480, output_tokens=32)
MISS = RequestShape(images=1, misses=1, largest_pixels=640 * 480, output_tokens=32)


@pytest.fixture
def sent(monkeypatch) -> Iterator[list[tuple[str, float]]]:
    """Every value a metric sends to the server, as (kind, value)."""
    calls: list[tuple[str, float]] = []
    metric_type = type(pb_utils.MetricFamily("probe", "", pb_utils.MetricFamily.GAUGE).Metric(labels={}))
    monkeypatch.setattr(metric_type, "set", lambda self, v: calls.append(("set", v)))
    monkeypatch.setattr(metric_type, "increment", lambda self, v: calls.append(("increment", v)))
    yield calls


def test_a_gauge_is_sent_only_when_its_value_changes(sent):
    metrics = ModelMetrics("epd")
    gauge = metrics.gauge("epd_test_gauge", "test", path="colocated")
    for value in (1.0, 1.0, 1.0, 2.0, 2.0, 1.0):
        gauge.set(value)
    assert sent == [("set", 1.0), ("set", 2.0), ("set", 1.0)]
    counter = metrics.counter("epd_test_counter", "test")
    counter.increment()
    counter.increment()
    assert sent[3:] == [("increment", 1), ("increment", 1)]  # counters count every call
    metrics.release()
    gauge.set(5.0)  # released: nothing is sent
    assert len(sent) == 5


def _served(cost: PathCostModel, metrics: PathMetrics, shape: RequestShape, sent: list) -> tuple[int, int]:
    """One adaptive request as epd serves it: (values sent at its decision, at its end)."""
    decision = cost.choose(shape, PATHS)
    load = cost.started(decision.path, probe=decision.reason == "probe").load
    before = len(sent)
    metrics.record(decision, cost)
    at_decision = len(sent) - before
    if decision.path == COLOCATED_PATH:
        cost.observe_colocated(shape, 15.0 + load, 120.0, 32, load)
    else:
        cost.observe_disaggregated(shape, {"encode": 30.0, "prefill": 20.0, "decode": 150.0}, 32, load, shape.misses)
    cost.finished(decision.path)
    before = len(sent)
    metrics.refresh(cost)
    return at_decision, len(sent) - before


def test_path_metrics_send_what_changed_not_every_estimate(sent):
    cost, metrics = PathCostModel(), PathMetrics(ModelMetrics("epd"), PATHS)
    for i in range(24):  # both paths probed and known, hits and misses: every estimate exists
        _served(cost, metrics, HIT if i % 2 else MISS, sent)
    estimates = len(cost.snapshot())
    assert estimates >= 8
    at_decision, at_end = _served(cost, metrics, HIT, sent)
    # A decision: its counter, the predictions that moved, the in-flight gauge of its path;
    # before, every gauge and every estimate (2 + 2 + 2 + estimates).
    assert at_decision <= 5 < 1 + 2 + 2 + 2 + estimates
    # The end: the in-flight gauge back and the estimates that request's sample moved.
    assert at_end <= 1 + 4 < 2 + estimates
    # What /metrics shows is still every estimate's current value.
    last = {}
    for key, metric in metrics._metrics._metrics.items():  # the stub keeps what was last sent
        last[key] = metric
    assert len([k for k in last if k[0] == "epd_path_estimate_ms"]) == estimates

"""Metric math of the benchmark harness on hand-made traces (times in seconds)."""

from __future__ import annotations

import pytest

from bench.metrics import (
    RequestRecord,
    Slo,
    distribution,
    goodput,
    inter_token_latencies,
    measured_window_s,
    median_summary,
    meets_slo,
    summarize,
    tpot_s,
)


def record(
    key: str, sent_at: float, chunk_times: list[float], chunk_tokens: list[int] | None = None, **kw
) -> RequestRecord:
    tokens = chunk_tokens if chunk_tokens is not None else [1] * len(chunk_times)
    return RequestRecord(
        key=key, sent_at=sent_at, chunk_times=chunk_times, chunk_tokens=tokens, num_output_tokens=sum(tokens), **kw
    )


def test_percentiles_are_numpy_linear_interpolation():
    # 1..100: p50 = 50.5, p90 = 90.1, p99 = 99.01 with linear interpolation.
    stats = distribution(range(1, 101))
    assert stats == pytest.approx({"mean": 50.5, "p50": 50.5, "p90": 90.1, "p99": 99.01})


def test_distribution_scales_skips_none_and_handles_empty():
    assert distribution([0.1, None, 0.3], scale=1000.0) == pytest.approx(
        {"mean": 200.0, "p50": 200.0, "p90": 280.0, "p99": 298.0}
    )
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_itl_is_the_gap_between_responses():
    assert inter_token_latencies([0.10, 0.12, 0.15, 0.19]) == pytest.approx([0.02, 0.03, 0.04])


def test_itl_spreads_a_multi_token_response_over_its_tokens():
    # The third response carries 3 tokens 0.06 s after the second: three gaps of 0.02 s.
    gaps = inter_token_latencies([0.10, 0.12, 0.18], [1, 1, 3])
    assert gaps == pytest.approx([0.02, 0.02, 0.02, 0.02])


def test_itl_of_a_single_response_is_empty():
    assert inter_token_latencies([0.5], [4]) == []


def test_tpot_excludes_the_first_token():
    r = record("a", 0.0, [0.2, 0.25, 0.3, 0.35, 0.4])  # 5 tokens: 4 gaps over 0.2 s
    assert tpot_s(r) == pytest.approx(0.05)
    assert tpot_s(record("b", 0.0, [0.2])) is None


def test_window_runs_from_first_send_to_last_response():
    records = [record("a", 0.0, [0.1, 0.5]), record("b", 0.3, [0.2, 0.9]), record("c", 0.4, [], error="boom")]
    assert measured_window_s(records) == pytest.approx(1.2)


def test_goodput_counts_only_requests_meeting_every_slo():
    records = [
        record("fast", 0.0, [0.1, 0.12, 0.14]),  # TTFT 100 ms, TPOT 20 ms
        record("slow-first", 0.0, [0.6, 0.62, 0.64]),  # TTFT 600 ms
        record("slow-decode", 0.0, [0.1, 0.3, 0.5]),  # TPOT 200 ms
        record("failed", 0.0, [], error="timeout"),
        record("one-token", 0.0, [0.2]),  # no TPOT: cannot break a TPOT objective
    ]
    slo = Slo(ttft_ms=500, tpot_ms=50)
    assert [meets_slo(r, slo) for r in records] == [True, False, False, False, True]
    assert goodput(records, slo, window_s=2.0) == pytest.approx(1.0)
    assert goodput(records, Slo(), window_s=2.0) is None  # no SLO, no goodput


def test_summary_of_a_hand_made_trace():
    records = [
        record("a", 0.0, [0.1, 0.2, 0.3], num_input_tokens=100),
        record("b", 0.5, [0.3, 0.4, 0.5], num_input_tokens=300),
        record("c", 0.6, [], error="INVALID_ARG"),
    ]
    s = summarize(records, Slo(ttft_ms=200))
    assert s["requests"] == 2 and s["errors"] == 1
    assert s["window_s"] == pytest.approx(1.0)  # 0.0 -> 0.5 + 0.5
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_token_throughput"] == pytest.approx(6.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["e2e_ms"]["p50"] == pytest.approx(400.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert s["itl_ms"]["p99"] == pytest.approx(100.0)
    assert s["mean_input_tokens"] == pytest.approx(200.0)
    assert s["goodput"] == pytest.approx(1.0)  # only "a" has TTFT <= 200 ms
    assert s["goodput_fraction"] == pytest.approx(1 / 3)


def test_output_tokens_fall_back_to_chunks_when_the_server_sends_no_count():
    r = RequestRecord(key="x", chunk_times=[0.1, 0.2], chunk_tokens=[2, 3])
    assert r.output_tokens == 5
    assert RequestRecord(key="y", chunk_times=[0.1, 0.2, 0.3]).output_tokens == 3


def test_median_across_repetitions_keeps_nesting_and_missing_keys():
    reps = [
        {"requests": 10, "ttft_ms": {"p50": 100.0}, "counters": {"hits": 2.0}, "label": "c=1"},
        {"requests": 12, "ttft_ms": {"p50": 300.0}, "counters": {}, "label": "c=1"},
        {"requests": 11, "ttft_ms": {"p50": 200.0}, "counters": {"hits": 4.0}, "label": "c=1", "goodput": None},
    ]
    merged = median_summary(reps)
    assert merged["requests"] == 11
    assert merged["ttft_ms"] == {"p50": 200.0}
    assert merged["counters"] == {"hits": 3.0}
    assert merged["label"] == "c=1"
    assert merged["goodput"] is None


def test_records_round_trip_through_json():
    r = record("k", 0.25, [0.1, 0.2], stage_ms={"encode": 3.5}, cache_hits=1)
    assert RequestRecord.from_json(r.to_json()) == r

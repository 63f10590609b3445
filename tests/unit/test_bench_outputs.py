"""compare, perf_analyzer inputs, /metrics parsing, model layout and stage readings."""

from __future__ import annotations

import base64
import copy
import json
import struct

import pytest

from bench.compare import diff, render
from bench.metrics import RequestRecord
from bench.perf_analyzer import commands, data_entry, write_inputs
from bench.server_stats import (
    CpuSample,
    counter_deltas,
    cpu_usage,
    metric_exported,
    model_info,
    parse_metrics,
    per_model_server_ms,
    sum_counter,
)
from bench.stages import disaggregation_reading, stage_breakdown
from bench.workload import BenchRequest

METRICS_BEFORE = """\
# HELP nv_inference_request_success Number of successful inference requests
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="vit_encoder",version="1"} 10
nv_inference_request_success{model="llm",version="1"} 5
# TYPE nv_inference_compute_infer_duration_us counter
nv_inference_compute_infer_duration_us{model="vit_encoder",version="1"} 200000
# TYPE epd_cache_hits counter
epd_cache_hits{model="encode"} 1
# TYPE epd_llm_unfinished_requests gauge
epd_llm_unfinished_requests{model="llm"} 0
# TYPE process_cpu_seconds counter
process_cpu_seconds 99
"""
METRICS_AFTER = (
    METRICS_BEFORE.replace('"vit_encoder",version="1"} 10', '"vit_encoder",version="1"} 14')
    .replace("200000", "300000")
    .replace('epd_cache_hits{model="encode"} 1', 'epd_cache_hits{model="encode"} 4')
)


def test_counter_deltas_from_two_scrapes():
    before, after = parse_metrics(METRICS_BEFORE), parse_metrics(METRICS_AFTER)
    deltas = counter_deltas(before, after)
    assert deltas == {
        'nv_inference_request_success{model="vit_encoder",version="1"}': 4.0,
        'nv_inference_compute_infer_duration_us{model="vit_encoder",version="1"}': 100000.0,
        'epd_cache_hits{model="encode"}': 3.0,
    }
    assert sum_counter(deltas, "epd_cache_hits") == 3.0
    assert sum_counter(deltas, "epd_encodes") is None  # not exported: absent, not zero
    assert metric_exported(after, "epd_cache_hits") and not metric_exported(after, "epd_encodes")
    assert ("epd_llm_unfinished_requests", (("model", "llm"),)) in after.gauges
    assert per_model_server_ms(deltas, ["vit_encoder", "llm"])["vit_encoder"]["compute_infer"] == pytest.approx(25.0)
    assert counter_deltas(None, after) == {}


def test_model_info_for_ensemble_and_bls():
    ensemble = model_info(
        "ensemble",
        {
            "platform": "ensemble",
            "ensemble_scheduling": {"step": [{"model_name": "preprocess"}, {"model_name": "llm"}]},
        },
        {"ensemble", "preprocess", "llm"},
    )
    assert ensemble.instances == 0 and ensemble.composing == ["preprocess", "llm"]
    gpu = model_info("vit", {"backend": "tensorrt", "instance_group": [{"count": 2, "gpus": [0, 1]}]}, set())
    assert gpu.instances == 4
    bls = model_info(
        "epd",
        {"backend": "python", "parameters": {"a": {"string_value": "encode"}, "b": {"string_value": "7"}}},
        {"epd", "encode"},
    )
    assert bls.composing == ["encode"] and bls.instances == 1


def test_cpu_usage_per_request():
    usage = cpu_usage(CpuSample(0.0, 1.0, 10.0), CpuSample(5.0, 1.2, 14.0), requests=40)
    assert usage["client_cpu_ms_per_request"] == pytest.approx(5.0)
    assert usage["server_cpu_ms_per_request"] == pytest.approx(100.0)
    assert usage["client_to_server_cpu"] == pytest.approx(0.05)


def test_cpu_usage_per_core_and_per_model():
    before = CpuSample(0.0, 1.0, 10.0, 5.0, (2.0, 3.0), {"epd": 1.0, "vit_encoder": 0.5})
    after = CpuSample(5.0, 1.2, 14.0, 11.0, (7.0, 4.0), {"epd": 3.0, "vit_encoder": 1.5, "llm": 0.1})
    usage = cpu_usage(before, after, requests=10)
    assert usage["core_busy_share"] == pytest.approx([1.0, 0.2])  # core 1 idled 80% of the window
    assert usage["model_cpu_ms_per_request"] == pytest.approx({"epd": 200.0, "vit_encoder": 100.0, "llm": 10.0})


def test_model_cpu_is_read_off_each_stubs_command_line():
    from bench.server_stats import _STUB_MODEL

    arg = "/work/main/model_repository/encoder_0/1/model.py"
    assert _STUB_MODEL.search(arg).group(1) == "encoder_0" and _STUB_MODEL.search("shm_region_1") is None


def _summary(ttft_p50: float, throughput: float) -> dict:
    return {
        "points": [
            {
                "mode": "llm",
                "load_label": "c=1",
                "status": "ran",
                "summary": {"request_throughput": throughput, "ttft_ms": {"p50": ttft_p50}},
            }
        ]
    }


def test_compare_flags_regressions_in_the_bad_direction_only():
    old, new = _summary(100.0, 10.0), _summary(150.0, 10.5)
    changes, only_old, only_new = diff(old, new)
    by_metric = {c.metric: c for c in changes}
    assert by_metric["ttft_ms p50"].ratio == pytest.approx(1.5)
    assert by_metric["ttft_ms p50"].is_regression(0.1)
    assert not by_metric["request_throughput"].is_regression(0.1)
    assert (only_old, only_new) == ([], [])
    text = render(changes, only_old, only_new, 0.1, ("old", "new"))
    assert "REGRESSION" in text and "1 regression(s) in 2" in text


def test_compare_lists_points_present_on_one_side():
    new = copy.deepcopy(_summary(100.0, 10.0))
    new["points"][0]["load_label"] = "c=2"
    _, only_old, only_new = diff(_summary(100.0, 10.0), new)
    assert only_old == ["llm c=1"] and only_new == ["llm c=2"]


def _request(images: tuple[bytes, ...]) -> BenchRequest:
    return BenchRequest(key="k", prompt="hi", images=images, sampling={"max_tokens": 4})


def test_perf_analyzer_binary_images_use_length_prefixed_bytes():
    entry = data_entry(_request((b"abc", b"de")), "binary")
    assert entry["image"]["shape"] == [2]
    raw = base64.b64decode(entry["image"]["content"]["b64"])
    assert raw == struct.pack("<I", 3) + b"abc" + struct.pack("<I", 2) + b"de"
    assert entry["text_input"] == ["hi"] and entry["stream"] == [True]
    assert json.loads(entry["sampling_parameters"][0]) == {"max_tokens": 4}


def test_perf_analyzer_b64_images_and_declared_inputs(tmp_path):
    entry = data_entry(_request((b"abc",)), "b64", declared={"text_input", "image", "stream"})
    assert entry == {"text_input": ["hi"], "stream": [True], "image": {"content": ["YWJj"], "shape": [1]}}
    assert "image" not in data_entry(_request(()), "binary")
    written = write_inputs([_request((b"x",))], tmp_path, ["llm", "epd"])
    assert [p.name for p in written] == ["llm.json", "epd.json", "COMMANDS.md"]
    assert "--shared-memory system" in (tmp_path / "COMMANDS.md").read_text()
    assert all("--streaming" in c for c in commands("llm", tmp_path / "llm.json"))


def _records(ttft: float, e2e: float, stage_ms: dict | None = None) -> list[RequestRecord]:
    return [RequestRecord(key=str(i), chunk_times=[ttft, e2e], stage_ms=stage_ms or {}) for i in range(3)]


def test_client_side_breakdown_when_no_pipeline_timings():
    breakdown = stage_breakdown(_records(0.3, 0.4), {}, None)
    assert breakdown["source"].startswith("client")
    assert breakdown["ms"] == pytest.approx({"first_token": 300.0, "decode": 100.0})
    reading = disaggregation_reading("llm", "c=8", breakdown, 8)
    assert "first_token dominates (75%" in reading and "run `epd`" in reading and "below the ~32" in reading


def test_pipeline_timings_drive_the_reading():
    decode_heavy = stage_breakdown(_records(0.1, 1.0, {"encode": 10.0, "prefill": 20.0, "decode": 170.0}), {}, None)
    reading = disaggregation_reading("epd", "c=64", decode_heavy, 64)
    assert "decode dominates (85%" in reading and "only 5%" in reading and "below" not in reading
    encode_heavy = stage_breakdown(_records(0.1, 1.0, {"preprocess": 30.0, "encode": 50.0, "decode": 20.0}), {}, None)
    assert "disaggregate E" in disaggregation_reading("epd", "c=64", encode_heavy, 64)


def test_perf_analyzer_data_covers_errors_as_outputs_where_declared():
    # perf_analyzer 2.41's --shared-memory refuses a model whose optional inputs the data leaves out.
    declared = {"text_input", "image", "stream", "errors_as_outputs"}
    assert data_entry(_request((b"abc",)), "binary", declared=declared)["errors_as_outputs"] == [False]
    assert "errors_as_outputs" not in data_entry(_request((b"abc",)), "binary")
    assert "errors_as_outputs" not in data_entry(_request((b"abc",)), "binary", declared={"text_input", "image"})

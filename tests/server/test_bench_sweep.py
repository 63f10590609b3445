"""The benchmark harness end to end against the real server: a tiny sweep through the CLI.
(perf_analyzer on our generated inputs: tests/server/test_perf_analyzer.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main
from builders.tritonserver import TritonServer

pytestmark = pytest.mark.server


def test_tiny_sweep_end_to_end(server: TritonServer, tmp_path: Path):
    out = tmp_path / "bench"
    code = main([
        "run", "--url", server.grpc_url, "--metrics-url", server.metrics_url,
        "--server-pid", str(server.process.pid),
        "--modes", "llm", "llm:unique", "llm:repeated", "epd",
        "--concurrency", "1", "2", "--request-rate", "4",
        "--requests", "4", "--warmup", "1", "--reps", "1",
        "--output-tokens", "8", "--image-size", "128x96",
        "--slo-ttft-ms", "60000", "--time-budget", "50", "--no-progress", "--out", str(out),
    ])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    modes = {m["label"]: m for m in summary["modes"]}
    assert modes["epd"]["status"] != "skipped"  # epd is served (issue 4)
    assert modes["llm"]["layout"]["total_instances"] == 1

    points = [p for p in summary["points"] if p["status"] == "ran"]
    assert {(p["mode"], p["load_label"]) for p in points} >= {("llm", "c=1"), ("llm", "c=2"), ("llm", "poisson 4/s")}
    assert any(p["mode"] == "epd" for p in points)
    for point in points:
        s = point["summary"]
        assert s["errors"] == 0 and s["requests"] == 4
        assert s["mean_output_tokens"] == 8  # ignore_eos: exact lengths
        assert 0 < s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"]
        assert s["goodput"] == pytest.approx(s["request_throughput"])  # generous SLO: all good
        # Triton's own counters moved for the model we drove.
        model = point["mode"].split(":")[0]  # llm, llm:unique, ... -> llm; epd -> epd
        assert s["server_counters"][f'nv_inference_request_success{{model="{model}",version="1"}}'] == 4

    # Greedy decoding: the same requests give the same tokens in another mode of the same model.
    assert set(summary["token_agreement_vs_baseline"].values()) == {1.0}
    cost = summary["harness_cost"]
    assert cost["server_cpu_ms_per_request"] > 0 and cost["client_cpu_ms_per_request"] > 0
    for name in ("raw.json", "results.csv", "results.md", "latency_vs_concurrency.png", "throughput_vs_rate.png"):
        assert (out / name).stat().st_size > 0

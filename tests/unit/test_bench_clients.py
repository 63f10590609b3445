"""Benchmark clients users already have: perf_analyzer's install/locate, ``vllm bench serve``'s
command and results table (the runs themselves: tests/server/test_perf_analyzer.py and
``make bench-vllm-serve``)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from bench import perf_analyzer_tool as tool
from bench.vllm_bench_serve import BASELINE, Workload, bench_serve_command, markdown, summarize


def test_locate_says_why_when_not_installed(tmp_path: Path):
    found, reason = tool.locate(tmp_path / "none")
    assert found is None and "make tools" in reason


def test_locate_reports_a_recorded_install_failure(tmp_path: Path):
    tmp_path.joinpath(tool.UNAVAILABLE).write_text("RuntimeError: no network\n")
    found, reason = tool.locate(tmp_path)
    assert found is None and reason == "perf_analyzer cannot be installed here: RuntimeError: no network"


def test_locate_refuses_a_binary_that_does_not_start(tmp_path: Path):
    binary = tmp_path / "bin" / "perf_analyzer"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\necho 'error while loading shared libraries: libb64.so.0d' >&2\nexit 127\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    found, reason = tool.locate(tmp_path)
    assert found is None and "libb64.so.0d" in reason


def test_install_refuses_a_wheel_with_another_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def fake_pip(command, check):  # a download that produced different bytes than the pinned ones
        dest = Path(command[command.index("--dest") + 1])
        (dest / tool.WHEELS[0].filename).write_bytes(b"not the pinned wheel")

    monkeypatch.setattr(tool.subprocess, "run", fake_pip)
    with pytest.raises(RuntimeError, match="expected the pinned"):
        tool.install(tmp_path / "perf_analyzer")
    assert not (tmp_path / "perf_analyzer").exists()  # nothing half-installed


def test_tool_env_puts_its_libraries_first(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("LD_LIBRARY_PATH", "/other")
    found = tool.PerfAnalyzer(Path("/t/bin/perf_analyzer"), Path("/t/lib"))
    assert found.env()["LD_LIBRARY_PATH"] == "/t/lib:/other"


def test_bench_serve_command_is_vllms_chat_benchmark_with_random_images(tmp_path: Path):
    command = bench_serve_command(
        "http://127.0.0.1:9000", "epd", Path("/m"), Workload(num_prompts=8), 4, tmp_path, "epd-c4"
    )
    assert command[1:5] == ["-m", "bench.vllm_serve", "bench", "serve"]
    pairs = dict(zip(command, command[1:], strict=False))
    assert pairs["--backend"] == "openai-chat" and pairs["--endpoint"] == "/v1/chat/completions"
    assert pairs["--dataset-name"] == "random-mm" and pairs["--num-prompts"] == "8"
    assert pairs["--random-mm-bucket-config"] == "{(224, 224, 1): 1.0}"
    assert pairs["--max-concurrency"] == "4" and pairs["--result-filename"] == "epd-c4.json"
    assert "--ignore-eos" in command


def test_summary_rows_carry_ratios_to_vllm_serve():
    results = {
        "epd": {1: {"completed": 8, "failed": 0, "request_throughput": 3.0, "median_ttft_ms": 50.0}},
        BASELINE: {1: {"completed": 8, "failed": 0, "request_throughput": 2.0, "median_ttft_ms": 100.0}},
    }
    rows = summarize(results)
    epd = next(r for r in rows if r["target"] == "epd")
    assert epd["request_throughput_vs_vllm"] == 1.5 and epd["median_ttft_ms_vs_vllm"] == 0.5
    baseline = next(r for r in rows if r["target"] == BASELINE)
    assert not any(key.endswith("_vs_vllm") for key in baseline)
    table = markdown(rows, "t", "cmd")
    assert "| epd | 1 | 8 | 0 | 3.00 (1.50x) |" in table


def test_perf_analyzer_run_reads_its_csv_and_export(tmp_path: Path):
    from bench.perf_analyzer_run import read_run

    (tmp_path / "report.csv").write_text(
        "Concurrency,Inferences/Second,p50 latency\n2,1.5,976295\n"
    )
    ms = 1_000_000  # export timestamps are nanoseconds
    requests = [
        {"timestamp": 0, "response_timestamps": [100 * ms, 300 * ms]},
        {"timestamp": 0, "response_timestamps": [200 * ms, 500 * ms]},
        {"timestamp": 0, "response_timestamps": []},
    ]
    (tmp_path / "profile.json").write_text(json.dumps({"experiments": [{"requests": requests}]}))
    run = read_run(tmp_path)
    assert run["infer_per_s"] == 1.5 and run["p50_latency_ms"] == pytest.approx(976.295)
    assert run["requests_recorded"] == 3 and run["requests_without_response"] == 1
    assert run["export_first_response_p50_ms"] == 150 and run["export_last_response_p50_ms"] == 400


def test_perf_analyzer_comparison_pairs_like_with_like():
    from bench.perf_analyzer_run import comparison

    # perf_analyzer 2.41 on llm, c=1 (2026-12-01): CSV p50 163.3 ms, its export 41.9 / 161.3 ms.
    base = {"p50_latency_ms": 163.3, "export_first_response_p50_ms": 41.9, "export_last_response_p50_ms": 161.3}
    c = comparison("llm", base, {"ttft_p50_ms": 45.0, "e2e_p50_ms": 200.0})
    assert c["csv_p50_measures"] == "last response"
    assert c["ratio_first_response_vs_ttft"] == pytest.approx(41.9 / 45.0)
    assert c["ratio_last_response_vs_e2e"] == pytest.approx(161.3 / 200.0)
    assert "(within 15%)" in c["reading"] and "(outside 15%)" in c["reading"]
    first = comparison("llm", {**base, "p50_latency_ms": 42.0}, {"ttft_p50_ms": 45.0, "e2e_p50_ms": 200.0})
    assert first["csv_p50_measures"] == "first response"


def test_perf_analyzer_rounds_pair_each_round_and_render():
    from bench.perf_analyzer_run import comparison, markdown, round_ratios

    pa = {"exit_code": 0, "export_first_response_p50_ms": 40.0, "export_last_response_p50_ms": 160.0}
    rounds = [
        {"round": 0, "order": ["perf_analyzer", "harness"], "perf_analyzer": pa,
         "harness": {"ttft_ms": [30.0, 50.0, 60.0], "e2e_ms": [150.0, 200.0, 210.0]}},
        {"round": 1, "order": ["harness", "perf_analyzer"], "perf_analyzer": {**pa, "exit_code": 99},
         "harness": {"ttft_ms": [45.0], "e2e_ms": [170.0]}},
    ]  # fmt: skip
    ratios = round_ratios(rounds)
    assert [r["round"] for r in ratios] == [0]  # a failed perf_analyzer run pairs with nothing
    assert ratios[0]["first_vs_ttft"] == pytest.approx(40.0 / 50.0)
    assert ratios[0]["last_vs_e2e"] == pytest.approx(160.0 / 200.0)
    assert ratios[0]["order"] == "perf_analyzer then harness"
    base = {"p50_latency_ms": 163.0, **pa}
    harness = {"requests": 4, "errors": 0, "ttft_p50_ms": 47.5, "e2e_p50_ms": 185.0}
    summary = {
        "command": "c", "perf_analyzer": "v", "window_requests": 8, "inputs": "i", "runs": [],
        "comparison": {**comparison("llm", base, harness), "rounds": ratios, "harness_reps": 1,
                       "perf_analyzer_requests": 30},
    }  # fmt: skip
    text = markdown(summary)
    assert "| first response vs TTFT p50 | 40.0 | 47.5 | 0.842 |" in text
    assert "| 0 | perf_analyzer then harness | 40.0 | 50.0 | 0.800 | 160.0 | 200.0 | 0.800 |" in text
    assert "perf_analyzer 30 requests recorded, harness 4 requests (0 errors)" in text

"""AIPerf beside our harness and perf_analyzer (bench/aiperf.py, bench/aiperf_run.py): the input
files every client gets, AIPerf's command line, the parsing of AIPerf's and perf_analyzer's
exports and the results table. The run itself is the documented command (docs/benchmarks/aiperf.md,
``make bench-aiperf``); where ``make aiperf-tools`` installed AIPerf, its own loaders read our files.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.aiperf import (
    AIPERF_VENV,
    chat_payloads,
    generate_payloads,
    locate,
    profile_command,
    read_export,
    write_inputs_json,
    write_raw_payloads,
)
from bench.aiperf_run import failed_rows, harness_row, markdown, median_rows, perf_analyzer_row
from bench.cpu_sampler import CLIENT, SERVER, CpuSampler
from bench.metrics import RequestRecord, summarize
from bench.openai_target import chat_body
from bench.workload import LengthDist, WorkloadBuilder, WorkloadSpec

# An AIPerf 0.13.0 export of our API (epd, c=1), cut to the fields read here and a few beside them.
EXPORT = Path(__file__).parents[1] / "data" / "aiperf" / "profile_export_aiperf.json"


@pytest.fixture(scope="module")
def requests():
    spec = WorkloadSpec(image_sizes=((64, 48),), output_tokens=LengthDist.parse("16", minimum=1))
    return WorkloadBuilder(spec).build(3, 0.0)


def test_chat_payloads_are_the_harness_bodies(requests):
    payloads = chat_payloads(requests, "epd")
    assert payloads == [chat_body(r, "epd") for r in requests]
    first = payloads[0]
    assert first["model"] == "epd" and first["stream"] is True and first["stream_options"] == {"include_usage": True}
    assert first["max_tokens"] == 16 and first["ignore_eos"] is True and first["temperature"] == 0.0
    system, user = first["messages"]
    assert system["role"] == "system" and [p["type"] for p in user["content"]] == ["image_url", "text"]
    assert user["content"][0]["image_url"]["url"].startswith("data:image/jpeg;base64,")


def test_generate_payloads_carry_the_same_prompt_image_and_sampling(requests):
    body = generate_payloads(requests)[0]
    assert body["text_input"] == requests[0].prompt
    assert [base64.b64decode(i) for i in body["image"]] == list(requests[0].images)
    assert body["stream"] is True and body["exclude_input_in_output"] is True
    assert json.loads(body["sampling_parameters"]) == requests[0].sampling


def test_input_files_have_aiperfs_shapes(tmp_path: Path, requests):
    lines = write_raw_payloads(chat_payloads(requests, "llm"), tmp_path / "chat.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == chat_payloads(requests, "llm")
    inputs = json.loads(write_inputs_json(generate_payloads(requests), tmp_path / "generate.json").read_text())
    assert [s["session_id"] for s in inputs["data"]] == ["request-0", "request-1", "request-2"]
    assert [s["payloads"] for s in inputs["data"]] == [[p] for p in generate_payloads(requests)]


def test_profile_command_against_our_openai_api(tmp_path: Path):
    command = profile_command(
        Path("/v/bin/aiperf"), model="epd", url="http://127.0.0.1:9000", input_file=tmp_path / "in.jsonl",
        dataset_type="raw_payload", concurrency=4, requests=24, tokenizer=Path("/m"), artifact_dir=tmp_path / "a",
    )  # fmt: skip
    assert command[:2] == ["/v/bin/aiperf", "profile"]
    pairs = dict(zip(command, command[1:], strict=False))
    assert pairs["--endpoint-type"] == "chat" and pairs["--custom-dataset-type"] == "raw_payload"
    assert pairs["--concurrency"] == "4" and pairs["--request-count"] == "24"
    assert pairs["--dataset-sampling-strategy"] == "sequential" and "--warmup-request-count" not in command
    assert "--streaming" in command and "--use-server-token-count" in command
    assert "--extra-inputs" not in command


def test_profile_command_against_triton_generate(tmp_path: Path):
    command = profile_command(
        Path("aiperf"), model="llm", url="http://127.0.0.1:8000/v2/models/llm/generate_stream",
        input_file=tmp_path / "in.json", dataset_type="inputs_json", concurrency=1, requests=24,
        tokenizer=Path("/m"), artifact_dir=tmp_path, endpoint_type="raw", server_token_count=False,
        extra_inputs=["response_field:text_output"],
    )  # fmt: skip
    pairs = dict(zip(command, command[1:], strict=False))
    assert pairs["--endpoint-type"] == "raw" and pairs["--extra-inputs"] == "response_field:text_output"
    assert "--use-server-token-count" not in command  # Triton's events carry no OpenAI usage


def test_read_export_takes_aiperfs_p50s_and_counts():
    row = read_export(EXPORT)
    exported = json.loads(EXPORT.read_text())
    assert row["ttft_p50_ms"] == exported["time_to_first_token"]["p50"]
    assert row["itl_p50_ms"] == exported["inter_token_latency"]["p50"]
    assert row["e2e_p50_ms"] == exported["request_latency"]["p50"]
    assert row["req_per_s"] == exported["request_throughput"]["avg"]
    assert row["completed"] == int(exported["request_count"]["avg"]) and row["failed"] == 0
    assert row["aiperf_version"] == "0.13.0"
    assert 0 < row["window_end"] - row["window_start"] < 60  # the profiling phase, in seconds


def test_read_export_without_a_metric_gives_none(tmp_path: Path):
    path = tmp_path / "export.json"
    path.write_text(json.dumps({"request_count": {"unit": "requests", "avg": 3.0}}))
    row = read_export(path)
    assert row["completed"] == 3 and row["failed"] == 0 and row["ttft_p50_ms"] is None


def test_locate_says_how_to_install(tmp_path: Path):
    assert locate(tmp_path) == (None, f"AIPerf is not installed in {tmp_path}: run `make aiperf-tools`")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "aiperf").write_text("")
    (tmp_path / "lib" / "python3.11" / "site-packages" / "aiperf-0.12.0.dist-info").mkdir(parents=True)
    assert "another AIPerf than 0.13.0" in locate(tmp_path)[1]


def test_harness_row_uses_tpot_for_the_per_token_column():
    records = [
        RequestRecord("a", 0.0, [0.1, 0.2, 0.4], [1, 1, 1]),
        RequestRecord("b", 0.1, [0.2, 0.3, 0.6], [1, 1, 1]),
    ]
    row = harness_row(summarize(records))
    assert row["completed"] == 2 and row["failed"] == 0
    assert row["ttft_p50_ms"] == pytest.approx(150.0) and row["e2e_p50_ms"] == pytest.approx(500.0)
    assert row["itl_p50_ms"] == pytest.approx(175.0)  # (e2e - TTFT) / 2: 150 and 200 ms
    assert row["req_per_s"] == pytest.approx(2 / 0.7)


def test_perf_analyzer_row_reads_first_last_and_gap_per_response(tmp_path: Path):
    (tmp_path / "report.csv").write_text("Concurrency,Inferences/Second,p50 latency\n1,2.5,400000\n")
    ms = 1_000_000  # export timestamps are nanoseconds
    requests = [
        {"timestamp": 0, "response_timestamps": [100 * ms, 200 * ms, 300 * ms]},
        {"timestamp": 10 * ms, "response_timestamps": [210 * ms, 510 * ms]},
        {"timestamp": 0, "response_timestamps": []},
    ]
    (tmp_path / "profile.json").write_text(json.dumps({"experiments": [{"requests": requests}]}))
    row = perf_analyzer_row(tmp_path)
    assert row["completed"] == 2 and row["failed"] == 1 and row["req_per_s"] == 2.5
    assert row["ttft_p50_ms"] == 150 and row["e2e_p50_ms"] == 400
    assert row["itl_p50_ms"] == 200  # 100 ms per response, and 300 ms
    assert row["output_tokens_mean"] == 2.5


def test_table_and_failures():
    good = {"model": "epd", "concurrency": 1, "client": "aiperf", "endpoint": "openai", "load": 3.0,
            "completed": 24, "failed": 0, "req_per_s": 1.0, "ttft_p50_ms": 50.0, "itl_p50_ms": 10.0,
            "e2e_p50_ms": 200.0, "output_tokens_mean": 16.0, "cpu_s": 9.5, "client_cores": 0.5,
            "server_cores": 1.25, "wall_s": 30.0}  # fmt: skip
    pa_more = {**good, "client": "perf_analyzer", "endpoint": "triton-grpc", "completed": 26}
    broken = {**good, "endpoint": "triton-http", "error": "aiperf exit 1"}
    short = {**good, "client": "harness", "completed": 23}
    assert failed_rows([good, pa_more, broken, short], 24) == [broken, short]
    table = markdown([good, broken], "t", "cmd")
    cells = "| 24 | 0 | 1.00 | 50.00 | 10.00 | 200.00 | 16.00 | 9.50 | 0.50 | 1.25 | 30.00 | 3.0 |"
    assert "| epd | 1 | aiperf | openai " + cells in table
    assert "| epd | 1 | aiperf | triton-http | error |" in table
    assert "- aiperf -> triton-http, epd c=1: aiperf exit 1" in table


def test_repetitions_merge_into_medians_and_sums():
    rep = {"model": "llm", "concurrency": 4, "client": "harness", "endpoint": "openai", "failed": 0,
           "completed": 24, "req_per_s": 10.0, "ttft_p50_ms": 50.0, "itl_p50_ms": 5.0, "e2e_p50_ms": 120.0,
           "output_tokens_mean": 16.0, "cpu_s": 2.0, "wall_s": 3.0, "load": 1.0}  # fmt: skip
    reps = [rep, {**rep, "ttft_p50_ms": 80.0, "load": 3.0}, {**rep, "ttft_p50_ms": 60.0, "failed": 1, "load": 2.0}]
    other = {**rep, "client": "aiperf", "error": "aiperf exit 2"}
    (harness, aiperf) = median_rows([*reps, other, {**other, "error": None}])
    assert harness["reps"] == 3 and harness["completed"] == 72 and harness["failed"] == 1
    assert harness["ttft_p50_ms"] == 60.0 and harness["load"] == 2.0 and harness["req_per_s"] == 10.0
    assert aiperf["error"] == "1 of 2 repetitions: aiperf exit 2" and "completed" not in aiperf


def test_cpu_sampler_splits_a_client_tree_from_the_rest():
    busy = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\n"
    with CpuSampler(interval_s=0.05) as sampler:
        started = time.time()
        server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
        client = subprocess.Popen([sys.executable, "-c", busy])
        sampler.set_client(client.pid)
        client.wait()
        sampler.set_client(None)
        server.wait()
        ended = time.time()
        sampler.sample()
    assert 0.5 <= sampler.used(CLIENT, started, ended) <= 1.5  # 0.6 s of work plus start-up
    assert sampler.used(SERVER, started, ended) < 0.5  # a sleeping process
    assert sampler.used(CLIENT, started - 60, ended) is None  # before the first sample


@pytest.mark.skipif(locate()[0] is None, reason="AIPerf is not installed: make aiperf-tools")
def test_aiperfs_own_loaders_read_our_files(tmp_path: Path, requests):
    chat = write_raw_payloads(chat_payloads(requests, "epd"), tmp_path / "chat.jsonl")
    generate = write_inputs_json(generate_payloads(requests), tmp_path / "generate.json")
    script = (
        "import sys\n"
        "from aiperf.dataset.loader.raw_payload import RawPayloadDatasetLoader as R\n"
        "from aiperf.dataset.loader.inputs_json import InputsJsonPayloadLoader as I\n"
        "import orjson\n"
        "first = orjson.loads(open(sys.argv[1], 'rb').readline())\n"
        "assert R.can_load(data=first), 'raw_payload refuses our chat line'\n"
        "assert I.can_load(filename=sys.argv[2]), 'inputs_json refuses our generate file'\n"
    )
    done = subprocess.run(
        [str(AIPERF_VENV / "bin" / "python"), "-c", script, str(chat), str(generate)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]

"""perf_analyzer, as users load-test with it, against ``llm`` and ``epd``: image inputs, gRPC
streaming, concurrency 1 and 2 (``llm``) and 1 to 4 (``epd``) on the session server, and ``epd``
also with system shared memory, on a second server whose repository takes no video (see
``images_only_server``). Then perf_analyzer's request pattern replayed without perf_analyzer
(``tests/server/perf_analyzer_replay.py``) against the session server's ``epd`` on each serving
path, at concurrency 2 and 4.

The binary is the one ``make tools`` installs (bench/perf_analyzer_tool.py: tritonclient
2.41.1's build, which runs on glibc 2.36); the tests skip only where it could not be installed,
with the reason. Checked: perf_analyzer exits 0, its CSV has a row per concurrency level with
requests counted, and Triton's own counters moved by at least what perf_analyzer counted with
no failure.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from bench.cli import main as bench_main
from bench.perf_analyzer_tool import PerfAnalyzer, locate
from bench.server_stats import scrape
from builders.repository import write_repository
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer
from python_backends import contract
from tests.server.conftest import CACHE_POLICY, LOG_DIR, SLOT, TEST_EXIT_TIMEOUT_S, serving
from tests.server.perf_analyzer_replay import replay

pytestmark = pytest.mark.server

COUNT_PER_WINDOW = 4  # requests per measurement window (count_windows: no wall-clock assumption)


@pytest.fixture(scope="module")
def perf_analyzer() -> PerfAnalyzer:
    tool, reason = locate()
    if tool is None:
        pytest.skip(reason)
    return tool


def write_input_files(server: TritonServer, out: Path, models: tuple[str, ...]) -> Path:
    """``bench perf-analyzer-inputs`` for ``models``: only the inputs each declares on ``server``."""
    assert bench_main([
        "perf-analyzer-inputs", "--out", str(out), "--models", *models, "--count", "4",
        "--output-tokens", "8", "--image-size", "128x96", "--url", server.grpc_url,
    ]) == 0  # fmt: skip
    return out


@pytest.fixture(scope="module")
def input_files(server: TritonServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_input_files(server, tmp_path_factory.mktemp("perf_analyzer_inputs"), ("llm", "epd"))


# perf_analyzer 2.41 refuses system shared memory for a model with an optional input the data leaves
# out ("does not support optional inputs"). ``llm`` declares ``image_embeds``/``image_grid_thw``
# (by-value embeddings), which an image request cannot also carry, so it runs without. ``epd``'s
# ``errors_as_outputs`` is filled with its neutral ``false`` (bench.perf_analyzer.data_entry), and
# with that the case ran clean 3 times (docs/benchmarks/perf-analyzer.md); since e681360
# the session server's ``epd`` also declares the optional ``video``, which an image request leaves
# out, and a 0-item ``video`` cannot go in shared memory. A model with ``max_videos`` 0 declares no
# ``video`` (ModelInterface.taking_videos): the shm case runs against such an ``epd``, on a server
# of its own (the session server's repository keeps video), whose repository the builders write
# with ``max_videos=0`` and ``path_policy`` disaggregated (no colocated engine), loading only what
# epd's disaggregated path calls.
IMAGES_ONLY_REPOSITORY = REPO_ROOT / "build" / "test-slots" / f"images-only-repository-{SLOT}"
IMAGES_ONLY_MODELS = (
    contract.PREPROCESS_MODEL, contract.VIT_ENCODER_MODEL, contract.ENCODE_MODEL, *CACHE_POLICY.encoder_models,
    contract.PREFILL_MODEL, contract.DECODE_MODEL, contract.EPD_MODEL,
)  # fmt: skip


@pytest.fixture
def images_only_server(model_dir: Path, node_dir: Path) -> Iterator[TritonServer]:
    """A second server: image-only ``epd`` (disaggregated) with its own store and KV folder. For
    its one test only (stopped right after), and that test runs first in this module: run alone,
    this file has the two servers up one after the other, not together (24 GiB here)."""
    write_repository(
        "cpu", model_dir, IMAGES_ONLY_REPOSITORY,
        cache=dataclasses.replace(CACHE_POLICY, path=str(node_dir / "images-only-embeddings")),
        kv_store_path=str(node_dir / "images-only-kv"), path_policy=contract.DISAGGREGATED_PATH, max_videos=0,
    )  # fmt: skip
    control = ("--model-control-mode=explicit", *(f"--load-model={m}" for m in IMAGES_ONLY_MODELS))
    options = ServerOptions(
        IMAGES_ONLY_REPOSITORY, Ports.free(), extra_args=control, exit_timeout_s=TEST_EXIT_TIMEOUT_S
    )
    with serving(options, LOG_DIR / "perf-analyzer-images-only.log") as running:
        yield running


@pytest.fixture
def images_only_input_files(images_only_server: TritonServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = write_input_files(images_only_server, tmp_path_factory.mktemp("perf_analyzer_inputs_shm"), ("epd",))
    client = grpcclient.InferenceServerClient(images_only_server.grpc_url)
    try:
        declared = {i.name for i in client.get_model_metadata("epd").inputs}
    finally:
        client.close()
    assert contract.VIDEO not in declared
    # What --shared-memory needs: every entry gives every input epd declares, optional ones too.
    for entry in json.loads((out / "epd.json").read_text())["data"]:
        assert set(entry) == declared
    return out


def _counters(server: TritonServer, model: str) -> tuple[float, float]:
    """Triton's success and failure counts for ``model`` (all failure reasons)."""
    snapshot = scrape(server.metrics_url)
    assert snapshot is not None
    counts = {"nv_inference_request_success": 0.0, "nv_inference_request_failure": 0.0}
    for (name, labels), value in snapshot.counters.items():
        if name in counts and dict(labels).get("model") == model:
            counts[name] += value
    return counts["nv_inference_request_success"], counts["nv_inference_request_failure"]


# Concurrency levels per model: epd up to 4, where perf_analyzer once failed from 2 on
# (docs/benchmarks/investigations.md).
LEVELS = {"llm": (1, 2), "epd": (1, 2, 3, 4)}


# The shm case first (see images_only_server).
@pytest.mark.parametrize(("model", "shared_memory"), [("epd", "system"), ("llm", "none"), ("epd", "none")])
def test_perf_analyzer_streams_images(
    perf_analyzer: PerfAnalyzer, request: pytest.FixtureRequest, tmp_path: Path, model: str, shared_memory: str
):
    # Shared memory: the image-only epd's server (IMAGES_ONLY_REPOSITORY above); else the session's.
    shm = shared_memory == "system"
    server: TritonServer = request.getfixturevalue("images_only_server" if shm else "server")
    input_files: Path = request.getfixturevalue("images_only_input_files" if shm else "input_files")
    report = tmp_path / "report.csv"
    levels = LEVELS[model]
    command = [
        str(perf_analyzer.binary), "-m", model, "-i", "grpc", "-u", server.grpc_url, "--streaming",
        "--input-data", str(input_files / f"{model}.json"), "--concurrency-range", f"{levels[0]}:{levels[-1]}",
        "--measurement-mode", "count_windows", "--measurement-request-count", str(COUNT_PER_WINDOW),
        "--max-trials", "3", "--stability-percentage", "1000", "-f", str(report),
        "--profile-export-file", str(tmp_path / "profile.json"),
    ]  # fmt: skip
    if shm:  # BYTES outputs have no fixed size: a region size per output
        command += ["--shared-memory", "system", "--output-shared-memory-size", "65536"]
    success_before, failure_before = _counters(server, model)
    done = subprocess.run(command, env=perf_analyzer.env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    rows = list(csv.DictReader(report.open()))
    # perf_analyzer writes its CSV rows in order of throughput, not of concurrency.
    assert sorted(int(row["Concurrency"]) for row in rows) == list(levels)
    for row in rows:
        assert float(row["Inferences/Second"]) > 0
    # Every request perf_analyzer sent came back complete at every level (its export records each
    # request with its response times), and Triton saw them all succeed.
    exported = json.loads((tmp_path / "profile.json").read_text())
    per_level = {e["experiment"]["value"]: e["requests"] for e in exported["experiments"]}
    assert sorted(per_level) == list(levels)
    for level, recorded in per_level.items():
        assert len(recorded) >= COUNT_PER_WINDOW, (level, len(recorded))
        assert all(r["response_timestamps"] for r in recorded), level
    requests = [r for recorded in per_level.values() for r in recorded]
    success_after, failure_after = _counters(server, model)
    assert failure_after == failure_before
    assert success_after - success_before >= len(requests)


# perf_analyzer's request pattern without perf_analyzer (tests/server/perf_analyzer_replay.py says
# what it does): one gRPC stream per concurrency slot, per-slot request ids "0", "1", ... (the same
# id on every stream at once), the empty final response asked for, every declared output requested.
# The original failure ("Failed to retrieve results from inference request." at c=2;
# docs/benchmarks/investigations.md) was on epd's disaggregated path, the only path epd had then:
# it is forced here, next to the default.
PATHS = {"default": None, "disaggregated": {"path": "disaggregated"}}


@pytest.mark.parametrize("concurrency", [2, 4])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_perf_analyzer_pattern_without_perf_analyzer(
    server: TritonServer, input_files: Path, concurrency: int, path: str
):
    per_slot = 3
    success_before, failure_before = _counters(server, "epd")
    result = replay(server.grpc_url, "epd", input_files / "epd.json", concurrency, per_slot, PATHS[path], 300)
    assert result.problems() == []
    assert len(result.traces) == concurrency * per_slot
    # Triton counts a decoupled request when it releases it, just after its final response.
    deadline = time.monotonic() + 10
    while (counts := _counters(server, "epd"))[0] - success_before < concurrency * per_slot:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert counts[1] == failure_before
    assert counts[0] - success_before == concurrency * per_slot

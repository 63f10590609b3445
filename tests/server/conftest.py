"""Real-server fixtures: one tritonserver per test session, on free ports, with its own files.

The server serves the repository that ``builders`` generate for the ``cpu`` target, with the
tiny default model; tests talk to it over gRPC and HTTP like users do.

Isolation: a test session holds one *slot* (an exclusive lock, released when the session's
process ends) and its server gets the slot's repository copy, embedding store, KV transfer
folder and log, so test sessions running side by side (or a user's ``make serve``) never
share a store, and a test that clears or shrinks the store touches only its own server's.
The slot's repository path stays the same from one session to the next, so its build
stamps (``model.onnx``, ``model.dali``) stay valid and nothing is exported again.

Every server a test starts is stopped with a check: a stop that needed SIGKILL, a stub that
segfaulted or a model that hit Triton's exit timeout fails the session (or module) that
started it, with the log lines shown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import os
import re
import shutil
import tempfile
import time
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from builders.launcher import prepare
from builders.repository import TARGETS
from builders.tritonserver import EXIT_TIMEOUT_MARKERS, REPO_ROOT, Ports, ServerOptions, StopReport, TritonServer
from client.epd_client import GrpcClient, HttpClient
from python_backends.runtime.heartbeat import HEARTBEAT_DIR_ENV
from python_backends.store import EmbeddingStore, StoreConfig
from tests.server import stop_dump

# Request parameters of tests about the disaggregated path's store and encoders: under the
# default `adaptive` policy a request may take the colocated path, which sends new media to epd's
# own engine (no encode, no store entry).
DISAGGREGATED = {"path": "disaggregated"}

SLOTS = 16
SHM = Path("/dev/shm")  # tmpfs, like the served defaults


def _hold_slot() -> tuple[int, IO[str]]:
    """The first slot no other live test session of this machine holds (flock: freed when its
    process dies). The locks live beside the slots' tmpfs folders, so that sessions of other
    checkouts of the project (which share /dev/shm) take other slots too."""
    for slot in range(SLOTS):
        handle = open(SHM / f"triton-epd-test-slot-{slot}.lock", "w")  # held for the whole session
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        return slot, handle
    raise RuntimeError(f"all {SLOTS} server-test slots are held by running test sessions")


SLOT, _SLOT_LOCK = _hold_slot()
LOG_DIR = REPO_ROOT / "build" / "test-logs" / f"slot-{SLOT}"
SERVER_REPOSITORY = REPO_ROOT / "build" / "test-slots" / f"repository-{SLOT}"
LAUNCHER_REPOSITORY = REPO_ROOT / "build" / "test-slots" / f"launcher-repository-{SLOT}"  # what test_launcher serves
NODE_DIR = SHM / f"triton-epd-test-slot-{SLOT}"
KV_STORE_PATH = NODE_DIR / "kv"
# What the session server's repository is generated with: the cpu target's, in this slot.
CACHE_POLICY = dataclasses.replace(TARGETS["cpu"].cache, path=str(NODE_DIR / "embeddings"))


def open_node_store(capacity_bytes: int = CACHE_POLICY.capacity_bytes) -> EmbeddingStore:
    """The session server's store, opened by the test like any process of the node. Opening sets
    the capacity for every process (the store's documented rule): tests that shrink it with this
    put it back afterwards."""
    return EmbeddingStore(StoreConfig(path=CACHE_POLICY.path, capacity_bytes=capacity_bytes, merge_size=2))


def unclean_stop(report: StopReport | None, stuck: stop_dump.StuckStop | None = None) -> str | None:
    """Why a stop was not clean (the report with its problem log lines, and where the stubs of
    a stuck stop hung), or None."""
    if report is None or report.clean:
        return None
    where = f"\n{stuck.describe()}" if stuck is not None and stuck.summary else ""
    return f"the server did not stop cleanly: {report.describe()}{where}"


def check_stop(report: StopReport | None, stuck: stop_dump.StuckStop | None = None) -> None:
    """Fail on an unclean stop (SIGKILL, a stub crash, or Triton's exit timeout), except the one
    case of Triton 2.51 holding a model of ours that holds nothing (``stop_dump.held_by_triton``):
    that is recorded and warned about instead, except in CI (``CI=true``), where it fails too: our
    clients must never trip that leak, and a green CI run is then the record that none did (CI
    keeps no output of green runs)."""
    problem = unclean_stop(report, stuck)
    if problem and report is not None and stuck is not None and held_only_by_triton(report, stuck):
        with (LOG_DIR.parent / "models-held-by-triton.txt").open("a") as record:
            record.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {problem}\n\n")
        if os.environ.get("CI") == "true":
            pytest.fail(f"a model was held by Triton (its cancel leak) at the stop: {problem}", pytrace=False)
        warnings.warn(TritonHeldModel(problem), stacklevel=2)
        return
    if problem:
        pytest.fail(problem, pytrace=False)


class TritonHeldModel(UserWarning):
    """A stop that hit Triton's exit timeout only because Triton 2.51's gRPC frontend kept a
    cancelled stream's request (docs/operations.md "Server stop"; ``make cancel-storm``)."""


def held_only_by_triton(report: StopReport, stuck: stop_dump.StuckStop) -> bool:
    exit_timeout_only = all(any(text in line for text in EXIT_TIMEOUT_MARKERS) for line in report.problems)
    return stuck.held_by_triton and not report.killed and bool(report.problems) and exit_timeout_only


@contextlib.contextmanager
def serving(options: ServerOptions, log_path: Path, timeout_s: float = 900) -> Iterator[TritonServer]:
    """A ready server for the ``with`` body; stopped afterwards and failed if it stopped badly.
    When the body raised, that error is the one reported (the server is stopped all the same).
    Its stubs beat a heartbeat file (``python_backends/runtime/heartbeat.py``): a stuck stop's check reads
    them."""
    with tempfile.TemporaryDirectory(prefix="triton-epd-heartbeats-") as folder:
        heartbeats = Path(options.extra_env.get(HEARTBEAT_DIR_ENV, folder))
        options = dataclasses.replace(options, extra_env={**options.extra_env, HEARTBEAT_DIR_ENV: str(heartbeats)})
        server = TritonServer(options, log_path).start()
        try:
            server.wait_ready(timeout_s=timeout_s)
            yield server
        except BaseException:
            server.stop()
            raise
        left_open = streams_left_open(server)
        # Tests' tritonclient objects that are only kept alive by reference cycles (stream callbacks
        # closing over their queues) still hold gRPC streams and connections to the server, and
        # Triton counts those models as live until its exit timeout. Collect them first, as a
        # process that had finished with its clients would have.
        gc.collect()
        with stop_dump.watch_stuck_stop(server, heartbeats) as stuck:
            report = stop_dump.stop_with_dump(server) if stop_dump.enabled() else server.stop()
    if left_open:
        problem = unclean_stop(report, stuck) or "the server then stopped cleanly"
        pytest.fail(
            f"BLS streams left open once every request had ended (they hold up the unload, issue 19): "
            f"{left_open}; {problem}",
            pytrace=False,
        )
    check_stop(report, stuck)


def streams_left_open(server: TritonServer, timeout_s: float = 30.0) -> dict[str, float]:
    """Each model's ``epd_<model>_bls_open_streams`` that is not 0 after up to ``timeout_s`` (a
    stream its caller left is read to its final response within seconds); {} if none is."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
        except OSError:  # the server is gone: its stop report says why
            return {}
        left = {
            model: float(value)
            for model, value in re.findall(r"^epd_(\w+)_bls_open_streams\{.*\} (\S+)$", text, re.MULTILINE)
            if float(value)
        }
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def encoder_references(server: TritonServer, images: list[bytes], model: str = "encoder_0") -> list[bytes]:
    """An encoder model's raw answer for ``images``: one signed reference per image (no lease)."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        image = grpcclient.InferInput("image", [len(images)], "BYTES")
        image.set_data_from_numpy(np.array(images, dtype=np.object_))
        client.async_stream_infer(model, [image])
        result, error = responses.get(timeout=300)
        assert error is None, error
        return [bytes(r) for r in result.as_numpy("references").reshape(-1)]
    finally:
        client.stop_stream()
        client.close()


@pytest.fixture(scope="session")
def model_dir() -> Path:
    # The default repository too: tests read its engine args and artefacts.
    return prepare("cpu", None, REPO_ROOT / "model_repository")


@pytest.fixture(scope="session")
def node_dir() -> Iterator[Path]:
    """The slot's tmpfs folder (stores, KV folders): empty at the start, removed at the end."""
    shutil.rmtree(NODE_DIR, ignore_errors=True)
    NODE_DIR.mkdir(parents=True)
    yield NODE_DIR
    shutil.rmtree(NODE_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def server_repository(model_dir: Path, node_dir: Path) -> Path:
    """The slot's repository: configs generated with the slot's store and KV paths (the builders
    copy the kept model code of model_repository/)."""
    prepare("cpu", model_dir, SERVER_REPOSITORY, cache=CACHE_POLICY, kv_store_path=str(KV_STORE_PATH))
    return SERVER_REPOSITORY


# Triton's exit timeout for test servers. vLLM-backed models take 15-30 s to unload on a busy
# 2-core machine (mostly their stub's interpreter teardown), close to Triton's default 30 s; a model
# that never unloads still fails the stop check, later.
TEST_EXIT_TIMEOUT_S = 120


@pytest.fixture(scope="session")
def server(server_repository: Path) -> Iterator[TritonServer]:
    options = ServerOptions(server_repository, Ports.free(), exit_timeout_s=TEST_EXIT_TIMEOUT_S)
    with serving(options, LOG_DIR / "server.log") as running:
        yield running


@contextlib.contextmanager
def openai_api(grpc_url: str, model_dir: Path, log_path: Path) -> Iterator[str]:
    """Our OpenAI API (client.openai_server) in front of a Triton server, rendering chats with
    ``model_dir``'s template: its base URL while the ``with`` body runs; it must stop unkilled."""
    import sys

    from builders.processes import ProcessGroup, http_ok, wait_until_ready
    from builders.tritonserver import free_port

    port = free_port()
    command = [sys.executable, "-m", "client.openai_server", "--triton-grpc-url", grpc_url,
               "--model-dir", str(model_dir), "--port", str(port)]  # fmt: skip
    app = ProcessGroup("openai-server", command, log_path=log_path).start()
    try:
        wait_until_ready(lambda: http_ok(f"http://127.0.0.1:{port}/health"), [app], 120, "the OpenAI server")
        yield f"http://127.0.0.1:{port}"
    finally:
        report = app.stop(timeout_s=30)
        assert report is not None and not report.killed, report and report.describe()


def _client(server: TritonServer, model: str) -> Iterator[GrpcClient]:
    client = GrpcClient(server.grpc_url, model)
    yield client
    client.close()


@pytest.fixture
def grpc_client(server: TritonServer) -> Iterator[GrpcClient]:
    yield from _client(server, "llm")


@pytest.fixture
def llm(server: TritonServer) -> Iterator[GrpcClient]:
    yield from _client(server, "llm")


@pytest.fixture
def epd(server: TritonServer) -> Iterator[GrpcClient]:
    yield from _client(server, "epd")


@pytest.fixture
def http_client(server: TritonServer) -> Iterator[HttpClient]:
    client = HttpClient(server.http_url, "llm")
    yield client
    client.close()

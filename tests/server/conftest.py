"""Real-server fixtures: one tritonserver per test session, on free ports.

The server serves the repository that ``builders`` generate for the ``cpu`` target,
with the tiny default model; tests talk to it over gRPC and HTTP like users do.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from builders.repository import TARGETS
from client.epd_client import GrpcClient, HttpClient
from builders.launcher import prepare
from python_backends.store import EmbeddingStore, StoreConfig
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer

LOG_DIR = REPO_ROOT / "build" / "test-logs"
CACHE_POLICY = TARGETS["cpu"].cache  # what the served repository was generated with


def open_node_store(capacity_bytes: int = CACHE_POLICY.capacity_bytes) -> EmbeddingStore:
    """The server's store, opened by the test like any process of the node. Opening sets the
    capacity for every process (the store's documented rule): tests that shrink it with this
    put it back afterwards."""
    return EmbeddingStore(StoreConfig(path=CACHE_POLICY.path, capacity_bytes=capacity_bytes, merge_size=2))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return prepare("cpu", None, REPO_ROOT / "model_repository")


@pytest.fixture(scope="session")
def server(model_dir: Path) -> Iterator[TritonServer]:
    options = ServerOptions(REPO_ROOT / "model_repository", Ports.free())
    with TritonServer(options, LOG_DIR / "server.log") as running:
        running.wait_ready(timeout_s=900)
        yield running


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

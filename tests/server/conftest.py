"""Real-server fixtures: one tritonserver per test session, on free ports.

The server serves the repository that ``builders`` generate for the ``cpu`` target,
with the tiny default model; tests talk to it over gRPC and HTTP like users do.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from client.epd_client import GrpcClient, HttpClient
from python_backends.launcher import prepare
from python_backends.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer

LOG_DIR = REPO_ROOT / "build" / "test-logs"


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

"""Real-server fixtures: one tritonserver per test session, on free ports.

The server serves the repository that ``builders`` generate for the ``cpu`` target,
with the tiny default model; tests talk to it over gRPC and HTTP like users do.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

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


@pytest.fixture
def grpc_client(server: TritonServer) -> Iterator[GrpcClient]:
    client = GrpcClient(server.grpc_url, "llm")
    yield client
    client.close()


@pytest.fixture
def http_client(server: TritonServer) -> Iterator[HttpClient]:
    client = HttpClient(server.http_url, "llm")
    yield client
    client.close()


def synthetic_image(width: int, height: int, seed: int, fmt: str = "JPEG") -> bytes:
    """A deterministic picture with structure (gradients + blocks), not flat noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)), ((x + y) % 256)], -1)
    blocks = rng.integers(0, 256, size=(8, 8, 3))
    tiled = blocks[(y * 8 // height), (x * 8 // width)]
    pixels = ((base + tiled) // 2).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()

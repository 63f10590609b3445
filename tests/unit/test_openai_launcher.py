"""``triton-epd-serve --openai-port N``: the launcher starts the OpenAI app beside Triton, as a
child process group in front of Triton's gRPC port and the served checkpoint, and none without
the option."""

from __future__ import annotations

import sys
from pathlib import Path

from builders.launcher import openai_app, parse_args
from builders.tritonserver import Ports, ServerOptions, TritonServer


def _server(tmp_path: Path) -> TritonServer:
    return TritonServer(ServerOptions(tmp_path / "repository", Ports(18000, 18001, 18002)))


def test_no_openai_app_without_the_option(tmp_path: Path):
    assert parse_args([]).openai_port is None
    assert openai_app(parse_args([]), tmp_path / "model", _server(tmp_path)) is None


def test_the_openai_app_serves_the_checkpoint_in_front_of_tritons_grpc_port(tmp_path: Path):
    args = parse_args(["--openai-port", "19000", "--log-file", str(tmp_path / "triton.log")])
    app = openai_app(args, tmp_path / "model", _server(tmp_path))
    assert app is not None and app.process is None  # made, not started
    assert app.command[:3] == [sys.executable, "-m", "client.openai_server"]
    options = dict(zip(app.command[3::2], app.command[4::2], strict=True))
    assert options == {
        "--triton-grpc-url": "127.0.0.1:18001",
        "--model-dir": str(tmp_path / "model"),
        "--host": "127.0.0.1",  # this machine only unless --openai-host says otherwise
        "--port": "19000",
    }
    assert app.log_path == tmp_path / "openai-server.log"  # beside Triton's log when there is one

"""The launcher as a user runs it, and a deliberately broken repository."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from client.epd_client import GrpcClient, chat_prompt
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer

pytestmark = pytest.mark.server


def test_serve_answers_then_stops_cleanly_on_ctrl_c(model_dir: Path, tmp_path: Path):
    ports = Ports.free()
    process = subprocess.Popen(
        [sys.executable, "-m", "builders.launcher", "--http-port", str(ports.http),
         "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics),
         "--log-file", str(tmp_path / "server.log")],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        lines = []
        for line in process.stdout:  # the launcher prints endpoints, then "serving"
            lines.append(line)
            if line.startswith("serving"):
                break
        assert any(f"gRPC    127.0.0.1:{ports.grpc}" in line for line in lines), lines
        descendants = psutil.Process(process.pid).children(recursive=True)
        assert any("tritonserver" in p.name() for p in descendants)
        client = GrpcClient(f"127.0.0.1:{ports.grpc}", "llm")
        assert client.generate(chat_prompt("hi", 0), [], {"max_tokens": 4, "temperature": 0}).num_output_tokens == 4
        client.close()
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 0
        _, alive = psutil.wait_procs(descendants, timeout=30)
        assert not alive, f"left behind: {[p.name() for p in alive]}"
    finally:
        if process.poll() is None:
            process.kill()


def test_broken_repository_fails_the_start_with_a_clear_message(model_dir: Path, tmp_path: Path):
    repository = tmp_path / "repo"
    shutil.copytree(REPO_ROOT / "model_repository" / "llm", repository / "llm")
    args_path = repository / "llm" / "1" / "engine_args.json"
    args = json.loads(args_path.read_text())
    args["model"] = str(tmp_path / "no-such-checkpoint")
    args_path.write_text(json.dumps(args))
    server = TritonServer(ServerOptions(repository, Ports.free()), tmp_path / "broken.log")
    with server, pytest.raises(RuntimeError) as info:
        server.wait_ready(timeout_s=300)
    assert "no-such-checkpoint" in str(info.value) and "does not exist" in str(info.value)

"""The launcher as a user runs it (also started with SIGINT ignored), and a deliberately broken repository."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from builders.access import ADMIN_HEADER
from builders.tritonserver import PROBLEM_MARKERS, REPO_ROOT, Ports, ServerOptions, TritonServer
from client.epd_client import GrpcClient, chat_prompt
from tests.server.conftest import LAUNCHER_REPOSITORY, LOG_DIR, TEST_EXIT_TIMEOUT_S

pytestmark = pytest.mark.server


def _ignore_sigint() -> None:
    # As `cmd &` from a script or nohup start it: Python then installs no SIGINT handler itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("sigint_at_start", ["default", "ignored"])
def test_serve_answers_then_stops_cleanly_on_ctrl_c(
    model_dir: Path, node_dir: Path, sigint_at_start: str, tmp_path: Path
):
    ports = Ports.free()
    admin_key_file = tmp_path / "admin-key"
    log = LOG_DIR / f"launcher-sigint-{sigint_at_start}.log"
    # Its own repository, store and KV folder: the session server's stay untouched.
    process = subprocess.Popen(
        [sys.executable, "-m", "builders.launcher", "--http-port", str(ports.http),
         "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics), "--log-file", str(log),
         "--model-repository", str(LAUNCHER_REPOSITORY),
         "--cache-path", str(node_dir / "launcher-embeddings"), "--kv-store-path", str(node_dir / "launcher-kv"),
         "--exit-timeout-s", str(TEST_EXIT_TIMEOUT_S), "--admin-key-file", str(admin_key_file)],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_ignore_sigint if sigint_at_start == "ignored" else None,
    )
    try:
        lines = []
        for line in process.stdout:  # the launcher prints endpoints, then "serving"
            lines.append(line)
            if line.startswith("serving"):
                break
        assert any(f"gRPC    127.0.0.1:{ports.grpc}" in line for line in lines), lines
        engine_args = json.loads((LAUNCHER_REPOSITORY / "prefill" / "1" / "engine_args.json").read_text())
        kv_folder = engine_args["kv_transfer_config"]["kv_connector_extra_config"]["store_path"]
        assert kv_folder == str(node_dir / "launcher-kv")
        assert str(node_dir / "launcher-embeddings") in (LAUNCHER_REPOSITORY / "epd" / "config.pbtxt").read_text()
        descendants = psutil.Process(process.pid).children(recursive=True)
        assert any("tritonserver" in p.name() for p in descendants)
        client = GrpcClient(f"127.0.0.1:{ports.grpc}", "llm")
        assert client.generate(chat_prompt("hi", 0), [], {"max_tokens": 4, "temperature": 0}).num_output_tokens == 4
        client.close()
        # Triton's admin APIs are closed by default (builders/access.py; every category:
        # tests/server/test_access.py): a model's config opens with the generated key only.
        config_url = f"http://127.0.0.1:{ports.http}/v2/models/llm/config"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(config_url, timeout=10)
        assert refused.value.code == 403
        opened = urllib.request.Request(config_url, headers={ADMIN_HEADER: admin_key_file.read_text().strip()})
        assert json.loads(urllib.request.urlopen(opened, timeout=10).read())["name"] == "llm"
        process.send_signal(signal.SIGINT)  # kill -INT
        code = process.wait(timeout=TEST_EXIT_TIMEOUT_S + 60)
        rest = process.stdout.read()
        _, alive = psutil.wait_procs(descendants, timeout=30)
        assert not alive, f"left behind: {[p.name() for p in alive]}"
        stopped = next((line for line in rest.splitlines() if line.startswith("stopped: ")), None)
        assert stopped is not None, rest
        # The stop report tells a clean exit from a forced one: tritonserver itself exited, with 0.
        assert stopped.startswith("stopped: tritonserver exited with code 0 in "), rest
        assert code == 0, rest
        problems = [line for line in log.read_text(errors="replace").splitlines()
                    if any(marker in line for marker in PROBLEM_MARKERS)]
        assert not problems, "the server's stop logged:\n" + "\n".join(problems)
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

"""A stub that runs no Python any more is caught by the launcher's stage watch and its server
stopped, as a crashed stage is (issue 17; the deadlock it stands for:
docs/benchmarks/bls-deadlock.md).

A real tritonserver with a tiny model on our real DecoupledModel, with the heartbeat folder the
launcher gives its servers. One request makes the model hold the GIL for good, in a C call, as the
deadlocked ``epd`` stub's thread did: the process lives on, Triton still says ready, and only the
heartbeat tells. ``watch_stages`` is the launcher's own loop.
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from builders.launcher import STAGE_CRASHED, watch_stages
from builders.stage_watch import find_role
from builders.tritonserver import SHM_DIR, Ports, ServerOptions, TritonServer, stub_shm_regions
from python_backends.runtime.heartbeat import HEARTBEAT_DIR_ENV
from tests.server.tiny_models import streaming_repository

pytestmark = pytest.mark.server

FROZEN = textwrap.dedent("""
    import ctypes

    from python_backends.engines.generation import GenerationChunk, text_of
    from python_backends.triton_edge.decoupled import DecoupledModel


    class TritonPythonModel(DecoupledModel):
        INPUTS = ("text_input",)

        def setup(self, args):
            pass

        def parse(self, inputs, request):
            return text_of(inputs.get("text_input"))

        async def serve(self, parsed, request_id):
            if parsed == "freeze":  # libc's sleep with the GIL held: this stub's Python never runs again
                ctypes.PyDLL(None).sleep(3600)
            yield GenerationChunk(text="ok", token_ids=[1], finished=True)
""")


def _send(server: TritonServer, text: str) -> grpcclient.InferenceServerClient:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: None)
    prompt = grpcclient.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    client.async_stream_infer("frozen", [prompt])
    return client


def _beats(folder: Path, pid: int, within_s: float = 30) -> bool:
    """The process's heartbeat file is touched again within ``within_s``."""
    first = (folder / str(pid)).stat().st_mtime
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if (folder / str(pid)).stat().st_mtime != first:
            return True
    return False


def test_a_stub_that_runs_no_python_is_stopped_like_a_crashed_stage(tmp_path: Path, capsys) -> None:
    beats = tmp_path / "heartbeats"
    beats.mkdir()
    options = ServerOptions(
        streaming_repository(tmp_path / "repo", {"frozen": FROZEN}), Ports.free(), exit_timeout_s=3,
        extra_env={HEARTBEAT_DIR_ENV: str(beats)},
    )
    with TritonServer(options, tmp_path / "frozen.log") as server:
        server.wait_ready(timeout_s=120)
        assert server.process is not None
        stub = find_role(server.process.pid, "stub:frozen")
        assert _beats(beats, stub)  # a serving stub's file keeps moving
        regions = stub_shm_regions(server.process.pid)
        assert regions and all((SHM_DIR / name).exists() for name in regions)
        client = _send(server, "freeze")
        code = watch_stages(server, hung_after_s=5, poll_s=0.2)
        client.close()
    assert code == STAGE_CRASHED
    out = capsys.readouterr().out
    assert "stage hung: stub:frozen (no heartbeat for" in out
    assert server.process.poll() is not None  # stopped
    assert server.stop_report is not None and not server.stop_report.clean  # the frozen stub never unloaded
    assert not [name for name in regions if (SHM_DIR / name).exists()]  # its shared memory went too
    # what the stub was doing, saved before the stop: the one record of a deadlock
    (stacks,) = tmp_path.glob("hung-stage-stacks-*.txt")
    assert f"stacks of the hung stage: {stacks}" in out
    text = stacks.read_text()
    assert "==== stub:frozen (no heartbeat for" in text and "serve (" in text and "sleep" in text

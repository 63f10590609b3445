"""How a server stops, checked: a tiny python model (no vLLM, seconds to start) in a temporary
repository, whose ``finalize`` is clean, crashes its stub, or hangs past Triton's exit timeout.

The tiny model imports ``tvm_ffi`` as the vLLM stubs do: its SIGSEGV handler is what prints
``Segfault encountered`` with a backtrace into the server log (a stub without it dies silently).
It also shows issue 17's teardown crash and its fix: pb_utils Metric/MetricFamily objects still
alive when the stub's interpreter finalizes write to shared memory that is gone.
"""

from __future__ import annotations

import json
import queue
import re
import textwrap
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from builders.tritonserver import Ports, ServerOptions, TritonServer
from client.epd_client import ClientError, HttpClient
from tests.server import stop_dump
from tests.server.conftest import serving, unclean_stop
from tests.server.tiny_models import relay_repository

pytestmark = pytest.mark.server

pytest.importorskip("tvm_ffi", reason="prints the stub's segfault trace into the log")

MODEL = textwrap.dedent('''
    import gc
    import json
    import os
    import signal
    import time

    import tvm_ffi  # its SIGSEGV handler prints "Segfault encountered" and a backtrace, as in vLLM's stubs
    import triton_python_backend_utils as pb_utils


    class Counters:
        """Holds a family and its metric, and itself: a reference cycle, as real models' helpers have."""

        def __init__(self, family, metric):
            self.family, self.metric, self.me = family, metric, self


    class TritonPythonModel:
        def initialize(self, args):
            config = json.loads(args["model_config"])
            self.on_finalize = config["parameters"]["on_finalize"]["string_value"]
            self.family = pb_utils.MetricFamily(
                name="tiny_requests", description="requests", kind=pb_utils.MetricFamily.COUNTER)
            self.metric = self.family.Metric(labels={"model": "tiny"})
            self.counters = Counters(self.family, self.metric)

        def execute(self, requests):
            responses = []
            for request in requests:
                self.metric.increment(1)
                x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", x)]))
            return responses

        def finalize(self):
            if self.on_finalize in ("release_metrics", "release_metrics_without_gc"):
                # The recipe: drop every Metric, then every MetricFamily, then collect the
                # cycles that still hold them, while the stub's shared memory exists.
                del self.metric
                del self.family
                self.counters = None
                if self.on_finalize == "release_metrics":
                    gc.collect()
            elif self.on_finalize == "segfault":
                os.kill(os.getpid(), signal.SIGSEGV)
            elif self.on_finalize == "hang":
                time.sleep(3600)
            # "keep_metrics": nothing released; the interpreter's teardown frees them too late.
''')

CONFIG = '''
name: "tiny"
backend: "python"
max_batch_size: 0
input [ {{ name: "x", data_type: TYPE_INT32, dims: [ 1 ] }} ]
output [ {{ name: "y", data_type: TYPE_INT32, dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
parameters: {{ key: "on_finalize", value: {{ string_value: "{on_finalize}" }} }}
'''



def tiny_repository(root: Path, on_finalize: str) -> Path:
    (root / "tiny" / "1").mkdir(parents=True)
    (root / "tiny" / "config.pbtxt").write_text(CONFIG.format(on_finalize=on_finalize))
    (root / "tiny" / "1" / "model.py").write_text(MODEL)
    return root


def options(repository: Path, exit_timeout_s: int | None = None) -> ServerOptions:
    extra = () if exit_timeout_s is None else (f"--exit-timeout-secs={exit_timeout_s}",)
    return ServerOptions(repository, Ports.free(), extra_args=extra)


def ask(server: TritonServer) -> None:
    body = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "INT32", "data": [7]}]}).encode()
    url = f"http://{server.http_url}/v2/models/tiny/infer"
    with urllib.request.urlopen(urllib.request.Request(url, body), timeout=30) as response:
        assert json.loads(response.read())["outputs"][0]["data"] == [7]


def test_a_clean_stop_passes_the_check(tmp_path: Path) -> None:
    log = tmp_path / "clean.log"
    with serving(options(tiny_repository(tmp_path / "repo", "release_metrics")), log, timeout_s=120) as server:
        ask(server)
    report = server.stop_report
    assert report is not None and report.clean, report
    assert (report.exit_code, report.killed, report.problems) == (0, False, ())
    assert report.seconds < 30


def test_a_stub_that_segfaults_fails_the_check_with_its_log_lines(tmp_path: Path) -> None:
    log = tmp_path / "segfault.log"
    with pytest.raises(pytest.fail.Exception) as failure:
        with serving(options(tiny_repository(tmp_path / "repo", "segfault")), log, timeout_s=120) as server:
            ask(server)
    message = str(failure.value)
    assert "did not stop cleanly" in message and "Segfault encountered" in message and str(log) in message
    assert server.stop_report is not None and not server.stop_report.killed  # a crash, not a forced kill


def test_a_model_that_outlives_the_exit_timeout_fails_the_check_with_where_its_stub_hung(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stop_dump, "STUCK_AFTER_S", 3.0)
    log = tmp_path / "hang.log"
    with pytest.raises(pytest.fail.Exception) as failure:
        repository = tiny_repository(tmp_path / "repo", "hang")
        with serving(options(repository, exit_timeout_s=20), log, timeout_s=120) as server:
            ask(server)
    message = str(failure.value)
    assert "Exit timeout expired" in message and "failed to stop server" in message
    # Where it hung, from the stuck-stop watch: the model, its stub's threads, our finalize.
    assert "still loaded 3 s after SIGINT: tiny" in message
    assert "tiny's stub (pid " in message and "Thread " in message
    assert re.search(r"finalize \(.*model\.py:\d+\)", message), message
    assert "this test process's connections to its gRPC port: 0" in message
    assert log.with_suffix(".stuck-stop.txt").read_text().count("==== tiny: stub pid") == 1
    report = server.stop_report
    assert report is not None and report.exit_code != 0
    assert report.leftovers >= 1  # the hung stub, killed with the group


@pytest.mark.parametrize(
    ("on_finalize", "crashes"),
    [("keep_metrics", True), ("release_metrics_without_gc", True), ("release_metrics", False)],
)
def test_metrics_alive_at_stub_teardown_crash_it_and_releasing_them_in_finalize_does_not(
    tmp_path: Path, on_finalize: str, crashes: bool
) -> None:
    """Issue 17's ``Metric::SaveToSharedMemory <- Metric::Clear <- MetricFamily::~MetricFamily``."""
    server = TritonServer(options(tiny_repository(tmp_path / "repo", on_finalize)), tmp_path / "server.log")
    with server:
        server.wait_ready(timeout_s=120)
        ask(server)
    report = server.stop_report
    assert report is not None and not report.killed and report.exit_code == 0
    assert (unclean_stop(report) is not None) == crashes, report.describe()
    if crashes:
        assert "MetricFamily::~MetricFamily" in (tmp_path / "server.log").read_text()


def test_an_http_error_answer_leaves_no_connection_that_holds_up_the_stop(tmp_path: Path) -> None:
    """Triton 2.51 keeps counting a keep-alive connection that got an error from /generate, even
    once the client closed it, and a stop then waits out the exit timeout; HttpClient says
    ``Connection: close``."""
    log = tmp_path / "http.log"
    with serving(options(tiny_repository(tmp_path / "repo", "release_metrics"), 10), log, timeout_s=120) as server:
        client = HttpClient(server.http_url, "tiny")
        with pytest.raises(ClientError, match="missing required input"):
            client.generate("no such input")  # tiny takes "x", not text_input
        client.close()
    assert server.stop_report is not None and server.stop_report.clean


def running_requests(server: TritonServer) -> dict[str, float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    found = re.findall(r'^epd_(\w+)_running_requests\{model="\w+"\} (\S+)$', text, re.M)
    return {model: float(value) for model, value in found}


@pytest.mark.parametrize("attempt", range(3))
def test_cancelled_streams_relayed_over_bls_leave_nothing_that_holds_up_the_stop(tmp_path: Path, attempt: int) -> None:
    """A client cancels its stream with two relayed requests in flight. Before the fix, ``relay``
    stopped reading ``ticker``'s BLS response iterators; Triton 2.51's stub destroys leftover
    iterators at unload under a lock its messaging thread also needs, deadlocks, and ``relay``
    never unloads ("Exit timeout expired"). A race: with verbose logging it hit 6 of 6, then 6 of
    9 stops on a quiet machine, so three servers (~10 s each) make a regression near-certain to show."""
    options = ServerOptions(relay_repository(tmp_path / "repo"), Ports.free(), log_verbose=1, exit_timeout_s=10)
    with serving(options, tmp_path / "relay.log", timeout_s=120) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        count = grpcclient.InferInput("text_input", [1], "BYTES")
        count.set_data_from_numpy(np.array([b"400"], dtype=np.object_))  # 20 s of tokens each
        for _ in range(2):
            client.async_stream_infer("relay", [count], enable_empty_final_response=True)
        for _ in range(6):  # both are streaming
            _, error = responses.get(timeout=60)
            assert error is None, error
        client.stop_stream(cancel_requests=True)
        client.close()
        deadline = time.monotonic() + 30
        while running_requests(server) != {"relay": 0, "ticker": 0} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert running_requests(server) == {"relay": 0, "ticker": 0}
    assert server.stop_report is not None and server.stop_report.clean

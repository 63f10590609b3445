"""Unit tests of the small shared pieces: Triton edge, parameters, event loop, launcher, client."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from builders.tritonserver import Ports, ServerOptions, TritonServer, find_tritonserver
from client.epd_client import GenerateResult, chat_prompt
from python_backends.contract import GENERATE_OUTPUTS
from python_backends.engines.generation import GenerationChunk, chunk_from_outputs
from python_backends.engines.llm import load_engine_args
from python_backends.errors import EpdError, ErrorCode
from python_backends.runtime.event_loop import EventLoopThread
from python_backends.runtime.model_params import ModelParameters
from python_backends.triton_edge.decoupled import CancelWatch
from python_backends.triton_edge.metrics import ModelMetrics
from python_backends.triton_edge.responses import (
    chunk_response,
    error_response,
    read_inputs,
    stage_error_response,
    triton_error,
)
from tests.unit.conftest import FakeRequest


def test_our_errors_keep_code_and_message_others_hide_details():
    err = triton_error(EpdError("image[0] is empty", ErrorCode.INVALID_ARG))
    assert err.message() == "image[0] is empty" and err.code() == err.INVALID_ARG
    assert triton_error(EpdError("gone", ErrorCode.NOT_FOUND)).code() == err.NOT_FOUND
    hidden = triton_error(KeyError("/secret/path"))
    assert hidden.code() == err.INTERNAL and "secret" not in hidden.message()
    assert error_response(EpdError("x")).error.message() == "x"


def test_chunk_response_has_every_output_with_its_dtype():
    chunk = GenerationChunk("héllo", [5, 6], 10, 2, None, False)
    outputs = chunk_response(chunk).outputs()
    assert outputs["text_output"][0].decode() == "héllo"
    assert outputs["output_token_ids"].dtype == np.int64 and list(outputs["output_token_ids"]) == [5, 6]
    assert outputs["num_input_tokens"].dtype == np.uint32 and outputs["num_output_tokens"][0] == 2
    assert outputs["finish_reason"][0] == b""
    assert outputs["output_index"].dtype == np.uint32 and outputs["output_index"][0] == 0
    assert set(outputs) == {t.name for t in GENERATE_OUTPUTS}  # every one, every time: an ensemble waits for all
    assert outputs["logprobs"][0] == b"null" and outputs["prompt_logprobs"][0] == b"null"  # none asked


def test_logprobs_and_the_sequence_index_go_out_and_come_back():
    position = {
        "5": {"logprob": -0.5, "rank": 1, "decoded_token": "a"},
        "9": {"logprob": -2.0, "rank": 2, "decoded_token": "b"},
    }
    chunk = GenerationChunk(
        "a", [5], 3, 1, "stop", True, index=2, logprobs=[position], prompt_logprobs=[None, position]
    )
    outputs = chunk_response(chunk).outputs()
    back = chunk_from_outputs(outputs)
    assert (back.index, back.logprobs, back.prompt_logprobs) == (2, [position], [None, position])


def test_vllm_logprobs_become_the_wire_layout_with_minus_infinity_clamped():
    from types import SimpleNamespace

    from python_backends.engines.generation import MIN_LOGPROB, wire_logprobs

    entry = SimpleNamespace(logprob=float("-inf"), rank=7, decoded_token="x")
    assert wire_logprobs(None) is None
    assert wire_logprobs([None, {3: entry}]) == [None, {"3": {"logprob": MIN_LOGPROB, "rank": 7, "decoded_token": "x"}}]


def test_a_chunk_sends_what_its_model_declares_and_reads_back_the_same():
    prefill = GenerationChunk("a", [7], 12, 1, None, True, transfer_params='{"t": 1}')
    declared = {"output_token_ids", "text_output", "num_input_tokens", "finish_reason", "transfer_params"}
    outputs = chunk_response(prefill, declared).outputs()
    assert set(outputs) == declared
    back = chunk_from_outputs(outputs)
    assert (back.text, back.token_ids, back.num_input_tokens, back.transfer_params) == ("a", [7], 12, '{"t": 1}')
    assert not back.finished  # decode follows: no finish reason yet
    last = GenerationChunk("b", [8], 12, 3, "length", True, timings_ms={"decode": 1.5}, cache_hits=2, fast_hits=1)
    outputs = chunk_response(last).outputs()
    assert outputs["timing_decode_ms"].dtype == np.float32 and outputs["cache_hits"][0] == 2
    assert "transfer_params" not in outputs and "fast_hits" not in outputs
    back = chunk_from_outputs(outputs)
    assert back.finished and back.finish_reason == "length" and back.num_output_tokens == 3


def test_a_stage_error_is_an_output_for_bls_callers_and_a_triton_error_for_clients():
    from python_backends.triton_edge.responses import error_from_output

    as_output = stage_error_response(EpdError("gone", ErrorCode.NOT_FOUND), as_output=True)
    assert as_output.error is None
    error = error_from_output(as_output.outputs()["error"][0].decode())
    assert error.code is ErrorCode.NOT_FOUND and error.message == "gone"
    hidden = error_from_output(stage_error_response(KeyError("/secret"), True).outputs()["error"][0].decode())
    assert hidden.code is ErrorCode.INTERNAL and "secret" not in hidden.message
    direct = stage_error_response(EpdError("gone", ErrorCode.NOT_FOUND), as_output=False)
    assert direct.error.code() == direct.error.NOT_FOUND and direct.output_tensors == []


def test_read_inputs_skips_absent_tensors():
    request = FakeRequest(text_input=np.array([b"x"], dtype=np.object_))
    assert list(read_inputs(request, ["text_input", "image"])) == ["text_input"]


def test_model_parameters_are_checked_with_actionable_messages():
    params = ModelParameters.from_model_config(
        json.dumps(
            {
                "name": "llm",
                "parameters": {
                    "max_images": {"string_value": "x"},
                    "VLLM_A": {"string_value": "1"},
                    "on": {"string_value": "yes"},
                },
            }
        )
    )
    with pytest.raises(ValueError, match="model 'llm': parameter 'max_images' must be an integer"):
        params.integer("max_images", 4)
    assert params.integer("absent", 7) == 7
    assert params.boolean("on", False) is True
    assert params.vllm_environment() == {"VLLM_A": "1"}
    with pytest.raises(ValueError, match="is required"):
        params.string("missing")


def test_store_config_comes_from_the_cache_policy_parameters():
    values = {"store_path": "/dev/shm/x", "store_capacity_bytes": "4096", "store_eviction": "lru", "store_ttl_s": "0"}
    config = ModelParameters("epd", values).store_config()
    assert (config.path, config.capacity_bytes, config.eviction, config.ttl_s) == ("/dev/shm/x", 4096, "lru", None)
    assert ModelParameters("epd", {**values, "store_ttl_s": "2.5"}).store_config().ttl_s == 2.5
    with pytest.raises(ValueError, match="'store_ttl_s' must be >= 0"):
        ModelParameters("epd", {**values, "store_ttl_s": "-1"}).store_config()
    with pytest.raises(ValueError, match="must be a number"):
        ModelParameters("epd", {**values, "store_ttl_s": "soon"}).store_config()
    with pytest.raises(EpdError, match="eviction must be 'lru'"):
        ModelParameters("epd", {**values, "store_eviction": "fifo"}).store_config()


def test_event_loop_thread_runs_and_tracks_coroutines():
    loop = EventLoopThread()
    try:
        assert loop.run(asyncio.sleep(0, result=42)) == 42
        gate = asyncio.Event()

        async def wait_gate() -> str:
            await gate.wait()
            return "done"

        future = loop.submit(wait_gate())
        assert loop.pending == 1
        loop.loop.call_soon_threadsafe(gate.set)
        assert future.result(5) == "done"
        assert loop.pending == 0
    finally:
        loop.stop()


def test_engine_args_file_errors_say_what_to_do(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="builders.repository"):
        load_engine_args(tmp_path / "engine_args.json")
    (tmp_path / "engine_args.json").write_text(json.dumps({"model": str(tmp_path / "nope")}))
    with pytest.raises(FileNotFoundError, match="builders.default_model"):
        load_engine_args(tmp_path / "engine_args.json")


def test_pytriton_install_gets_a_stub_for_this_python_and_libpython_first(tmp_path: Path):
    install = find_tritonserver(tmp_path)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert (install.backend_dir / "python" / "triton_python_backend_stub").is_file(), version
    assert (install.backend_dir / "python" / "libtriton_python.so").is_file()
    import sysconfig

    assert install.env["LD_LIBRARY_PATH"].split(":")[0] == sysconfig.get_config_var("LIBDIR")
    server = TritonServer(ServerOptions(tmp_path, Ports(1, 2, 3)))
    command = server.command()
    assert "--http-port=1" in command and "--exit-on-error=true" in command


def test_client_chat_prompt_and_result_accumulation():
    prompt = chat_prompt("hi", 2)
    assert prompt.count("<|image_pad|>") == 2 and prompt.endswith("<|im_start|>assistant\n")
    result = GenerateResult()
    result.add({"text_output": np.array([b"a"], dtype=np.object_), "output_token_ids": np.array([1])})
    result.add(
        {
            "text_output": np.array(["b"], dtype=np.object_),
            "output_token_ids": np.array([2]),
            "finish_reason": np.array([b"stop"], dtype=np.object_),
        }
    )
    assert (result.text, result.token_ids, result.finish_reason) == ("ab", [1, 2], "stop")
    assert len(result.chunk_times) == 2


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_cli_says_how_to_start_a_server_that_is_down(protocol, capsys):
    from builders.tritonserver import free_port
    from client.cli import main

    assert main(["hi", "--protocol", protocol, "--url", f"127.0.0.1:{free_port()}"]) == 1
    assert "Is the server running? Start it with `make serve`" in capsys.readouterr().err


def test_model_metrics_share_one_family_per_name_and_label_the_model():
    metrics = ModelMetrics("prefill")
    a = metrics.live(metrics.counter("epd_bytes", "d", kind="reference").key)
    b = metrics.live(metrics.counter("epd_bytes", "d", kind="media").key)
    assert a.family is b.family  # Triton refuses a second family of the same name
    assert a.labels == {"model": "prefill", "kind": "reference"} and b.labels["kind"] == "media"
    gauge = metrics.live(metrics.gauge("epd_other", "d").key)
    assert gauge.family.kind == gauge.family.GAUGE and a.family.kind == a.family.COUNTER


def test_model_metrics_release_every_metric_then_every_family_and_handles_go_quiet():
    from tests.unit.conftest import _Metric, _MetricFamily

    metrics_before, families_before = _Metric.alive, _MetricFamily.alive
    metrics = ModelMetrics("decode")
    handle = metrics.gauge("epd_decode_unfinished_requests", "d")
    metrics.counter("epd_x", "d", kind="a").increment(2)
    handle.set(3)
    assert metrics.live(handle.key).value == 3
    assert (_Metric.alive, _MetricFamily.alive) == (metrics_before + 2, families_before + 2)
    metrics.release()  # the models' finalize: nothing of pb_utils' metrics outlives the stub
    assert (_Metric.alive, _MetricFamily.alive) == (metrics_before, families_before)
    handle.set(5)  # a late request after finalize does nothing
    assert metrics.live(handle.key) is None


def test_cancel_watch_asks_triton_at_most_once_per_interval():
    class Sender:
        calls = 0
        answer = False

        def is_cancelled(self):
            Sender.calls += 1
            return Sender.answer

    watch = CancelWatch(Sender(), interval_s=3600)
    assert [watch.cancelled() for _ in range(100)] == [False] * 100
    assert Sender.calls == 1  # the first token asks; the rest reuse the answer
    now = CancelWatch(Sender(), interval_s=0.0)
    Sender.answer = True
    assert now.cancelled() and now.cancelled() and Sender.calls == 2  # a cancel sticks, asked once
    # A request is taken as not cancelled when it arrives: one answered within the interval (a
    # decode poll) never asks.
    fresh = CancelWatch(Sender(), interval_s=3600, received_at=time.monotonic())
    assert not fresh.cancelled() and Sender.calls == 2


def test_event_loop_stop_lets_cancelled_tasks_finish_their_cleanup():
    loop = EventLoopThread()
    cleaned: list[str] = []

    async def request() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.05)  # e.g. abort the engine request, then end the stream
            cleaned.append("done")

    loop.submit(request())
    loop.stop()
    assert cleaned == ["done"]


def test_event_loop_stop_runs_last_on_the_loop_after_the_cleanups_and_what_it_schedules():
    """vLLM's AsyncLLM.shutdown closes its sockets with ``call_soon_threadsafe`` on its loop: run
    as ``last``, on the loop before it stops, that cleanup happens."""
    loop = EventLoopThread()
    events: list[str] = []

    async def request() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            events.append("request aborted")

    def shutdown() -> None:
        events.append(f"shutdown on the loop: {threading.current_thread() is loop._thread}")
        loop.loop.call_soon_threadsafe(events.append, "sockets closed")

    loop.submit(request())
    loop.stop(last=shutdown)
    assert events == ["request aborted", "shutdown on the loop: True", "sockets closed"]


def test_launcher_stops_on_the_first_signal_and_ignores_the_next(monkeypatch: pytest.MonkeyPatch):
    import signal

    from builders import launcher

    installed = {}
    monkeypatch.setattr(signal, "signal", lambda signum, handler: installed.setdefault(signum, handler))
    launcher.install_stop_handlers()
    handler = installed[signal.SIGINT]
    assert installed[signal.SIGTERM] is handler  # docker stop / systemd stop like Ctrl-C
    with pytest.raises(KeyboardInterrupt):
        handler(signal.SIGINT, None)
    handler(signal.SIGTERM, None)  # a second signal while stopping must not cut the stop short


def test_launcher_gives_a_server_its_own_store_and_kv_folder(tmp_path: Path):
    import dataclasses

    from builders.launcher import cache_policy, parse_args
    from builders.repository import TARGETS

    args = parse_args(["--cache-path", str(tmp_path / "store"), "--kv-store-path", str(tmp_path / "kv")])
    policy = cache_policy(args)
    assert policy == dataclasses.replace(TARGETS["cpu"].cache, path=str(tmp_path / "store"))
    assert args.kv_store_path == tmp_path / "kv"
    assert cache_policy(parse_args([])) is None  # no override: the target's policy as is
    scoped = cache_policy(parse_args(["--cache-path", "/x", "--cache-scope", "instance"]))
    assert (scoped.path, scoped.scope) == ("/x", "instance")


def test_engine_exit_grace_is_read_from_the_models_vllm_environment():
    from python_backends.engines.async_llm import ENGINE_EXIT_GRACE_ENV, engine_exit_grace_s

    assert engine_exit_grace_s({}) is None  # vLLM's own default (GPU targets)
    assert engine_exit_grace_s({ENGINE_EXIT_GRACE_ENV: "2"}) == 2.0
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ValueError, match=ENGINE_EXIT_GRACE_ENV):
            engine_exit_grace_s({ENGINE_EXIT_GRACE_ENV: bad})


def test_engine_start_method_is_checked_and_set_only_while_the_engine_starts(monkeypatch):
    from python_backends.engines.async_llm import ENGINE_START_ENV, _engine_start_method, engine_start_method

    assert engine_start_method({}) is None  # vLLM's own choice (the gpu target)
    assert engine_start_method({ENGINE_START_ENV: "fork"}) == "fork"
    with pytest.raises(ValueError, match=ENGINE_START_ENV):
        engine_start_method({ENGINE_START_ENV: "forkserver"})

    key = "VLLM_WORKER_MULTIPROC_METHOD"
    monkeypatch.delenv(key, raising=False)
    with _engine_start_method("fork"):
        assert os.environ[key] == "fork"
    assert key not in os.environ
    monkeypatch.setenv(key, "spawn")
    with pytest.raises(RuntimeError), _engine_start_method("fork"):
        raise RuntimeError("the engine did not start")
    assert os.environ[key] == "spawn"
    with _engine_start_method(None):
        assert os.environ[key] == "spawn"


def test_generate_result_summary_times_from_the_send() -> None:
    result = GenerateResult(started_at=10.0, chunk_times=[10.25, 10.5, 11.0], token_ids=[1, 2], cache_hits=1)
    result.timings_ms["encode"] = 3.0
    assert result.summary() == {
        "ttft_s": 0.25, "e2e_s": 1.0, "cache_hits": 1, "timings_ms": {"encode": 3.0}, "token_ids": [1, 2]
    }  # fmt: skip


def test_an_engine_shut_down_once_is_not_shut_down_again_when_it_goes(monkeypatch):
    """AsyncLLM.__del__ shuts down again; at a stub's exit that ran after vLLM's globals were gone
    (a TypeError traceback per engine in every server stop's log)."""
    import gc

    from vllm.v1.engine.async_llm import AsyncLLM

    from python_backends.engines.async_llm import ENGINE_EXIT_GRACE_ENV, shut_down_engine

    calls = []

    class RecordingLLM(AsyncLLM):  # the real class's __del__; no engine behind it
        def shutdown(self, timeout=None):
            calls.append(timeout)

    monkeypatch.setenv(ENGINE_EXIT_GRACE_ENV, "2")
    first, second = object.__new__(RecordingLLM), object.__new__(RecordingLLM)
    shut_down_engine(first)
    shut_down_engine(second)
    assert calls == [2.0, 2.0]
    assert isinstance(first, AsyncLLM) and type(first) is type(second)  # one subclass per class
    del first, second
    gc.collect()
    assert calls == [2.0, 2.0]  # not again
    unshut = object.__new__(RecordingLLM)
    del unshut
    gc.collect()
    assert calls == [2.0, 2.0, None]  # what __del__ does otherwise: the test can fail


def test_omp_parameters_are_engine_environment_and_set_this_processs_torch_threads(monkeypatch):
    """``OMP_*`` model parameters reach the engine core like ``VLLM_*`` ones, and the stub's own
    torch (vLLM's input processing) gets the thread count too (docs/benchmarks/omp-threads.md)."""
    import os

    import torch

    from builders.targets import TARGETS
    from python_backends.engines.llm import OMP_THREADS_ENV, apply_vllm_environment
    from python_backends.runtime.model_params import ModelParameters

    engine_env = {**TARGETS["cpu"].role_environment("llm"), OMP_THREADS_ENV: "1"}
    config = {"parameters": {key: {"string_value": v} for key, v in engine_env.items()}}
    environment = ModelParameters.from_model_config(config).vllm_environment()
    assert environment[OMP_THREADS_ENV] == "1" and environment["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"

    threads = torch.get_num_threads()
    monkeypatch.delenv(OMP_THREADS_ENV, raising=False)
    try:
        torch.set_num_threads(2)
        apply_vllm_environment({OMP_THREADS_ENV: "1"})
        assert os.environ[OMP_THREADS_ENV] == "1"  # for the engine core it spawns
        assert torch.get_num_threads() == 1  # this process's own torch (vLLM's input processing)
    finally:
        torch.set_num_threads(threads)

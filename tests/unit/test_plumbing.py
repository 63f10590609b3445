"""Unit tests of the small shared pieces: Triton edge, parameters, event loop, launcher, client."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from client.epd_client import GenerateResult, chat_prompt
from python_backends.errors import ErrorCode, EpdError
from python_backends.event_loop import EventLoopThread
from python_backends.llm_engine import GenerationChunk, load_engine_args
from python_backends.errors import EpdError
from python_backends.model_params import ModelParameters
from python_backends.triton_edge import ModelMetrics, chunk_response, error_response, read_inputs, triton_error
from builders.tritonserver import Ports, ServerOptions, TritonServer, find_tritonserver
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


def test_read_inputs_skips_absent_tensors():
    request = FakeRequest(text_input=np.array([b"x"], dtype=np.object_))
    assert list(read_inputs(request, ["text_input", "image"])) == ["text_input"]


def test_model_parameters_are_checked_with_actionable_messages():
    params = ModelParameters.from_model_config(
        json.dumps({"name": "llm", "parameters": {"max_images": {"string_value": "x"}, "VLLM_A": {"string_value": "1"}, "on": {"string_value": "yes"}}})
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
    result.add({"text_output": np.array(["b"], dtype=np.object_), "output_token_ids": np.array([2]),
                "finish_reason": np.array([b"stop"], dtype=np.object_)})
    assert (result.text, result.token_ids, result.finish_reason) == ("ab", [1, 2], "stop")
    assert len(result.chunk_times) == 2


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_cli_says_how_to_start_a_server_that_is_down(protocol, capsys):
    from client.cli import main
    from builders.tritonserver import free_port

    assert main(["hi", "--protocol", protocol, "--url", f"127.0.0.1:{free_port()}"]) == 1
    assert "Is the server running? Start it with `make serve`" in capsys.readouterr().err


def test_model_metrics_share_one_family_per_name_and_label_the_model():
    metrics = ModelMetrics("prefill")
    family_a, labels_a = metrics.counter("epd_bytes", "d", kind="reference")
    family_b, labels_b = metrics.counter("epd_bytes", "d", kind="media")
    assert family_a is family_b  # Triton refuses a second family of the same name
    assert labels_a == {"model": "prefill", "kind": "reference"} and labels_b["kind"] == "media"
    gauge_family, _ = metrics.gauge("epd_other", "d")
    assert gauge_family.kind == gauge_family.GAUGE and family_a.kind == family_a.COUNTER


def test_cancel_watch_asks_triton_at_most_once_per_interval():
    class Sender:
        calls = 0
        answer = False

        def is_cancelled(self):
            Sender.calls += 1
            return Sender.answer

    from python_backends.triton_edge import CancelWatch

    watch = CancelWatch(Sender(), interval_s=3600)
    assert [watch.cancelled() for _ in range(100)] == [False] * 100
    assert Sender.calls == 1  # the first token asks; the rest reuse the answer
    now = CancelWatch(Sender(), interval_s=0.0)
    Sender.answer = True
    assert now.cancelled() and now.cancelled() and Sender.calls == 2  # a cancel sticks, asked once

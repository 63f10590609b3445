"""The one error and cancel policy of every streaming model (triton_edge.decoupled), on a toy
model with a fake engine and the pb_utils stub."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time

import numpy as np

from python_backends.engines.generation import GenerationChunk
from python_backends.errors import EpdError, ErrorCode
from python_backends.triton_edge.decoupled import DecoupledModel
from tests.unit.conftest import FakeRequest, _Metric, _MetricFamily

FINAL = 1


class Sender:
    def __init__(self, cancel_after: int | None = None) -> None:
        self.sent: list[tuple[object, int]] = []
        self.cancel_after = cancel_after

    def send(self, response=None, flags: int = 0) -> None:
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.sent) >= self.cancel_after

    def wait_final(self, timeout_s: float = 5.0) -> list[tuple[object, int]]:
        deadline = time.monotonic() + timeout_s
        while not any(flags & FINAL for _, flags in self.sent) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # anything sent after the final would show now
        return self.sent


class Request(FakeRequest):
    def __init__(self, sender: Sender, **inputs: np.ndarray) -> None:
        super().__init__(**inputs)
        self.sender = sender

    def get_response_sender(self) -> Sender:
        return self.sender


class Engine:
    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.events: list[str] = []

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def shutdown(self) -> None:
        self.events.append("engine shutdown")


class Store:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def close(self) -> None:
        self.events.append("store closed")


class Toy(DecoupledModel):
    INPUTS = ("text_input", "stream")

    def setup(self, args):
        self.engine = Engine()
        self.store = Store(self.engine.events)
        self.served = self.metrics.counter("toy_served", "d")

    def parse(self, inputs, request):
        if "text_input" not in inputs:
            raise EpdError("input 'text_input' is required", ErrorCode.INVALID_ARG)
        return inputs["text_input"].reshape(-1)[0].decode()

    async def serve(self, parsed, request_id):
        if parsed == "boom":
            raise KeyError("/secret/path")
        for n in range(1, 4):
            if parsed == "hang" and n == 2:
                await asyncio.sleep(3600)
            if parsed == "slow":  # longer than CancelWatch's interval between tokens
                await asyncio.sleep(0.1)
            yield GenerationChunk("t", [n], 1, n, "length" if n == 3 else None, n == 3)
        self.served.increment()


def model() -> Toy:
    toy = Toy()
    toy.initialize({"model_name": "toy", "model_config": json.dumps({"name": "toy", "output": []})})
    return toy


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def run(toy: Toy, sender: Sender, **inputs: np.ndarray) -> list[tuple[object, int]]:
    toy.execute([Request(sender, **inputs)])
    return sender.wait_final()


def test_a_stream_ends_with_its_last_chunk_flagged_final():
    toy = model()
    sent = run(toy, Sender(), text_input=text("hi"))
    assert [flags for _, flags in sent] == [0, 0, FINAL]
    assert all(response.error is None for response, _ in sent) and toy.engine.aborted == []
    toy.finalize()


def test_a_parse_error_is_one_coded_error_and_starts_nothing():
    toy = model()
    background = toy.loop.pending  # the state gauges' task
    sent = run(toy, Sender())
    assert len(sent) == 1 and sent[0][1] == FINAL
    error = sent[0][0].error
    assert error.code() == error.INVALID_ARG and error.message() == "input 'text_input' is required"
    assert toy.loop.pending == background
    toy.finalize()


def test_a_failure_is_exactly_one_coded_error_without_details():
    toy = model()
    sent = run(toy, Sender(), text_input=text("boom"))
    assert len(sent) == 1 and sent[0][1] == FINAL
    error = sent[0][0].error
    assert error.code() == error.INTERNAL and error.message() == "internal error: KeyError"
    toy.finalize()


def test_a_bls_caller_gets_the_error_in_the_error_output():
    toy = model()
    sent = run(toy, Sender(), errors_as_outputs=np.array([True]))
    assert len(sent) == 1 and sent[0][0].error is None
    payload = json.loads(sent[0][0].outputs()["error"][0])
    assert payload == {"code": "INVALID_ARG", "message": "input 'text_input' is required"}
    toy.finalize()


def test_a_cancel_aborts_the_engine_request_and_ends_with_one_empty_final():
    toy = model()
    sender = Sender(cancel_after=1)  # the client goes away after the first chunk
    sent = run(toy, sender, text_input=text("slow"))
    assert [flags for _, flags in sent] == [0, FINAL] and sent[-1][0] is None
    assert len(toy.engine.aborted) == 1
    toy.finalize()


def test_cancel_running_and_finalize_end_a_running_request_like_a_cancel():
    toy = model()
    sender = Sender()
    toy.execute([Request(sender, text_input=text("hang"))])
    deadline = time.monotonic() + 5
    while not sender.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    (request_id,) = toy._running
    toy.cancel_running(request_id)
    assert [flags for _, flags in sender.wait_final()] == [0, FINAL] and toy.engine.aborted == [request_id]

    hanging = Sender()
    toy.execute([Request(hanging, text_input=text("hang"))])
    time.sleep(0.2)
    families, metrics = _MetricFamily.alive, _Metric.alive
    held = (len(toy.metrics._families), len(toy.metrics._metrics))  # its gauge and epd_toy_running_requests
    toy.finalize()
    # Cancelled and aborted, its leases released; nothing sent while Triton unloads the model.
    assert [flags for _, flags in hanging.sent] == [0] and len(toy.engine.aborted) == 2
    assert toy.engine.events == ["engine shutdown", "store closed"]
    assert (_MetricFamily.alive, _Metric.alive) == (families - held[0], metrics - held[1])  # released in finalize
    late = Sender()
    toy.execute([Request(late, text_input=text("hi"))])
    assert late.sent[0][0].error.code() == late.sent[0][0].error.UNAVAILABLE


class AbortableToy(Toy):
    INPUTS = ("text_input", "stream", "request_id", "abort")
    CLIENT_ABORT = True


def test_an_in_band_abort_stops_the_named_request_like_a_cancel_of_its_stream():
    toy = AbortableToy()
    toy.initialize({"model_name": "toy", "model_config": json.dumps({"name": "toy", "output": []})})
    stream = Sender()
    toy.execute([Request(stream, text_input=text("hang"), request_id=text("chat-1"))])
    deadline = time.monotonic() + 5
    while not stream.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(toy._running) == ["chat-1"]  # keyed by the client's name for it
    twice = run(toy, Sender(), text_input=text("hi"), request_id=text("chat-1"))
    error = twice[0][0].error
    assert error.code() == error.INVALID_ARG and "already running" in error.message()
    nameless = run(toy, Sender(), abort=np.array([True]))
    assert nameless[0][0].error.code() == nameless[0][0].error.INVALID_ARG
    control = run(toy, Sender(), abort=np.array([True]), request_id=text("chat-1"))
    assert control == [(None, FINAL)]  # the control request: one empty final
    # The stream it named ends as a cancelled one does: its engine request aborted, one empty final.
    assert [flags for _, flags in stream.wait_final()] == [0, FINAL] and len(toy.engine.aborted) == 1
    assert run(toy, Sender(), abort=np.array([True]), request_id=text("gone")) == [(None, FINAL)]  # nothing to stop
    toy.finalize()


class VllmToy(Toy):
    """A model whose engine ``start_engine`` started (a vLLM AsyncLLM in llm/prefill/decode/epd)."""

    def setup(self, args):
        super().setup(args)
        self._vllm_engine = self.engine
        events = self.engine.events
        loop = self.loop

        def shutdown() -> None:  # what AsyncLLM.shutdown does: close its sockets on its loop
            events.append(f"engine shutdown on the loop: {threading.current_thread() is loop._thread}")
            loop.loop.call_soon_threadsafe(events.append, "engine sockets closed")

        self.engine.shutdown = shutdown


def test_finalize_shuts_a_vllm_engine_down_on_its_loop_after_the_aborts_then_freezes_the_gc():
    toy = VllmToy()
    toy.initialize({"model_name": "toy", "model_config": json.dumps({"name": "toy", "output": []})})
    hanging = Sender()
    toy.execute([Request(hanging, text_input=text("hang"))])
    time.sleep(0.2)
    frozen = gc.get_freeze_count()
    try:
        toy.finalize()
        assert len(toy.engine.aborted) == 1  # the running request was aborted first
        assert toy.engine.events == ["engine shutdown on the loop: True", "engine sockets closed", "store closed"]
        assert gc.get_freeze_count() > frozen  # the stub's exit skips its full collection
    finally:
        gc.unfreeze()


def test_a_batched_model_answers_each_request_and_a_failed_batch_with_one_coded_error_each():
    from python_backends.triton_edge.batched import BatchedModel

    class Doubler(BatchedModel):
        INPUTS = ("x",)

        def setup(self, args):
            self.metrics.gauge("toy_loaded", "d").set(1)

        def run(self, batch):
            if len(batch) > 2:
                raise KeyError("/secret/path")
            return [EpdError("x < 0") if b["x"][0] < 0 else {"y": b["x"] * 2} for b in batch]

    toy = Doubler()
    metrics = _Metric.alive
    toy.initialize({"model_name": "doubler", "model_config": json.dumps({"name": "doubler"})})
    ok, bad = toy.execute([FakeRequest(x=np.array([2])), FakeRequest(x=np.array([-1]))])
    assert ok.error is None and ok.outputs()["y"].tolist() == [4]
    assert bad.error.code() == bad.error.INVALID_ARG and bad.error.message() == "x < 0"
    failed = toy.execute([FakeRequest(x=np.array([1]))] * 3)
    assert [r.error.message() for r in failed] == ["internal error: KeyError"] * 3
    toy.finalize()
    assert _Metric.alive == metrics


def test_running_requests_gauge_counts_requests_until_they_end_even_cancelled():
    toy = model()
    gauge = toy._running_gauge.key

    def running() -> float:
        toy.refresh_state()  # what the model's state task does every STATE_PERIOD_S
        return toy.metrics.live(gauge).value

    hanging = Sender()
    toy.execute([Request(hanging, text_input=text("hang"))])
    deadline = time.monotonic() + 5
    while not hanging.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert running() == 1
    (request_id,) = toy._running
    toy.cancel_running(request_id)
    hanging.wait_final()
    assert running() == 0
    run(toy, Sender(), text_input=text("hi"))
    assert running() == 0
    toy.finalize()


class ClientSender(Sender):
    """A client that cancels from outside (a test thread), like a closed gRPC stream."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = False

    def is_cancelled(self) -> bool:
        return self.cancelled


def paused_model(pauses: dict[str, float]) -> Toy:
    toy = Toy()
    config = {"name": "toy", "output": [], "parameters": {"test_pauses": {"string_value": json.dumps(pauses)}}}
    toy.initialize({"model_name": "toy", "model_config": json.dumps(config)})
    return toy


def wait_logged(line_part: str, timeout_s: float = 5.0) -> None:
    from tests.unit.conftest import _Logger

    deadline = time.monotonic() + timeout_s
    while not any(line_part in m for m in _Logger.messages):
        assert time.monotonic() < deadline, f"never logged {line_part!r}"
        time.sleep(0.01)


def test_a_request_cancelled_before_it_starts_is_never_served():
    toy = paused_model({"start": 0.3})
    sender = ClientSender()
    toy.execute([Request(sender, text_input=text("hi"))])
    (request_id,) = toy._running
    wait_logged(f"test pause: toy start {request_id}")
    sender.cancelled = True  # while it waits at the start pause
    assert [flags for _, flags in sender.wait_final()] == [FINAL]  # one empty final, no token
    assert toy.engine.aborted == [request_id]  # nothing ran; the abort is a no-op for the engine
    toy.finalize()


def test_a_pause_after_a_response_parks_the_request_there_and_a_cancel_ends_it():
    toy = paused_model({"after_1": 0.3})
    sender = ClientSender()
    toy.execute([Request(sender, text_input=text("hi"))])
    (request_id,) = toy._running
    wait_logged(f"test pause: toy after_1 {request_id} 0.3s")
    assert [flags for _, flags in sender.sent] == [0]  # parked after its first response
    sender.cancelled = True
    assert [flags for _, flags in sender.wait_final()] == [0, FINAL]
    assert toy.engine.aborted == [request_id]
    toy.finalize()


def test_without_test_pauses_nothing_waits_or_logs_a_pause():
    from tests.unit.conftest import _Logger

    before = len(_Logger.messages)
    sent = run(model(), Sender(), text_input=text("hi"))
    assert [flags for _, flags in sent] == [0, 0, FINAL]
    assert not any("test pause" in m for m in _Logger.messages[before:])

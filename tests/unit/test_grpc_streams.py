"""client/grpc_streams.py: every stream ends by one rule -- read to the server's close; a request
given up on gets the in-band abort and is drained; the hard cancel comes only after the grace
(fake calls; the leak it avoids is shown on a real server by ``python -m tests.stress.cancel_storm``,
docs/benchmarks/cancel-storm.md)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

from client.grpc_streams import CANCELLED, CLOSED, InBandAbort, StreamEnds, end_stream, end_sync_stream


class FakeCall:
    """A stream_infer call: ``left`` more responses ``gap_s`` apart, then the server closes it (or
    never does); ``loop.time()`` of the cancel, if any."""

    def __init__(self, left: int, closes: bool = True, fails: bool = False, gap_s: float = 0.0) -> None:
        self.left, self.closes, self.fails, self.gap_s = left, closes, fails, gap_s
        self.read = 0
        self.cancelled_at: float | None = None
        self.closed = asyncio.Event()

    @property
    def cancelled(self) -> bool:
        return self.cancelled_at is not None

    def __aiter__(self) -> FakeCall:
        return self

    async def __anext__(self) -> tuple[None, None]:
        if self.left:
            await asyncio.sleep(self.gap_s)
            self.left -= 1
            self.read += 1
            return None, None
        if self.fails:
            raise RuntimeError("closed with status CANCELLED")
        if not self.closes:
            await self.closed.wait()  # only a cancel ends it
        raise StopAsyncIteration

    def cancel(self) -> bool:
        self.cancelled_at = asyncio.get_running_loop().time()
        self.closed.set()
        return True


def test_a_finished_stream_is_read_until_the_server_closes_it_never_cancelled() -> None:
    call = FakeCall(left=2)
    assert asyncio.run(end_stream(call, finished=True)) == CLOSED
    assert (call.read, call.cancelled) == (2, False)


def test_a_given_up_stream_that_closes_within_the_grace_is_drained_not_cancelled() -> None:
    call = FakeCall(left=5, gap_s=0.01)
    assert asyncio.run(end_stream(call, finished=False, grace_s=2.0)) == CLOSED
    assert (call.read, call.cancelled) == (5, False)


def test_the_hard_cancel_comes_only_after_the_grace() -> None:
    async def run() -> tuple[float, float]:
        call = FakeCall(left=0, closes=False)
        gave_up = asyncio.get_running_loop().time()
        assert await end_stream(call, finished=False, grace_s=0.3) == CANCELLED
        assert call.cancelled_at is not None
        return gave_up, call.cancelled_at

    gave_up, cancelled_at = asyncio.run(run())
    assert 0.3 <= cancelled_at - gave_up < 1.0


def test_a_finished_stream_the_server_never_closes_is_cancelled_after_the_close_timeout() -> None:
    call = FakeCall(left=0, closes=False)
    assert asyncio.run(end_stream(call, finished=True, close_timeout_s=0.05)) == CANCELLED


def test_a_stream_closed_with_an_error_status_is_over() -> None:
    call = FakeCall(left=1, fails=True)
    assert asyncio.run(end_stream(call, finished=True)) == CLOSED
    assert (call.read, call.cancelled) == (1, False)


def test_the_in_band_abort_goes_first_and_its_stream_closes_the_request() -> None:
    events: list[str] = []

    async def run() -> str:
        call = FakeCall(left=0, closes=False)

        async def abort() -> None:  # the model stops the request: its stream closes
            events.append("abort")
            call.closed.set()

        return await end_stream(call, finished=False, abort=abort, grace_s=5.0)

    assert asyncio.run(run()) == CLOSED
    assert events == ["abort"]


def test_an_abort_that_fails_or_hangs_still_ends_in_the_hard_cancel_at_the_grace() -> None:
    async def failing() -> None:
        raise ConnectionError("refused")

    async def hanging() -> None:
        await asyncio.sleep(3600)

    for abort in (failing, hanging):
        call = FakeCall(left=0, closes=False)
        started = time.monotonic()
        assert asyncio.run(end_stream(call, finished=False, abort=abort, grace_s=0.2)) == CANCELLED
        assert 0.2 <= time.monotonic() - started < 1.0


def test_a_caller_cancelled_while_its_stream_ends_does_not_cut_the_drain_short() -> None:
    """The OpenAI frontend's case: the HTTP client left, anyio cancels the handler again at every
    await; the stream is still drained (in its own task) and closes without a cancel."""

    async def run() -> tuple[FakeCall, StreamEnds]:
        ends = StreamEnds(grace_s=2.0)
        call = FakeCall(left=3, gap_s=0.05)

        async def caller() -> None:
            await ends.close_stream(call, finished=True)

        task = asyncio.create_task(caller())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await ends.wait()
        return call, ends

    call, ends = asyncio.run(run())
    assert (call.read, call.cancelled, ends.ended) == (3, False, {CLOSED: 1, CANCELLED: 0})


def test_an_abandoned_stream_drains_in_the_background_and_wait_cancels_what_outlives_it() -> None:
    async def run() -> tuple[FakeCall, float, StreamEnds]:
        ends = StreamEnds(grace_s=60.0)
        call = FakeCall(left=0, closes=False)
        started = time.monotonic()
        await ends.close_stream(call, finished=False)  # returns at once
        returned = time.monotonic() - started
        assert ends.pending == 1 and not call.cancelled
        await ends.wait(timeout_s=0.1)
        return call, returned, ends

    call, returned, ends = asyncio.run(run())
    assert returned < 0.05 and call.cancelled and ends.pending == 0


class FakeInferInput:
    def __init__(self, name: str, shape: list[int], datatype: str) -> None:
        self.name, self.shape, self.datatype, self.value = name, shape, datatype, None

    def set_data_from_numpy(self, array: np.ndarray) -> None:
        self.value = array.reshape(-1)[0]


class FakeGrpcModule:
    InferInput = FakeInferInput


class FakeAioClient:
    """Two models: ``decode`` takes the in-band abort, ``llm`` does not."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.config_calls = 0

    async def get_model_metadata(self, model: str, as_json: bool, client_timeout: float) -> dict[str, Any]:
        self.config_calls += 1
        names = ["text_input", *(("request_id", "abort") if model == "decode" else ())]
        return {"name": model, "inputs": [{"name": n} for n in names]}

    def stream_infer(self, requests: Any) -> FakeCall:
        async def take() -> None:
            self.sent.extend([r async for r in requests])

        asyncio.ensure_future(take())
        return FakeCall(left=1)


def test_in_band_abort_is_used_only_where_the_model_declares_it_and_sends_the_control_request() -> None:
    async def run() -> tuple[list[bool], FakeAioClient]:
        client = FakeAioClient()
        aborts = InBandAbort(client, FakeGrpcModule)
        found = [await aborts.supported("llm"), await aborts.supported("decode"), await aborts.supported("decode")]
        await aborts.for_request("decode", "req-7", StreamEnds())()
        await asyncio.sleep(0)
        return found, client

    found, client = asyncio.run(run())
    assert found == [False, True, True] and client.config_calls == 2
    (control,) = client.sent
    values = {item.name: item.value for item in control["inputs"]}
    assert control["model_name"] == "decode" and values == {"request_id": b"req-7", "abort": True}


class FakeSyncClient:
    """tritonclient.grpc's InferenceServerClient: ``stop_stream()`` blocks until the server closes
    the stream (``closes_after_s``; None: never, only a cancel ends it)."""

    def __init__(self, closes_after_s: float | None) -> None:
        self.closes_after_s = closes_after_s
        self.closed = threading.Event()
        self.cancelled_at: float | None = None

    def stop_stream(self, cancel_requests: bool = False) -> None:
        if cancel_requests:
            self.cancelled_at = time.monotonic()
            self.closed.set()
            return
        self.closed.wait(self.closes_after_s)
        self.closed.set()


def test_the_sync_client_waits_for_the_close_and_cancels_only_after_the_grace() -> None:
    closing = FakeSyncClient(closes_after_s=0.05)
    assert end_sync_stream(closing, finished=False, grace_s=2.0) == CLOSED
    assert closing.cancelled_at is None

    stuck = FakeSyncClient(closes_after_s=None)
    started = time.monotonic()
    assert end_sync_stream(stuck, finished=False, grace_s=0.3) == CANCELLED
    assert stuck.cancelled_at is not None and 0.3 <= stuck.cancelled_at - started < 1.0

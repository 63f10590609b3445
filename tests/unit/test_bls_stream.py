"""BlsCaller._stream and _answers read a stage's BLS response iterator to its final response even when its
caller stops listening (issue 19: half-read iterators deadlock Triton 2.51's stub at unload),
never from two threads at once, and lets go of a finished one only after the stub did."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from typing import Any

import numpy as np
import pytest
import triton_python_backend_utils as pb_utils

from python_backends.triton_edge.bls import RETIRE_S, BlsCaller
from tests.unit.bls_fakes import FakeOutput


class Response:
    def __init__(self, index: int | None) -> None:  # None: the empty final response
        self.outputs = [] if index is None else [FakeOutput("output_token_ids", np.array([index]))]

    def has_error(self) -> bool:
        return False

    def output_tensors(self) -> list[FakeOutput]:
        return self.outputs


class Stage:
    """A decoupled stage's BLS response iterator: ``count`` responses, ``delay_s`` apart, then the
    empty final. Counts how many threads read it at once (the stub's iterator is not thread-safe)."""

    def __init__(self, count: int, delay_s: float = 0.0, open_delay_s: float = 0.0) -> None:
        self.count = count
        self.delay_s = delay_s
        self.open_delay_s = open_delay_s  # how long ``exec`` takes to send the request
        self.read = 0
        self.finished = threading.Event()
        self.readers = 0
        self.most_readers = 0
        self._lock = threading.Lock()

    def exec(self, decoupled: bool = False) -> Any:
        assert decoupled
        time.sleep(self.open_delay_s)
        self.opened = Iterator(self)
        return self.opened


class Iterator:
    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.index = 0

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Response:
        stage = self.stage
        with stage._lock:
            stage.readers += 1
            stage.most_readers = max(stage.most_readers, stage.readers)
        try:
            time.sleep(stage.delay_s)
            if self.index > stage.count:
                raise StopIteration
            self.index += 1
            if self.index > stage.count:
                stage.finished.set()
                return Response(None)
            stage.read += 1
            return Response(self.index - 1)
        finally:
            with stage._lock:
                stage.readers -= 1


def bls_request_to(stage: Stage, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pb_utils, "InferenceRequest", lambda **kwargs: stage, raising=False)


def test_every_response_is_yielded_then_the_stream_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Stage(5)
    bls_request_to(stage, monkeypatch)
    caller = BlsCaller()

    async def read_all() -> list[int]:
        return [int(out["output_token_ids"][0]) async for out in caller._stream("decode", [])]

    assert asyncio.run(read_all()) == [0, 1, 2, 3, 4]
    assert caller.open_streams == 0
    caller.shutdown()


def test_a_caller_that_stops_listening_still_has_the_iterator_read_to_its_final_response(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stage = Stage(200)
    bls_request_to(stage, monkeypatch)
    caller = BlsCaller()

    async def listen_to_two() -> None:
        stream = caller._stream("decode", [])
        async for out in stream:
            if int(out["output_token_ids"][0]) == 1:
                break
        await stream.aclose()  # the client cancelled: epd closes its decode stream

    asyncio.run(listen_to_two())
    assert stage.finished.wait(timeout=10), f"the iterator was left after {stage.read} of 200 responses"
    assert stage.read == 200
    caller.shutdown()


def test_a_caller_cancelled_while_a_read_is_in_flight_leaves_the_reading_to_one_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stage = Stage(20, delay_s=0.05)
    bls_request_to(stage, monkeypatch)
    caller = BlsCaller()

    async def cancel_mid_read() -> None:
        first = asyncio.Event()

        async def listen() -> None:
            async for _ in caller._stream("decode", []):
                first.set()

        task = asyncio.create_task(listen())
        await first.wait()
        await asyncio.sleep(0.02)  # the next read is in flight on a pool thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_mid_read())
    assert stage.finished.wait(timeout=10), f"the iterator was left after {stage.read} of 20 responses"
    assert stage.read == 20
    assert stage.most_readers == 1
    assert closed(caller)
    caller.shutdown()


def test_a_caller_cancelled_while_the_request_is_being_sent_still_has_its_iterator_read_to_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gap the count found: a cancel during ``exec`` used to drop the iterator unread."""
    stage = Stage(20, open_delay_s=0.3)
    bls_request_to(stage, monkeypatch)
    caller = BlsCaller()

    async def cancel_while_opening() -> None:
        async def listen() -> None:
            async for _ in caller._stream("decode", []):
                pass

        task = asyncio.create_task(listen())
        await asyncio.sleep(0.1)  # exec runs on a pool thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_while_opening())
    assert stage.finished.wait(timeout=10), f"the iterator was left after {stage.read} of 20 responses"
    assert closed(caller)
    caller.shutdown()


def test_a_one_answer_call_is_sent_and_read_to_its_final_response_by_one_pool_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_answers`` (every poll of ``decode``): one thread hop per call, not one per response."""
    stage = Stage(3)
    bls_request_to(stage, monkeypatch)
    caller = BlsCaller()
    threads: set[int] = set()
    read_whole = caller._read_whole

    def counted(request: Any) -> list[Any]:
        threads.add(threading.get_ident())
        return read_whole(request)

    monkeypatch.setattr(caller, "_read_whole", counted)
    answers = asyncio.run(caller._answers("decode", []))
    assert [int(out["output_token_ids"][0]) for out in answers] == [0, 1, 2]
    assert len(threads) == 1 and threading.get_ident() not in threads
    assert caller.open_streams == 0
    caller.shutdown()


def test_a_one_answer_call_whose_caller_is_cancelled_is_still_read_to_its_final_response(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stage = Stage(10, delay_s=0.05)
    bls_request_to(stage, monkeypatch)
    caller = BlsCaller()

    async def cancel_mid_call() -> None:
        task = asyncio.create_task(caller._answers("decode", []))
        await asyncio.sleep(0.12)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_mid_call())
    assert stage.finished.wait(timeout=10), f"the iterator was left after {stage.read} of 10 responses"
    assert closed(caller)
    caller.shutdown()


def closed(caller: BlsCaller, timeout_s: float = 10.0) -> bool:
    """Whether every stream of ``caller`` reached its final response within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while caller.open_streams and time.monotonic() < deadline:
        time.sleep(0.01)
    return caller.open_streams == 0


def test_a_finished_iterator_is_kept_until_the_stub_has_let_go_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python must hold the last reference to a finished iterator (``BlsCaller._retire``): it is
    kept for RETIRE_S after its final response, then dropped when a later stream finishes."""
    now = [0.0]
    caller = BlsCaller(clock=lambda: now[0])
    stages: list[Stage] = []
    monkeypatch.setattr(pb_utils, "InferenceRequest", lambda **kwargs: stages[-1], raising=False)

    def stream_at(t: float) -> weakref.ref[Iterator]:
        now[0] = t
        stages.append(Stage(2))

        async def read_all() -> None:
            async for _ in caller._stream("decode", []):
                pass

        asyncio.run(read_all())
        finished = weakref.ref(stages.pop().opened)
        gc.collect()
        return finished

    first = stream_at(0.0)
    assert first() is not None  # kept: the stub's own reference may still be there
    second = stream_at(RETIRE_S - 1)
    assert first() is not None and second() is not None
    third = stream_at(RETIRE_S + 0.5)
    assert first() is None  # older than RETIRE_S: let go, on a thread that holds the GIL
    assert second() is not None and third() is not None
    caller.shutdown()

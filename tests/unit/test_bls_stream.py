"""BlsCaller._stream reads a stage's BLS response iterator to its final response even when its
caller stops listening (issue 17: half-read iterators deadlock Triton 2.51's stub at unload)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest
import triton_python_backend_utils as pb_utils

from python_backends.triton_edge.bls import BlsCaller


class Output:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def is_cpu(self) -> bool:
        return True

    def as_numpy(self) -> np.ndarray:
        return self._array


class Response:
    def __init__(self, index: int | None) -> None:  # None: the empty final response
        self.outputs = [] if index is None else [Output("output_token_ids", np.array([index]))]

    def has_error(self) -> bool:
        return False

    def output_tensors(self) -> list[Output]:
        return self.outputs


class Stage:
    """A decoupled stage's BLS response iterator: ``count`` responses, then the empty final."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.read = 0
        self.finished = threading.Event()

    def exec(self, decoupled: bool = False) -> Any:
        assert decoupled
        for index in range(self.count):
            self.read += 1
            yield Response(index)
        yield Response(None)
        self.finished.set()


def bls_request_to(stage: Stage, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pb_utils, "InferenceRequest", lambda **kwargs: stage, raising=False)


def test_every_response_is_yielded_then_the_stream_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Stage(5)
    bls_request_to(stage, monkeypatch)
    caller = BlsCaller()

    async def read_all() -> list[int]:
        return [int(out["output_token_ids"][0]) async for out in caller._stream("decode", [])]

    assert asyncio.run(read_all()) == [0, 1, 2, 3, 4]
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

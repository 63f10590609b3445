"""client/grpc_streams.py: a finished stream is read to its end by the server's close, an abandoned
one is cancelled (fake calls; the leak it avoids is shown on a real server by
``python -m tests.stress.cancel_storm --loads cancel_after_final``, docs/benchmarks/cancel-storm.md)."""

from __future__ import annotations

import asyncio

from client.grpc_streams import end_stream


class FakeCall:
    """A stream_infer call: ``left`` more responses, then the server closes it (or never does)."""

    def __init__(self, left: int, closes: bool = True, fails: bool = False) -> None:
        self.left, self.closes, self.fails = left, closes, fails
        self.read = 0
        self.cancelled = False

    def __aiter__(self) -> FakeCall:
        return self

    async def __anext__(self) -> tuple[None, None]:
        if self.left:
            self.left -= 1
            self.read += 1
            return None, None
        if self.fails:
            raise RuntimeError("closed with status CANCELLED")
        if not self.closes:
            await asyncio.sleep(3600)
        raise StopAsyncIteration

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_a_finished_stream_is_read_until_the_server_closes_it_never_cancelled() -> None:
    call = FakeCall(left=2)
    asyncio.run(end_stream(call, finished=True))
    assert (call.read, call.cancelled) == (2, False)


def test_a_request_the_caller_gives_up_on_is_cancelled_at_once() -> None:
    call = FakeCall(left=5)
    asyncio.run(end_stream(call, finished=False))
    assert (call.read, call.cancelled) == (0, True)


def test_a_finished_stream_the_server_never_closes_is_cancelled_after_the_timeout() -> None:
    call = FakeCall(left=0, closes=False)
    asyncio.run(end_stream(call, finished=True, timeout_s=0.05))
    assert call.cancelled


def test_a_stream_closed_with_an_error_status_is_over() -> None:
    call = FakeCall(left=1, fails=True)
    asyncio.run(end_stream(call, finished=True))
    assert call.read == 1

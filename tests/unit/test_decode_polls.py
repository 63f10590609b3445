"""decode answered by polls (python_backends/pd/polling.py): one merged answer per call, by offset."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from python_backends.engines.generation import GenerationChunk
from python_backends.errors import EpdError, ErrorCode
from python_backends.pd.polling import PolledGenerations, merged


def chunk(text: str, token: int, finished: bool = False) -> GenerationChunk:
    return GenerationChunk(
        text=text, token_ids=[token], num_output_tokens=token, finish_reason="stop" if finished else None,
        finished=finished,
    )


class Engine:
    """Deltas released one by one by the test (``release``), then finished; records aborts."""

    def __init__(self, count: int = 3, fail_after: int | None = None) -> None:
        self.count, self.fail_after = count, fail_after
        self.gate: asyncio.Queue[None] = asyncio.Queue()
        self.aborted: list[str] = []
        self.closed = False

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self.gate.put_nowait(None)

    async def chunks(self) -> AsyncIterator[GenerationChunk]:
        try:
            for i in range(1, self.count + 1):
                await self.gate.get()
                if self.fail_after is not None and i > self.fail_after:
                    raise EpdError("the KV transfer was not used", ErrorCode.INTERNAL)
                yield chunk(f"t{i}", i, finished=i == self.count)
        finally:
            self.closed = True

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def run(coro):
    return asyncio.run(coro)


def test_merged_joins_deltas_and_keeps_the_last_finish():
    both = merged([chunk("a", 1), chunk("b", 2, finished=True)])
    assert (both.text, both.token_ids, both.num_output_tokens, both.finished) == ("ab", [1, 2], 2, True)
    assert merged([]).text == "" and not merged([]).finished


def test_a_poll_answers_every_chunk_since_its_offset_once():
    async def scenario():
        engine = Engine(count=3)
        polls = PolledGenerations(engine.abort, wait_s=0.05)
        polls.start("r", engine.chunks())
        empty, offset = await polls.poll("r", 0)  # nothing yet: the wait runs out, offset stays
        assert (empty.text, empty.finished, offset) == ("", False, 0)
        engine.release(2)
        await asyncio.sleep(0.01)
        first, offset = await polls.poll("r", 0)
        assert (first.text, first.token_ids, offset) == ("t1t2", [1, 2], 2)
        again, same = await polls.poll("r", 1)  # the caller may ask again from an offset it had
        assert (again.text, same) == ("t2", 2)
        waiter = asyncio.create_task(polls.poll("r", 2))  # waits for the next chunk, not the timeout
        await asyncio.sleep(0.005)
        engine.release()
        last, offset = await waiter
        assert (last.text, last.finished, last.finish_reason, offset) == ("t3", True, "stop", 3)
        assert len(polls) == 0 and engine.closed  # delivered to the end: nothing kept
        with pytest.raises(EpdError) as info:
            await polls.poll("r", 3)
        assert info.value.code is ErrorCode.NOT_FOUND

    run(scenario())


def test_with_a_stream_interval_a_poll_waits_for_that_many_tokens_or_the_end():
    async def scenario():
        engine = Engine(count=3)
        polls = PolledGenerations(engine.abort, wait_s=5.0, stream_interval=2)
        polls.start("r", engine.chunks())
        waiter = asyncio.create_task(polls.poll("r", 0))
        engine.release()
        await asyncio.sleep(0.02)
        assert not waiter.done()  # one token is there: it waits for the second
        engine.release()
        pair, offset = await waiter
        assert (pair.token_ids, offset) == ([1, 2], 2)
        waiter = asyncio.create_task(polls.poll("r", 2))
        engine.release()  # the last token: the generation ends with one
        last, offset = await asyncio.wait_for(waiter, 1.0)
        assert (last.token_ids, last.finished, offset) == ([3], True, 3)

    run(scenario())


def test_with_a_stream_interval_a_poll_still_answers_within_its_wait():
    async def scenario():
        engine = Engine(count=3)
        polls = PolledGenerations(engine.abort, wait_s=0.05, stream_interval=4)
        polls.start("r", engine.chunks())
        engine.release()
        await asyncio.sleep(0.01)
        short, offset = await polls.poll("r", 0)  # fewer than 4 tokens, but the wait ran out
        assert (short.token_ids, offset) == ([1], 1)
        await polls.cancel("r")

    run(scenario())
    with pytest.raises(ValueError):
        PolledGenerations(Engine().abort, stream_interval=0)


def test_an_offset_outside_the_kept_chunks_is_invalid():
    async def scenario():
        engine = Engine(count=3)
        polls = PolledGenerations(engine.abort, wait_s=0.01)
        polls.start("r", engine.chunks())
        engine.release(2)
        await asyncio.sleep(0.01)
        await polls.poll("r", 2)
        for offset in (1, 3):  # 1: dropped already; 3: not made yet
            with pytest.raises(EpdError) as info:
                await polls.poll("r", offset)
            assert info.value.code is ErrorCode.INVALID_ARG
        with pytest.raises(EpdError, match="already running"):
            polls.start("r", engine.chunks())
        await polls.cancel("r")

    run(scenario())


def test_an_engine_error_reaches_the_poll_after_the_chunks_made_before_it():
    async def scenario():
        engine = Engine(count=3, fail_after=1)
        polls = PolledGenerations(engine.abort, wait_s=0.05)
        polls.start("r", engine.chunks())
        engine.release(2)
        await asyncio.sleep(0.01)
        made, offset = await polls.poll("r", 0)
        assert (made.text, offset) == ("t1", 1)
        with pytest.raises(EpdError, match="KV transfer was not used"):
            await polls.poll("r", offset)
        assert len(polls) == 0

    run(scenario())


def test_cancel_and_idle_reap_abort_the_engine_request():
    async def scenario():
        now = [0.0]
        engine = Engine(count=5)
        polls = PolledGenerations(engine.abort, wait_s=0.01, idle_abort_s=30.0, clock=lambda: now[0])
        polls.start("kept", engine.chunks())
        polls.start("gone", Engine(count=5).chunks())
        now[0] = 20.0
        await polls.poll("kept", 0)  # polled at 20 s
        now[0] = 31.0
        assert await polls.reap() == ["gone"]  # nobody polled it for 31 s
        assert engine.aborted == ["gone"] and not engine.closed and len(polls) == 1
        await polls.cancel("kept")
        assert engine.aborted == ["gone", "kept"] and engine.closed and len(polls) == 0
        await polls.cancel("kept")  # twice: nothing more
        assert engine.aborted == ["gone", "kept"]

    run(scenario())


def test_stopping_the_reaper_stops_every_generation():
    async def scenario():
        engine = Engine(count=5)
        polls = PolledGenerations(engine.abort, wait_s=0.01)
        polls.start("r", engine.chunks())
        reaper = asyncio.create_task(polls.reap_every(0.01))
        await asyncio.sleep(0.03)
        reaper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reaper
        assert engine.aborted == ["r"] and len(polls) == 0

    run(scenario())

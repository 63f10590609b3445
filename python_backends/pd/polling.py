"""``decode`` answered by polls: one response per call, so a BLS caller never reads a stream.

Why: in Triton 2.51's python backend (its main branch too) a stub can deadlock when a BLS reader
waits in a response iterator's ``next()`` and more responses of that iterator arrive: the lock
cycle is written up in docs/upstream/python-backend-bls-deadlock.md. A stage that answers every
call with exactly one response, sent with FINAL in the same ``send()``, never gives the stub's
message thread a second response for an iterator, so the cycle cannot close. ``decode`` makes
tokens over time; called this way it keeps each request's chunks here and hands them out by
offset:

- the first call starts the generation (the engine's chunks are appended here as they come) and
  is answered like a poll from offset 0;
- a poll from offset k answers, as one merged chunk, every chunk after k and the next offset,
  once they hold ``stream_interval`` tokens or the generation ended (waiting up to ``wait_s``;
  then it answers what there is, maybe nothing); the chunks before k are dropped (the caller has
  them). ``stream_interval`` is vLLM's trade-off of the same name: every answer is one more
  Triton request, so 2 tokens per poll halve the requests for a burstier stream
  (docs/benchmarks/bls-deadlock.md measures it);
- the caller polls again from that offset until a chunk says finished;
- a generation that nobody polls for ``idle_abort_s`` is aborted: its caller is gone.

Who calls what: the ``decode`` model (``model_repository/decode/1/model.py``) on its event loop:
:meth:`start`, :meth:`poll`, :meth:`cancel` (its ``abort`` control request) and, submitted once,
:meth:`reap_every`, which also ends every generation when the loop stops. Triton-free.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from typing import Any

from python_backends.engines.generation import GenerationChunk
from python_backends.errors import EpdError, ErrorCode, invalid_arg

WAIT_S = 0.25  # a poll returns as soon as its tokens are there: this only bounds one call
IDLE_ABORT_S = 30.0


def merged(chunks: Sequence[GenerationChunk]) -> GenerationChunk:
    """The chunks (deltas, in order) as one: their text, token ids and logprobs joined, the last one's
    counts and finish; an empty chunk when there are none."""
    if not chunks:
        return GenerationChunk(text="", token_ids=[])
    last = chunks[-1]
    return GenerationChunk(
        text="".join(chunk.text for chunk in chunks),
        token_ids=[token for chunk in chunks for token in chunk.token_ids],
        num_input_tokens=last.num_input_tokens,
        num_output_tokens=last.num_output_tokens,
        finish_reason=last.finish_reason,
        finished=last.finished,
        num_cached_tokens=chunks[0].num_cached_tokens,
        logprobs=None if last.logprobs is None else [p for chunk in chunks for p in chunk.logprobs or []],
    )


@dataclass
class _Generation:
    polled_at: float
    chunks: list[GenerationChunk] = field(default_factory=list)  # not yet handed out
    base: int = 0  # the offset of chunks[0]
    done: bool = False
    error: BaseException | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class PolledGenerations:
    def __init__(
        self,
        abort: Callable[[str], Awaitable[None]],
        wait_s: float = WAIT_S,
        idle_abort_s: float = IDLE_ABORT_S,
        clock: Callable[[], float] = time.monotonic,
        stream_interval: int = 1,
    ) -> None:
        """``abort``: stops the engine's request of an id (``DecodeEngine.abort``);
        ``stream_interval``: the tokens a poll waits for (fewer once the generation ended)."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, not {stream_interval}")
        self._abort = abort
        self._stream_interval = stream_interval
        self._wait_s = wait_s
        self._idle_abort_s = idle_abort_s
        self._clock = clock
        self._running: dict[str, _Generation] = {}

    def __len__(self) -> int:
        return len(self._running)

    def start(self, request_id: str, chunks: AsyncIterator[GenerationChunk]) -> None:
        """Run ``chunks`` (the engine's deltas of ``request_id``) in the background, kept here."""
        if not request_id:
            raise invalid_arg("a polled decode needs a request_id")
        if request_id in self._running:
            raise invalid_arg(f"decode of request '{request_id}' is already running")
        generation = _Generation(polled_at=self._clock())
        generation.task = asyncio.get_running_loop().create_task(self._run(generation, chunks))
        self._running[request_id] = generation

    async def _run(self, generation: _Generation, chunks: AsyncIterator[GenerationChunk]) -> None:
        try:
            async with aclosing(chunks) as stream:  # type: ignore[type-var]
                async for chunk in stream:
                    generation.chunks.append(chunk)
                    generation.changed.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the next poll, as the stage's one coded error
            generation.error = exc
        finally:
            generation.done = True
            generation.changed.set()

    async def poll(self, request_id: str, offset: int) -> tuple[GenerationChunk, int]:
        """Every chunk after ``offset``, merged, and the offset to poll from next."""
        generation = self._running.get(request_id)
        if generation is None:
            raise EpdError(
                f"no decode of request '{request_id}' is running (finished, aborted, or idle for "
                f"more than {self._idle_abort_s:.0f} s)",
                ErrorCode.NOT_FOUND,
            )
        if not generation.base <= offset <= generation.base + len(generation.chunks):
            raise invalid_arg(
                f"poll offset {offset} of request '{request_id}' is outside "
                f"{generation.base}..{generation.base + len(generation.chunks)}"
            )
        generation.polled_at = self._clock()
        del generation.chunks[: offset - generation.base]
        generation.base = offset
        await self._await_tokens(generation)
        generation.polled_at = self._clock()
        answer = merged(generation.chunks)
        if generation.done and generation.error is not None and not generation.chunks:
            del self._running[request_id]
            raise generation.error
        if generation.done and not generation.chunks and generation.error is None:
            del self._running[request_id]  # ended without a finished chunk (cancelled by the engine)
            return GenerationChunk(text="", token_ids=[], finish_reason="abort", finished=True), offset
        if answer.finished:
            del self._running[request_id]
        return answer, generation.base + len(generation.chunks)

    async def _await_tokens(self, generation: _Generation) -> None:
        """Until ``generation`` holds ``stream_interval`` unanswered tokens or ended, at most
        ``wait_s``."""
        loop = asyncio.get_running_loop()  # real time: ``clock`` is the idle reaper's
        deadline = loop.time() + self._wait_s
        while not generation.done and sum(max(len(c.token_ids), 1) for c in generation.chunks) < self._stream_interval:
            left = deadline - loop.time()
            if left <= 0:
                return
            generation.changed.clear()
            with suppress(TimeoutError):
                await asyncio.wait_for(generation.changed.wait(), left)

    async def cancel(self, request_id: str) -> None:
        """Stop the generation of ``request_id`` (the caller's abort), if it still runs."""
        generation = self._running.pop(request_id, None)
        if generation is not None:
            await self._stop(request_id, generation)

    async def _stop(self, request_id: str, generation: _Generation) -> None:
        if generation.task is not None and not generation.task.done():
            generation.task.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await generation.task
            await self._abort(request_id)

    async def reap(self) -> list[str]:
        """Abort the generations nobody polled for ``idle_abort_s``; their ids."""
        now = self._clock()
        idle = [rid for rid, g in self._running.items() if now - g.polled_at > self._idle_abort_s]
        for request_id in idle:
            await self.cancel(request_id)
        return idle

    async def reap_every(self, period_s: float = 1.0) -> None:
        """Reap idle generations every ``period_s``; when cancelled (the loop stops), stop all."""
        try:
            while True:
                await asyncio.sleep(period_s)
                await self.reap()
        finally:
            for request_id in list(self._running):
                await self.cancel(request_id)


async def decode_answers(
    engine: Any, polls: PolledGenerations, inputs: Any, images: Sequence[Any], request_id: str
) -> AsyncIterator[GenerationChunk | tuple[GenerationChunk, int]]:
    """What the ``decode`` model answers one request with (``engine``: a ``DecodeEngine``,
    ``inputs``: ``pd.stage.StageInputs``): without ``poll_offset`` the engine's chunks, streamed;
    with it exactly one (merged chunk, next offset), after starting the generation on the first
    call (the one that carries ``transfer_params``; polled generations always make deltas)."""
    if inputs.poll_offset is None:
        async for chunk in engine.decode(inputs.transfer_params, images, inputs.sampling, request_id, inputs.stream):
            yield chunk
        return
    if inputs.transfer_params:
        polls.start(request_id, engine.decode(inputs.transfer_params, images, inputs.sampling, request_id, True))
    yield await polls.poll(request_id, inputs.poll_offset)

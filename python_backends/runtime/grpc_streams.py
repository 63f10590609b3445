"""Ending a Triton gRPC stream the way Triton 2.51 expects: by the server. Shared by every client
of ours that opens one: the remote-encoder client (``scaleout/wire.py``) here, the OpenAI frontend,
the benchmark harness and ``triton-epd-client`` through ``client/grpc_streams.py``.

A client cancel of a ``stream_infer`` call (an RST_STREAM: ``call.cancel()``, a stream deadline, a
call grpc garbage-collects while it is still open) that lands near the stream's start or near its
final response can leave the request alive in Triton 2.51's gRPC frontend for good, and with it
the model: it then never unloads and the server's stop ends with "Exit timeout expired"
(docs/benchmarks/cancel-storm.md; upstream server#7840, #8078, fixed in r25.04). So every stream
our clients open ends by one rule, here, for all of them:

1. **read to the close**: a stream whose final response (or an error response) came is read on
   until the server closes it (milliseconds later), never cancelled;
2. **in-band abort**: a request the caller gives up on is stopped by a control request on another
   stream, where the model takes one (inputs ``abort`` and ``request_id``: ``decode`` today;
   ``client/grpc_streams.py``'s ``InBandAbort``), and its own stream is still read on to its close;
3. **hard cancel after a grace**: only a stream still open ``GRACE_S`` after the caller gave up
   (``CLOSE_TIMEOUT_S`` after a final response) is cancelled.

:class:`StreamEnds` runs that end as a task of its own, so a caller that is itself cancelled (an
HTTP client that left the OpenAI frontend, a benchmark request past its timeout) neither
interrupts the drain nor leaves the call for grpc to cancel when it is collected.
``client/grpc_streams.py``'s ``end_sync_stream`` is the same rule for the thread-based
``tritonclient.grpc`` client.
Triton's HTTP ``generate_stream`` has no such window: a client that disconnects there cancels
its request cleanly (docs/benchmarks/http-cancel.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

# A request the caller gave up on: how long its stream is drained (after the in-band abort, where
# there is one) before it is cancelled after all. Long enough that a stream near its end reaches
# its final response and close first; a cancel this late lands mid-stream, away from both ends.
GRACE_S = 5.0
# The server closes a stream within milliseconds of its final response; a stream still open after
# this long is cancelled after all (something else went wrong, and the caller must not hang).
CLOSE_TIMEOUT_S = 10.0

# How a stream ended: the server closed it, or the client cancelled it (the hard cancel).
CLOSED, CANCELLED = "closed", "cancelled"

Abort = Callable[[], Awaitable[object]]
log = logging.getLogger("grpc_streams")


def _cancel(responses: Any) -> None:
    with contextlib.suppress(Exception):  # a call already over, or a stand-in without cancel()
        responses.cancel()


async def _read_to_end(responses: Any) -> None:
    try:
        async for _ in responses:
            pass
    except StopAsyncIteration:
        pass
    except asyncio.CancelledError:
        raise
    except Exception:  # the server closed it with an error status: closed all the same
        pass


async def end_stream(
    responses: Any,
    finished: bool,
    abort: Abort | None = None,
    grace_s: float = GRACE_S,
    close_timeout_s: float = CLOSE_TIMEOUT_S,
) -> str:
    """End a ``tritonclient.grpc.aio`` ``stream_infer`` call whose request iterator has ended:
    ``finished``: its final (or an error) response came; otherwise the caller gives up on it, and
    ``abort`` (if any) sends the in-band abort. Returns :data:`CLOSED` or :data:`CANCELLED`.
    Cancelled itself, it cancels the call (nothing else would end it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (close_timeout_s if finished else grace_s)
    try:
        if not finished and abort is not None:
            try:
                await asyncio.wait_for(abort(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                log.warning("in-band abort unanswered in %.1f s", grace_s)
            except Exception as exc:  # the stream is still drained and, if need be, cancelled
                log.warning("in-band abort failed: %s", exc)
        await asyncio.wait_for(_read_to_end(responses), max(0.0, deadline - loop.time()))
        return CLOSED
    except asyncio.TimeoutError:
        _cancel(responses)
        return CANCELLED
    except BaseException:
        _cancel(responses)
        raise


class StreamEnds:
    """Ends streams (:func:`end_stream`) in tasks of their own, kept until they are done.

    ``end`` returns at once; ``close_stream`` waits for a finished stream's close (milliseconds)
    and leaves an abandoned one draining in the background; ``wait`` (at the client's close)
    waits for every end still running, and cancels those still open when it runs out of time."""

    def __init__(self, grace_s: float = GRACE_S, close_timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        self.grace_s = grace_s
        self.close_timeout_s = close_timeout_s
        self._tasks: set[asyncio.Task[str]] = set()
        self.ended: dict[str, int] = {CLOSED: 0, CANCELLED: 0}

    @property
    def pending(self) -> int:
        return len(self._tasks)

    def end(self, responses: Any, finished: bool, abort: Abort | None = None) -> asyncio.Task[str]:
        task = asyncio.get_running_loop().create_task(
            end_stream(responses, finished, abort, self.grace_s, self.close_timeout_s)
        )
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[str]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is None:
            self.ended[task.result()] += 1

    async def close_stream(self, responses: Any, finished: bool, abort: Abort | None = None) -> None:
        """End a stream; a caller cancelled meanwhile leaves the end running (it is shielded)."""
        task = self.end(responses, finished, abort)
        if finished:
            await asyncio.shield(task)

    async def wait(self, timeout_s: float | None = None) -> None:
        """Wait for the ends still running (at most their grace); past ``timeout_s`` the rest is
        cancelled, which cancels their calls."""
        mine = [t for t in self._tasks if t.get_loop() is asyncio.get_running_loop()]
        if not mine:
            return
        _, left = await asyncio.wait(mine, timeout=timeout_s)
        for task in left:
            task.cancel()
        if left:
            await asyncio.wait(left)

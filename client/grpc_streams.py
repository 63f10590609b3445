"""Ending a ``tritonclient.grpc.aio`` stream the way Triton expects: by the server.

A ``stream_infer`` call whose final response is in, but that the caller then drops, is not over
yet: the server closes the stream a moment later. grpc cancels a call it garbage-collects before
that, and a cancel that lands between Triton 2.51's last response and its close of the stream can
leave the request alive in Triton's gRPC frontend for good, and with it the model: that model then
never unloads and the server's stop ends with "Exit timeout expired"
(docs/benchmarks/cancel-storm.md: ``cancel_after_final``). So after the final response the
caller reads the stream to its end, and cancels only a request it gives up on.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

# The server closes a stream within milliseconds of its final response; a stream still open after
# this long is cancelled after all (something else went wrong, and the caller must not hang).
CLOSE_TIMEOUT_S = 10.0


async def end_stream(responses: Any, finished: bool, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
    """End a ``stream_infer`` call (its request iterator has ended). ``finished``: its final
    response (or an error response) came, so wait for the server to close it; otherwise the
    caller gives up on the request, so cancel it (Triton then cancels the request)."""
    if not finished:
        responses.cancel()
        return

    async def read_to_end() -> None:
        async for _ in responses:
            pass

    try:
        await asyncio.wait_for(read_to_end(), timeout_s)
    except asyncio.TimeoutError:
        responses.cancel()
    except Exception:  # the server closed it with an error status: closed all the same
        with contextlib.suppress(Exception):
            responses.cancel()

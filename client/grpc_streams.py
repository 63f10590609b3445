"""The client side of python_backends/runtime/grpc_streams.py's rule for ending a Triton gRPC
stream (read to the server's close; a request given up on: in-band abort, drain, hard cancel only
after a grace): the in-band abort of a model that takes one, and the rule for the thread-based
``tritonclient.grpc`` client. The OpenAI frontend, the benchmark harness and ``triton-epd-client``
import the rule from here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from python_backends.runtime.grpc_streams import (
    CANCELLED,
    CLOSE_TIMEOUT_S,
    CLOSED,
    GRACE_S,
    Abort,
    StreamEnds,
    end_stream,
)

__all__ = [
    "CANCELLED",
    "CLOSED",
    "CLOSE_TIMEOUT_S",
    "GRACE_S",
    "Abort",
    "InBandAbort",
    "StreamEnds",
    "end_stream",
    "end_sync_stream",
]
log = logging.getLogger("grpc_streams")


class InBandAbort:
    """The in-band abort of a model that takes one: the request carries a ``request_id`` input,
    and a control request (``abort`` = true, the same ``request_id``) on a stream of its own stops
    it; the model answers the control request with one empty final response. Whether a model takes
    it is read from its metadata once (both inputs declared)."""

    ABORT, REQUEST_ID = "abort", "request_id"

    def __init__(self, client: Any, grpc_module: Any) -> None:
        self.client = client  # a tritonclient.grpc.aio InferenceServerClient
        self.grpc = grpc_module  # tritonclient.grpc, for InferInput
        self._models: dict[str, bool] = {}

    async def supported(self, model: str) -> bool:
        if model not in self._models:
            try:
                # Metadata, not the config: a triton-epd-serve keeps model configs behind its admin key.
                metadata = await self.client.get_model_metadata(model, as_json=True, client_timeout=10)
                names = {item.get("name") for item in metadata.get("inputs", [])}
            except Exception as exc:  # unknown for now: no abort, ask again next time
                log.warning("inputs of '%s' unknown: %s", model, exc)
                return False
            self._models[model] = {self.ABORT, self.REQUEST_ID} <= names
        return self._models[model]

    def request_id_input(self, request_id: str) -> Any:
        return self._tensor(self.REQUEST_ID, request_id.encode("utf-8"))

    def _tensor(self, name: str, value: Any) -> Any:
        import numpy as np

        array = np.array([value], dtype=np.object_ if isinstance(value, bytes) else bool)
        item = self.grpc.InferInput(name, [1], "BYTES" if isinstance(value, bytes) else "BOOL")
        item.set_data_from_numpy(array)
        return item

    def for_request(self, model: str, request_id: str, ends: StreamEnds) -> Abort:
        """The ``abort`` for :func:`end_stream`: the control request, its stream read to its close."""

        async def abort() -> None:
            inputs = [self.request_id_input(request_id), self._tensor(self.ABORT, True)]

            async def one() -> Any:
                yield {"model_name": model, "inputs": inputs, "request_id": f"abort-{request_id}"}

            responses = self.client.stream_infer(one())
            finished = False
            try:
                async for _, error in responses:
                    if error is not None:
                        log.warning("in-band abort of %s on '%s' refused: %s", request_id, model, error)
                    finished = True
                    break
            finally:
                await ends.close_stream(responses, finished)

        return abort


def end_sync_stream(
    client: Any, finished: bool, grace_s: float = GRACE_S, close_timeout_s: float = CLOSE_TIMEOUT_S
) -> str:
    """:func:`end_stream` for a ``tritonclient.grpc`` (thread-based) client's stream: its
    ``stop_stream()`` waits for the server to close the stream; a stream still open after the
    grace (``close_timeout_s`` when ``finished``) is cancelled (``stop_stream(cancel_requests=True)``)."""
    closer = threading.Thread(target=client.stop_stream, name="stop-stream", daemon=True)
    closer.start()
    closer.join(close_timeout_s if finished else grace_s)
    if not closer.is_alive():
        return CLOSED
    with contextlib.suppress(Exception):  # the two closes race only at the very end of the stream
        client.stop_stream(cancel_requests=True)
    closer.join(1.0)
    return CANCELLED

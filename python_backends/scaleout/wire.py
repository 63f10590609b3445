"""The gRPC calls a ``pd`` server makes to an encoder server's ``encoder_0`` (see docs/scale-out.md).

Who calls what: membership (``scaleout/membership.py``) connects with :func:`connect` and sends
the probe image; the remote encode (``scaleout/remote.py``) sends images with :func:`stream_one`.
Both read a failed call's gRPC status with :func:`status`. ``tritonclient`` is imported on the
serving side only (inside the functions), so the unit tests can script the client.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from python_backends import contract
from python_backends.errors import EpdError, ErrorCode
from python_backends.runtime.grpc_streams import StreamEnds

ENCODER_MODEL = contract.encoder_model_names(1)[0]
# Status codes that say the image (not the encoder) is at fault: no retry elsewhere.
CLIENT_FAULTS = ("INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED")
# gRPC's reconnect back-off grows to 120 s by default: an encoder restarted after a minute down
# would wait that long to be seen. Capped near the readiness poll, it rejoins within seconds.
RECONNECT_BACKOFF_MS = (500, 2000)  # initial, max
def connect(address: str) -> Any:
    """A ``tritonclient.grpc.aio.InferenceServerClient`` for ``address`` (``HOST:PORT``)."""
    from tritonclient.grpc import aio as grpc_aio
    from tritonclient.grpc._client import MAX_GRPC_MESSAGE_SIZE, KeepAliveOptions

    keepalive = KeepAliveOptions()
    options = [  # tritonclient's defaults, plus the reconnect back-off
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
        ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
    ]
    client = grpc_aio.InferenceServerClient(address, channel_args=options)
    key = peer_key()
    if key is not None:
        client.register_plugin(PeerKey(key))
    return client


# The encoder servers' key (builders/access.py, ``--peer-key-file``): its file's path, in the
# environment tritonserver hands its stubs.
PEER_KEY_FILE_ENV = "TRITON_EPD_PEER_KEY_FILE"
PEER_HEADER = "triton-epd-peer-key"
# gRPC clients send a restricted-protocol header under Triton's prefix (kRestrictedProtocolHeaderTemplate).
PEER_KEY_METADATA = "triton-grpc-protocol-" + PEER_HEADER


def peer_key(environ: Mapping[str, str] | None = None) -> str | None:
    """The key to send to encoder servers, read from its file each time an encoder is admitted (a
    rotated Secret is sent from the next admission on); None without one."""
    path = (os.environ if environ is None else environ).get(PEER_KEY_FILE_ENV)
    if not path:
        return None
    try:
        return Path(path).read_text().strip() or None
    except OSError as exc:
        raise EpdError(f"cannot read the encoder servers' key file: {exc.strerror}", ErrorCode.UNAVAILABLE) from None


class PeerKey:
    """A tritonclient plugin: every call carries the encoder servers' key."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, request: Any) -> None:
        request.headers[PEER_KEY_METADATA] = self.key


def status(exc: BaseException) -> str:
    """The gRPC status name of a failed call ("" when it carries none)."""
    if isinstance(exc, EpdError):
        names = {ErrorCode.INVALID_ARG: "INVALID_ARGUMENT", ErrorCode.NOT_FOUND: "NOT_FOUND"}
        return names.get(exc.code, exc.code.value)
    code = getattr(exc, "code", None)  # grpc.aio.AioRpcError from a stream
    if callable(code):
        return str(getattr(code(), "name", ""))
    value = getattr(exc, "status", None)  # tritonclient's InferenceServerException
    value = value() if callable(value) else None
    return "" if value is None else str(value).removeprefix("StatusCode.")


async def stream_one(
    client: Any, model: str, inputs: list[Any], parameters: Mapping[str, Any] | None, timeout_s: float, ends: StreamEnds
) -> Any:
    """One request to a decoupled model over a gRPC stream: its first response. The stream ends by
    the rule of ``runtime/grpc_streams.py``: read to the server's close (after the answer and after
    an error response alike: a cancel there left the encoder model unable to unload at stop);
    a call that outlives ``timeout_s`` (no gRPC deadline: that is a cancel too) or whose caller
    is cancelled is drained for a grace and cancelled only if it is still open then (``ends``: the
owner's streams still ending, waited for before its clients close: a closed channel cancels them)."""

    async def requests() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": model, "inputs": inputs, "parameters": dict(parameters or {})}

    responses = client.stream_infer(requests())
    answer = None
    finished = False  # the server is done with the request: its close is only waited for

    async def read() -> None:
        nonlocal answer, finished
        async for result, error in responses:
            if error is not None:
                finished = True
                raise error
            if result is not None and (errors := result.as_numpy(contract.ERROR)) is not None:
                finished = True  # errors_as_outputs: the error is the request's last response
                fields = json.loads(bytes(errors.reshape(-1)[0]))  # the code survives
                raise EpdError(f"{model}: {fields['message']}", ErrorCode(fields["code"]))
            if answer is None and result is not None and result.get_response().outputs:
                answer = result
        finished = True

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise ConnectionError(f"{model}: no answer in {timeout_s:g} s") from None
    finally:
        await ends.close_stream(responses, finished)
    if answer is None:
        raise ConnectionError(f"{model}: the stream ended without an answer")
    return answer


def image_input(image: bytes) -> Any:
    from tritonclient.grpc import InferInput

    tensor = InferInput(contract.IMAGE, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([image], dtype=np.object_))
    return tensor


def errors_as_outputs() -> Any:
    from tritonclient.grpc import InferInput

    tensor = InferInput(contract.ERRORS_AS_OUTPUTS, [1], "BOOL")
    tensor.set_data_from_numpy(np.array([True]))
    return tensor


def lease_input(owner: int) -> Any:
    from tritonclient.grpc import InferInput

    tensor = InferInput(contract.LEASE_OWNER, [1], "INT64")
    tensor.set_data_from_numpy(np.array([owner], dtype=np.int64))
    return tensor

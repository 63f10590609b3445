"""Bounds on what one client can make the OpenAI server hold, and for how long.

uvicorn on its own (0.54, httptools) bounds none of this: a request's headers may grow without
limit (100 MB of one header is read into memory), a client may take forever to send them (a
connection that sends nothing, or a byte now and then, is kept open indefinitely: slowloris), a
body may be of any size and arrive at any pace, and connections are accepted until the process
runs out of descriptors. :func:`serve` runs the app with these bounds, each answered in OpenAI's
error shape (``{"error": {"message", "type", "param", "code"}}``) and ``Connection: close``:

* **headers** (request line and header fields) over ``max_header_bytes``: 431, counted as they
  arrive, so at most one read past the bound is ever held;
* **slow headers**: a request whose headers are not complete ``header_timeout_s`` after the
  connection opened (or its first byte, for the next request of a kept-alive connection): 408;
  a connection that sent nothing by then is closed without an answer;
* **bodies** over ``max_body_bytes``: 413, before a byte of the body is read when Content-Length
  says so, else once the bytes received pass it;
* **body bytes held at once**: the bodies of the requests in progress, all together, over
  ``max_inflight_body_bytes`` (counted as they arrive, held until the request ends): the request
  whose bytes would pass it gets a 503 (a burst of large uploads cannot hold more in memory);
* **slow bodies**: a body not complete ``body_timeout_s`` after its headers, plus one second per
  ``min_body_rate`` bytes received (a large upload at a fair pace is given the time it needs):
  408, then the connection is closed;
* **connections**: past ``max_connections`` open at once, a new one is answered 503 and closed;
  idle kept-alive connections close after ``keep_alive_s`` (uvicorn's ``timeout_keep_alive``).

``add_limit_arguments`` adds the flags, ``server_limits`` reads them (the default body bound fits
one image, one video and one audio file at their byte limits, base64-encoded).
"""

from __future__ import annotations

import argparse
import asyncio
import http
import json
import logging
import math
import resource
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException

from client.openai_server.prompt import MediaPolicy

logger = logging.getLogger("uvicorn.error")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_SPARE_DESCRIPTORS = 128  # kept for the gRPC channel to Triton, logs, model files
LINGER_S = 2.0  # a refused connection reads and drops for this long before it closes


def default_max_connections() -> int:
    """2048, or fewer where the descriptor limit would run out first (each connection holds one)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 2048
    return max(16, min(2048, soft - _SPARE_DESCRIPTORS))


def default_max_body_bytes(policy: MediaPolicy) -> int:
    """A chat with one image, one video and one audio file at their byte limits, base64 in JSON
    (4 characters per 3 bytes), and 1 MiB for the rest of the request."""
    media = policy.max_image_bytes + policy.max_video_bytes + policy.max_audio_bytes
    return 4 * math.ceil(media / 3) + (1 << 20)


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = default_max_body_bytes(MediaPolicy())
    max_inflight_body_bytes: int = 4 * default_max_body_bytes(MediaPolicy())
    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 20.0
    body_timeout_s: float = 60.0
    min_body_rate: int = 1 << 20  # bytes per second that earn an upload one more second
    max_connections: int = field(default_factory=default_max_connections)
    keep_alive_s: int = 5

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, not {value}")


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of :class:`ServerLimits` (``--max-body-bytes`` defaults from the media limits)."""
    defaults = ServerLimits()
    group = parser.add_argument_group("request limits (answered 408, 413, 431 or 503 in OpenAI's error shape)")
    group.add_argument("--max-body-bytes", type=int, help="largest request body (default: one image, one video "
                       "and one audio file at their --max-*-bytes, base64-encoded, + 1 MiB)")  # fmt: skip
    group.add_argument("--max-inflight-body-bytes", type=int,
                       help="body bytes of the requests in progress (default: 4 x --max-body-bytes)")  # fmt: skip
    group.add_argument("--max-header-bytes", type=int, default=defaults.max_header_bytes)
    group.add_argument("--header-timeout", type=float, default=defaults.header_timeout_s, metavar="SECONDS",
                       help="time for a request's line and headers to arrive")  # fmt: skip
    group.add_argument("--body-timeout", type=float, default=defaults.body_timeout_s, metavar="SECONDS",
                       help="time for a body to arrive, + 1 s per --min-body-rate bytes received")  # fmt: skip
    group.add_argument("--min-body-rate", type=int, default=defaults.min_body_rate, metavar="BYTES_PER_S")
    group.add_argument("--max-connections", type=int, default=defaults.max_connections)
    group.add_argument("--keep-alive-timeout", type=int, default=defaults.keep_alive_s, metavar="SECONDS")


def server_limits(args: argparse.Namespace, policy: MediaPolicy) -> ServerLimits:
    max_body = args.max_body_bytes or default_max_body_bytes(policy)
    return ServerLimits(
        max_body_bytes=max_body,
        max_inflight_body_bytes=args.max_inflight_body_bytes or 4 * max_body,
        max_header_bytes=args.max_header_bytes,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        min_body_rate=args.min_body_rate,
        max_connections=args.max_connections,
        keep_alive_s=args.keep_alive_timeout,
    )


def error_bytes(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-shaped error body, closing the connection."""
    kind = "service_unavailable" if status == 503 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    head = (
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


# -- bodies: an ASGI middleware ----------------------------------------------------------------


class BodyRefused(StarletteHTTPException):
    """Raised from ``receive`` when a body is refused: FastAPI lets an HTTPException through its
    body parsing (any other error there becomes its own 400), and the app answers it in OpenAI's
    shape; :class:`BodyLimit` answers it where the app did not."""

    code = "request_too_large"


class BodyTooLarge(BodyRefused):
    def __init__(self, max_body_bytes: int) -> None:
        super().__init__(413, f"the request body is over the limit of {max_body_bytes} bytes")


class ServerBusy(BodyRefused):
    code = "server_busy"

    def __init__(self) -> None:
        super().__init__(503, "too many request body bytes are held at once; retry later")


class BodyLimit:
    """``max_body_bytes`` per request and ``max_inflight_body_bytes`` across requests being
    received; a 413 (or 503) sent here or by the app closes the connection."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_inflight_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_inflight_body_bytes = max_inflight_body_bytes
        self.inflight = 0

    async def _answer(self, send: Send, status: int, message: str, code: str) -> None:
        kind = "service_unavailable" if status == 503 else "invalid_request_error"
        body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]  # fmt: skip
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            message = f"the request body ({declared} bytes) is over the limit of {self.max_body_bytes} bytes"
            await self._answer(send, 413, message, "request_too_large")
            return
        held = 0  # this request's body bytes, counted in ``inflight`` until it ends
        started = False

        async def limited_receive() -> Message:
            nonlocal held
            message = await receive()
            if message["type"] == "http.request":
                size = len(message.get("body", b""))
                if held + size > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
                if size and self.inflight + size > self.max_inflight_body_bytes:
                    raise ServerBusy()
                held += size
                self.inflight += size
            return message

        async def closing_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] in (413, 503):  # the rest of the body is not read: close
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, limited_receive, closing_send)
        except BodyRefused as exc:  # not answered by the app
            if started:
                raise
            await self._answer(send, exc.status_code, str(exc.detail), exc.code)
        finally:
            self.inflight -= held


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


# -- headers, slow clients and connections: the HTTP protocol ----------------------------------


def guarded_protocol(limits: ServerLimits) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with ``limits``' header, timeout and connection bounds."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._refused = False
            self._in_headers = False  # a request has begun and its headers are not complete
            self._header_bytes = 0
            self._header_timer: asyncio.TimerHandle | None = None
            self._body_timer: asyncio.TimerHandle | None = None
            self._body_started = 0.0
            self._body_bytes = 0
            self._linger: asyncio.TimerHandle | None = None

        # connection

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                logger.warning("%d connections open: a new one is refused", len(self.connections))
                self._refuse(503, f"over {limits.max_connections} connections are open; retry later",
                             "too_many_connections")  # fmt: skip
                return
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._on_header_timeout)

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timers()
            if self._linger is not None:
                self._linger.cancel()
            super().connection_lost(exc)

        def _cancel_timers(self) -> None:
            for timer in (self._header_timer, self._body_timer):
                if timer is not None:
                    timer.cancel()
            self._header_timer = self._body_timer = None

        def _refuse(self, status: int, message: str, code: str) -> None:
            """Answer ``status`` (unless a response is under way; the app, if it waits for the
            body, gets ``http.disconnect``), then close: the write side at once, the connection
            after :data:`LINGER_S` of reading and dropping what the client still sends, so that
            the client reads the answer rather than a reset."""
            self._refused = True
            self._cancel_timers()
            cycle = self.cycle
            answer = cycle is None or cycle.response_complete or not cycle.response_started
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
            if self.transport.is_closing():
                return
            if answer:
                self.transport.write(error_bytes(status, message, code))
            self.flow.resume_reading()
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self._linger = self.loop.call_later(LINGER_S, self.transport.close)
            else:
                self.transport.close()

        # bytes in

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            if self._refused or self.transport.is_closing():
                return
            if self._in_headers:
                self._header_bytes += len(data)  # at most one read past the bound is ever held
                if self._header_bytes > limits.max_header_bytes:
                    self._refuse(431, f"the request line and headers are over {limits.max_header_bytes} bytes",
                                 "request_headers_too_large")  # fmt: skip
                    return
            # Bytes between requests (uvicorn's keep-alive timer is cancelled by any byte) get a deadline too.
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._header_timer = self.loop.call_later(limits.header_timeout_s, self._on_header_timeout)

        def on_message_begin(self) -> None:
            if self._refused:
                return
            super().on_message_begin()
            self._in_headers = True
            self._header_bytes = 0
            if self._header_timer is None:  # the connection's first request keeps its first deadline
                self._header_timer = self.loop.call_later(limits.header_timeout_s, self._on_header_timeout)

        def on_url(self, url: bytes) -> None:
            if not self._refused:
                super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            if not self._refused:
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            if self._refused:
                return
            self._in_headers = False
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
            if size > limits.max_header_bytes:
                self._refuse(431, f"the request line and headers are over {limits.max_header_bytes} bytes",
                             "request_headers_too_large")  # fmt: skip
                return
            super().on_headers_complete()
            self._body_started, self._body_bytes = time.monotonic(), 0
            self._body_timer = self.loop.call_later(limits.body_timeout_s, self._on_body_timeout)

        def on_body(self, body: bytes) -> None:
            if self._refused:
                return
            self._body_bytes += len(body)
            super().on_body(body)

        def on_message_complete(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            if not self._refused:
                super().on_message_complete()

        # timers

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            if self._refused or self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:  # busy with the last request
                self._header_timer = self.loop.call_later(limits.header_timeout_s, self._on_header_timeout)
                return
            if not self._in_headers:  # no request begun: nothing sent at all, or bytes that start none
                self._refused = True
                self.transport.close()
                return
            logger.warning("a request's headers took over %.0f s: 408", limits.header_timeout_s)
            self._refuse(408, f"the request's headers did not arrive within {limits.header_timeout_s:g} s",
                         "request_timeout")  # fmt: skip

        def _on_body_timeout(self) -> None:
            self._body_timer = None
            if self._refused or self.transport.is_closing():
                return
            deadline = self._body_started + limits.body_timeout_s + self._body_bytes / limits.min_body_rate
            remaining = deadline - time.monotonic()
            if remaining > 0:  # the bytes received so far earned more time
                self._body_timer = self.loop.call_later(remaining, self._on_body_timeout)
                return
            logger.warning("a request body of %d bytes so far took over %.0f s: 408", self._body_bytes,
                           time.monotonic() - self._body_started)  # fmt: skip
            self._refuse(408, "the request body did not arrive in time", "request_timeout")

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._in_headers and self._header_timer is None and not self.transport.is_closing():
                self._header_timer = self.loop.call_later(limits.header_timeout_s, self._on_header_timeout)

    return GuardedHttpToolsProtocol


def uvicorn_config(app: ASGIApp, host: str, port: int, log_level: str, limits: ServerLimits) -> Any:
    """uvicorn's Config for ``app`` with ``limits``: the guarded httptools protocol where httptools
    is installed (uvicorn[standard], as fastapi[standard] and vLLM bring it), else h11 with its
    own header bound only (a warning says so)."""
    import uvicorn

    options: dict[str, Any] = {"http": "h11", "h11_max_incomplete_event_size": limits.max_header_bytes}
    try:
        options = {"http": guarded_protocol(limits)}
    except ImportError:
        logger.warning("httptools is not installed: no header or body timeouts, no connection limit")
    limited = BodyLimit(app, limits.max_body_bytes, limits.max_inflight_body_bytes)
    # ws="none": the API serves no WebSocket, and an upgraded connection would leave these bounds.
    return uvicorn.Config(limited, host=host, port=port, log_level=log_level, timeout_keep_alive=limits.keep_alive_s,
                          ws="none", **options)  # fmt: skip


def serve(app: ASGIApp, host: str, port: int, log_level: str, limits: ServerLimits) -> None:
    """``uvicorn.run(app, host=..., port=..., log_level=...)`` with ``limits``."""
    import uvicorn

    server = uvicorn.Server(uvicorn_config(app, host, port, log_level, limits))
    server.run()
    if not server.started:
        raise SystemExit(3)  # uvicorn's STARTUP_FAILURE

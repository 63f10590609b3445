"""The router in front of vLLM's native EPD (``vllm-epd`` peer mode), doing what vLLM's
example proxy does (``examples/online_serving/disaggregated_encoder/disagg_epd_proxy.py``):

1. take every media item (``image_url``, ``audio_url``, ``input_audio``) out of the chat
   request and send one request per item to the encoder instance(s) (``vllm serve`` with
   an ``ec_producer`` EC connector, encoder-only), text removed, ``max_tokens=1``,
   not streamed, all items at once, encoders chosen round robin;
2. when every one of them succeeded (the encoder cache is now in the EC connector's
   storage, keyed by mm_hash), forward the *original* request to the consumer
   (``ec_consumer``), which finds the embeddings there instead of running its encoder,
   and stream its answer back as it comes.

A request without media goes straight to the consumer. An encoder failure is answered
with 502 and the encoder's message; the consumer's own errors pass through as they are.
One addition for measurement: the response carries ``x-epd-encode-ms`` (time of step 1)
and ``x-epd-encode-items``, so the harness can split the first-token time into encode
and the rest.

Run: ``python -m bench.epd_router --port P --encode-url URL [--encode-url ...]
--decode-url URL``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

MM_TYPES = frozenset({"image_url", "audio_url", "input_audio"})
ENCODE_MS_HEADER = "x-epd-encode-ms"
ENCODE_ITEMS_HEADER = "x-epd-encode-items"
log = logging.getLogger("epd_router")


def extract_mm_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every media item of every message, in order."""
    items = []
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            items.extend(item for item in content if isinstance(item, dict) and item.get("type") in MM_TYPES)
    return items


def encoder_requests(body: dict[str, Any]) -> list[dict[str, Any]]:
    """One encoder request per media item: the item alone (no text), one token, no stream."""
    return [
        {
            "model": body.get("model"),
            "messages": [{"role": "user", "content": [item]}],
            "max_tokens": 1,
            "stream": False,
        }
        for item in extract_mm_items(body)
    ]


class UpstreamError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Router:
    encode_urls: list[str]
    decode_url: str
    session: Any = None  # aiohttp.ClientSession, made in start()
    _next_encoder: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.encode_urls:
            raise ValueError("give at least one encoder URL")
        self.encode_urls = [u.rstrip("/") for u in self.encode_urls]
        self.decode_url = self.decode_url.rstrip("/")
        self._next_encoder = itertools.cycle(range(len(self.encode_urls)))

    async def start(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
        )

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def _encode_one(self, url: str, payload: dict[str, Any], request_id: str) -> None:
        async with self.session.post(
            f"{url}/v1/chat/completions", json=payload, headers={"x-request-id": request_id}
        ) as response:
            text = await response.text()
            if response.status != 200:
                raise UpstreamError(response.status, f"encoder {url} answered {response.status}: {text[:500]}")

    async def encode(self, body: dict[str, Any], request_id: str) -> int:
        """Step 1; returns the number of items encoded. Raises UpstreamError."""
        payloads = encoder_requests(body)
        tasks = []
        for index, payload in enumerate(payloads):
            url = self.encode_urls[next(self._next_encoder)]
            tasks.append(self._encode_one(url, payload, f"{request_id}:{index}:{uuid.uuid4().hex[:6]}"))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, UpstreamError):
                raise result
            if isinstance(result, BaseException):
                raise UpstreamError(502, f"encoder request failed: {type(result).__name__}: {result}")
        return len(payloads)

    async def chat_completions(self, request: Any) -> Any:
        from aiohttp import web

        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(400, f"request body is not JSON: {exc}")
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        started = time.perf_counter()
        try:
            items = await self.encode(body, request_id)
        except UpstreamError as exc:
            return _error(502, exc.message)
        encode_ms = (time.perf_counter() - started) * 1000.0
        headers = {ENCODE_MS_HEADER: f"{encode_ms:.3f}", ENCODE_ITEMS_HEADER: str(items)}
        async with self.session.post(
            f"{self.decode_url}/v1/chat/completions", json=body, headers={"x-request-id": request_id}
        ) as upstream:
            if upstream.status != 200 or not body.get("stream"):
                data = await upstream.read()
                return web.Response(
                    body=data, status=upstream.status, content_type=upstream.content_type, headers=headers
                )
            response = web.StreamResponse(status=200, headers={**headers, "Content-Type": "text/event-stream"})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def health(self, request: Any) -> Any:
        from aiohttp import web

        async def ok(url: str) -> bool:
            try:
                async with self.session.get(f"{url}/health") as response:
                    return response.status == 200
            except Exception:  # down is an answer
                return False

        urls = [*self.encode_urls, self.decode_url]
        states = await asyncio.gather(*(ok(u) for u in urls))
        healthy = all(states)
        body = {"healthy": healthy, **dict(zip(urls, states, strict=True))}
        return web.json_response(body, status=200 if healthy else 503)

    async def models(self, request: Any) -> Any:
        from aiohttp import web

        async with self.session.get(f"{self.decode_url}/v1/models") as upstream:
            return web.Response(body=await upstream.read(), status=upstream.status, content_type=upstream.content_type)

    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=256 << 20)  # images travel inline as data URIs
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)

        async def lifecycle(_: Any) -> Any:
            await self.start()
            yield
            await self.stop()

        app.cleanup_ctx.append(lifecycle)
        return app


def _error(status: int, message: str) -> Any:
    from aiohttp import web

    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def main(argv: list[str] | None = None) -> None:
    from aiohttp import web

    parser = argparse.ArgumentParser(prog="python -m bench.epd_router", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--encode-url", action="append", required=True, help="encoder instance (repeat for several)")
    parser.add_argument("--decode-url", required=True, help="consumer instance (prefill + decode)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = Router(args.encode_url, args.decode_url)
    web.run_app(router.app(), host=args.host, port=args.port, access_log=None, print=lambda *_: None)


if __name__ == "__main__":
    main()

"""bench peers' servers without vLLM: the EPD router against fake upstreams, the OpenAI SSE target
against a fake server, prompt <-> chat messages, vllm serve flags and peer processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bench.epd_router import (
    ENCODE_MS_HEADER,
    Router,
    encoder_requests,
    extract_mm_items,
)
from bench.metrics import RequestRecord
from bench.openai_target import (
    OpenAIChatTarget,
    PeerServerInfo,
    PromptFormatError,
    SseParser,
    chat_body,
    fold_chunk,
    parse_chat_prompt,
)
from bench.peer_servers import PeerSettings, peer_process, serve_flags, wait_healthy
from bench.workload import BenchRequest
from builders.processes import StartError
from client.epd_client import chat_prompt

IMAGE = b"\xff\xd8\xff\xe0fake-jpeg"


# ---------------------------------------------------------------------------------------------
# fake HTTP upstreams
# ---------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def sse(*payloads: Any) -> bytes:
    return b"".join(b"data: " + (p if isinstance(p, bytes) else json.dumps(p).encode()) + b"\n\n" for p in payloads)


STREAM = (
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "prompt_token_ids": [1, 2, 3]},
    {"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [7]}]},
    {"choices": [{"index": 0, "delta": {"content": "bc"}, "token_ids": [8, 9], "finish_reason": "length"}]},
    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}},
    b"[DONE]",
)


class FakeVllm:
    """Records what it was sent; the encoder answers one token, the consumer streams STREAM."""

    def __init__(
        self, name: str, log: list[tuple[str, dict[str, Any]]], status: int = 200, delay_s: float = 0.0
    ) -> None:
        self.name, self.log, self.status, self.delay_s = name, log, status, delay_s

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        await asyncio.sleep(self.delay_s)
        self.log.append((self.name, body))
        if self.status != 200:
            return web.json_response({"error": {"message": f"{self.name} broke"}}, status=self.status)
        if not body.get("stream"):
            return web.json_response({"choices": [{"message": {"content": "x"}, "token_ids": [5]}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        data = sse(*STREAM)
        for i in range(0, len(data), 7):  # events split across network chunks
            await response.write(data[i : i + 7])
        await response.write_eof()
        return response

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        return app


def chat_request(images: int = 1, stream: bool = True) -> dict[str, Any]:
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{i}"}} for i in range(images)
    ]
    content.append({"type": "text", "text": "describe"})
    return {
        "model": "m",
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": content}],
        "stream": stream,
        "max_tokens": 16,
        "stream_options": {"include_usage": True},
    }


# ---------------------------------------------------------------------------------------------
# router
# ---------------------------------------------------------------------------------------------


def test_encoder_requests_one_per_item_without_text() -> None:
    body = chat_request(images=2)
    body["messages"].append({"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]})
    assert len(extract_mm_items(body)) == 3
    requests = encoder_requests(body)
    assert len(requests) == 3
    for request, item in zip(requests, extract_mm_items(body), strict=True):
        assert request == {
            "model": "m",
            "messages": [{"role": "user", "content": [item]}],
            "max_tokens": 1,
            "stream": False,
        }
    assert encoder_requests({"messages": [{"role": "user", "content": "text only"}]}) == []


async def _through_router(
    encoders: list[FakeVllm], consumer: FakeVllm, body: dict[str, Any]
) -> tuple[int, dict[str, str], bytes]:
    async with contextlib.AsyncExitStack() as stack:
        enc_urls = [await stack.enter_async_context(serve(e.app())) for e in encoders]
        dec_url = await stack.enter_async_context(serve(consumer.app()))
        router_url = await stack.enter_async_context(serve(Router(enc_urls, dec_url).app()))
        import aiohttp

        async with aiohttp.ClientSession() as session:
            async with session.post(f"{router_url}/v1/chat/completions", json=body) as response:
                return response.status, dict(response.headers), await response.read()


def test_router_encodes_every_item_first_then_streams_the_original_request() -> None:
    log: list[tuple[str, dict[str, Any]]] = []
    encoders = [FakeVllm("enc0", log, delay_s=0.05), FakeVllm("enc1", log, delay_s=0.05)]
    body = chat_request(images=2)
    status, headers, data = asyncio.run(_through_router(encoders, FakeVllm("dec", log), body))
    assert status == 200
    assert data == sse(*STREAM)  # passed through byte for byte
    names = [name for name, _ in log]
    assert sorted(names[:2]) == ["enc0", "enc1"] and names[2] == "dec"  # round robin, both before the consumer
    assert log[2][1] == body  # the original request, untouched
    assert float(headers[ENCODE_MS_HEADER]) >= 50.0
    assert headers["x-epd-encode-items"] == "2"


def test_router_without_media_goes_straight_to_the_consumer() -> None:
    log: list[tuple[str, dict[str, Any]]] = []
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    status, headers, _ = asyncio.run(_through_router([FakeVllm("enc", log)], FakeVllm("dec", log), body))
    assert status == 200 and [n for n, _ in log] == ["dec"] and headers["x-epd-encode-items"] == "0"


def test_router_encoder_failure_is_a_502_and_the_consumer_is_not_called() -> None:
    log: list[tuple[str, dict[str, Any]]] = []
    status, _, data = asyncio.run(
        _through_router([FakeVllm("enc", log, status=500)], FakeVllm("dec", log), chat_request())
    )
    assert status == 502
    assert "enc broke" in json.loads(data)["error"]["message"]
    assert [n for n, _ in log] == ["enc"]


def test_router_passes_consumer_errors_through() -> None:
    log: list[tuple[str, dict[str, Any]]] = []
    status, _, data = asyncio.run(
        _through_router([FakeVllm("enc", log)], FakeVllm("dec", log, status=400), chat_request())
    )
    assert status == 400 and "dec broke" in data.decode()


# ---------------------------------------------------------------------------------------------
# OpenAI SSE target
# ---------------------------------------------------------------------------------------------


def test_sse_parser_joins_split_lines_and_keeps_data_only() -> None:
    parser = SseParser()
    assert parser.feed(b'data: {"a"') == []
    assert parser.feed(b": 1}\n\n: comment\ndata: [DONE]\r\n") == ['{"a": 1}', "[DONE]"]
    assert parser.feed(b"event: x\n") == []


def test_fold_chunk_counts_only_chunks_with_tokens() -> None:
    record = RequestRecord(key="k")
    carried = [fold_chunk(p, record) for p in STREAM[:4]]
    assert carried == [False, True, True, False]  # the role chunk is not a first token
    assert record.output_token_ids == [7, 8, 9] and record.chunk_tokens == [1, 2]
    assert record.num_input_tokens == 3 and record.num_output_tokens == 3 and record.finish_reason == "length"
    error = RequestRecord(key="e")
    assert not fold_chunk({"error": {"message": "boom"}}, error) and error.error == "boom"


def test_chat_prompt_round_trips_to_messages() -> None:
    prompt = chat_prompt("two pictures", 2)
    parts = parse_chat_prompt(prompt)
    assert (parts.text, parts.num_images) == ("two pictures", 2)
    request = BenchRequest(
        "k", prompt, (IMAGE, b"\x89PNG..."), {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    )
    body = chat_body(request, "tiny", want_prompt_text=True)
    system, user = body["messages"]
    assert system == {"role": "system", "content": parts.system}
    assert [c["type"] for c in user["content"]] == ["image_url", "image_url", "text"]
    assert user["content"][0]["image_url"]["url"].startswith("data:image/jpeg;base64,")
    assert user["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert body["max_tokens"] == 4 and body["ignore_eos"] and body["return_token_ids"] and body["return_prompt_text"]
    with pytest.raises(PromptFormatError):
        parse_chat_prompt("no template")
    with pytest.raises(PromptFormatError):
        chat_body(BenchRequest("k", prompt, (IMAGE,), {}), "tiny")  # 2 placeholders, 1 image


def test_openai_target_records_a_streamed_request() -> None:
    async def scenario() -> tuple[RequestRecord, str | None]:
        log: list[tuple[str, dict[str, Any]]] = []
        fake = FakeVllm("dec", log)
        async with serve(fake.app()) as url:
            info = PeerServerInfo("fake", "0", {"peer": {"instance_group": [{"count": 1}]}})
            target = OpenAIChatTarget(url, "peer", "tiny", info)
            assert await target.not_ready_reason("peer") is None
            assert "not served" in (await target.not_ready_reason("other") or "")
            request = BenchRequest("k", chat_prompt("hi", 1), (IMAGE,), {"max_tokens": 3})
            record = await target.send("peer", target.prepare(request, "peer"), 10.0)
            await target.close()
            return record, log[0][1]["messages"][1]["content"][1]["text"]

    record, text = asyncio.run(scenario())
    assert record.ok and record.output_token_ids == [7, 8, 9] and len(record.chunk_times) == 2
    assert record.num_input_tokens == 3 and text == "hi"
    assert record.stage_ms == {}  # no router header: no stages


def test_openai_target_splits_stages_with_the_router_header() -> None:
    async def scenario() -> RequestRecord:
        log: list[tuple[str, dict[str, Any]]] = []
        async with serve(FakeVllm("enc", log, delay_s=0.02).app()) as enc, serve(FakeVllm("dec", log).app()) as dec:
            async with serve(Router([enc], dec).app()) as url:
                target = OpenAIChatTarget(url, "peer", "tiny", PeerServerInfo("f", "0", {}))
                request = BenchRequest("k", chat_prompt("hi", 1), (IMAGE,), {"max_tokens": 3})
                record = await target.send("peer", target.prepare(request, "peer"), 10.0)
                await target.close()
                return record

    record = asyncio.run(scenario())
    assert set(record.stage_ms) == {"encode", "prefill", "decode"}
    assert record.stage_ms["encode"] >= 20.0
    assert record.stage_ms["encode"] + record.stage_ms["prefill"] == pytest.approx(
        record.chunk_times[0] * 1000, abs=1e-6
    )


def test_openai_target_reports_http_errors_in_the_record() -> None:
    async def scenario() -> RequestRecord:
        async with serve(FakeVllm("dec", [], status=400).app()) as url:
            target = OpenAIChatTarget(url, "peer", "tiny", PeerServerInfo("f", "0", {}))
            record = await target.send(
                "peer", target.prepare(BenchRequest("k", chat_prompt("x", 0), (), {}), "peer"), 10.0
            )
            await target.close()
            return record

    record = asyncio.run(scenario())
    assert not record.ok and record.error.startswith("HTTP 400")


# ---------------------------------------------------------------------------------------------
# vllm serve flags and processes
# ---------------------------------------------------------------------------------------------


def test_serve_flags_from_engine_args() -> None:
    flags = serve_flags(
        {
            "model": "/m",
            "dtype": "float32",
            "max_model_len": 4096,
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "limit_mm_per_prompt": {"image": 4},
            "seed": 0,
            "quantization": None,
        }
    )
    assert flags == [
        "--dtype",
        "float32",
        "--max-model-len",
        "4096",
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--limit-mm-per-prompt",
        '{"image":4}',
        "--seed",
        "0",
    ]


def test_peer_settings_follow_our_cpu_target(tmp_path: Path) -> None:
    settings = PeerSettings.from_target(tmp_path / "tiny-qwen2-vl", tmp_path, tmp_path / "ec")
    assert settings.vllm_env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    command = settings.serve_command(1234, {"mm_encoder_only": True})
    assert command[1:5] == ["-m", "bench.vllm_serve", "serve", str(tmp_path / "tiny-qwen2-vl")]
    assert (
        "--mm-encoder-only" in command
        and "--enforce-eager" in command
        and command[command.index("--port") + 1] == "1234"
    )


def test_a_peer_process_stops_with_its_process_group(tmp_path: Path) -> None:
    proc = peer_process("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], {}, tmp_path / "s.log")
    proc.start()
    assert proc.exited() is None
    report = proc.stop(timeout_s=5)
    assert proc.exited() is not None
    assert report is not None and not report.killed  # SIGTERM was enough
    assert (tmp_path / "s.log").read_text().startswith("$ " + sys.executable)  # the log names the command


def test_wait_healthy_names_a_process_that_died(tmp_path: Path) -> None:
    proc = peer_process(
        "dies", [sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"], {}, tmp_path / "d.log"
    )
    proc.start()
    proc.process.wait(10)
    with pytest.raises(StartError, match="exited with code 3"):
        wait_healthy("http://127.0.0.1:9/health", [proc], timeout_s=5)
    assert "bad flag" in proc.log_tail()

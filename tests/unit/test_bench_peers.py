"""bench peers without vLLM: the EPD router against fake upstreams, the OpenAI SSE target
against a fake server, prompt <-> chat messages, vllm serve flags, ratios against the best
peer, goals, output equality, and a whole PeerRun over scripted server groups."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import zlib
from collections.abc import AsyncIterator, Iterator
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
from bench.loadgen import LoadPoint
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
from bench.peer_equality import equality_table
from bench.peer_servers import GroupHandle, PeerSettings, peer_process, serve_flags, wait_healthy
from bench.peers import PeerRun, PeerRunConfig
from bench.peers_report import (
    agreement_by_policy,
    best_peer_ratios,
    goal_checks,
    validity_warnings,
    write_peer_outputs,
)
from bench.sweep import ModeSpec, SweepConfig
from builders.processes import StartError
from bench.workload import BenchRequest, LengthDist, WorkloadSpec
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

    def __init__(self, name: str, log: list[tuple[str, dict[str, Any]]], status: int = 200, delay_s: float = 0.0) -> None:
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
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{i}"}} for i in range(images)]
    content.append({"type": "text", "text": "describe"})
    return {"model": "m", "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": content}],
            "stream": stream, "max_tokens": 16, "stream_options": {"include_usage": True}}


# ---------------------------------------------------------------------------------------------
# router
# ---------------------------------------------------------------------------------------------


def test_encoder_requests_one_per_item_without_text() -> None:
    body = chat_request(images=2)
    body["messages"].append({"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]})
    assert len(extract_mm_items(body)) == 3
    requests = encoder_requests(body)
    assert len(requests) == 3
    for request, item in zip(requests, extract_mm_items(body)):
        assert request == {"model": "m", "messages": [{"role": "user", "content": [item]}], "max_tokens": 1, "stream": False}
    assert encoder_requests({"messages": [{"role": "user", "content": "text only"}]}) == []


async def _through_router(encoders: list[FakeVllm], consumer: FakeVllm, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
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
    status, _, data = asyncio.run(_through_router([FakeVllm("enc", log, status=500)], FakeVllm("dec", log), chat_request()))
    assert status == 502
    assert "enc broke" in json.loads(data)["error"]["message"]
    assert [n for n, _ in log] == ["enc"]


def test_router_passes_consumer_errors_through() -> None:
    log: list[tuple[str, dict[str, Any]]] = []
    status, _, data = asyncio.run(_through_router([FakeVllm("enc", log)], FakeVllm("dec", log, status=400), chat_request()))
    assert status == 400 and "dec broke" in data.decode()


# ---------------------------------------------------------------------------------------------
# OpenAI SSE target
# ---------------------------------------------------------------------------------------------


def test_sse_parser_joins_split_lines_and_keeps_data_only() -> None:
    parser = SseParser()
    assert parser.feed(b'data: {"a"') == []
    assert parser.feed(b': 1}\n\n: comment\ndata: [DONE]\r\n') == ['{"a": 1}', "[DONE]"]
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
    request = BenchRequest("k", prompt, (IMAGE, b"\x89PNG..."), {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True})
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
    assert record.stage_ms["encode"] + record.stage_ms["prefill"] == pytest.approx(record.chunk_times[0] * 1000, abs=1e-6)


def test_openai_target_reports_http_errors_in_the_record() -> None:
    async def scenario() -> RequestRecord:
        async with serve(FakeVllm("dec", [], status=400).app()) as url:
            target = OpenAIChatTarget(url, "peer", "tiny", PeerServerInfo("f", "0", {}))
            record = await target.send("peer", target.prepare(BenchRequest("k", chat_prompt("x", 0), (), {}), "peer"), 10.0)
            await target.close()
            return record

    record = asyncio.run(scenario())
    assert not record.ok and record.error.startswith("HTTP 400")


# ---------------------------------------------------------------------------------------------
# vllm serve flags and processes
# ---------------------------------------------------------------------------------------------


def test_serve_flags_from_engine_args() -> None:
    flags = serve_flags({
        "model": "/m", "dtype": "float32", "max_model_len": 4096, "enforce_eager": True,
        "enable_prefix_caching": False, "limit_mm_per_prompt": {"image": 4}, "seed": 0, "quantization": None,
    })
    assert flags == ["--dtype", "float32", "--max-model-len", "4096", "--enforce-eager", "--no-enable-prefix-caching",
                     "--limit-mm-per-prompt", '{"image":4}', "--seed", "0"]


def test_peer_settings_follow_our_cpu_target(tmp_path: Path) -> None:
    settings = PeerSettings.from_target(tmp_path / "tiny-qwen2-vl", tmp_path, tmp_path / "ec")
    assert settings.vllm_env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert settings.encoder_env != settings.consumer_env  # two engines, two cores
    command = settings.serve_command(1234, {"mm_encoder_only": True})
    assert command[1:5] == ["-m", "bench.vllm_serve", "serve", str(tmp_path / "tiny-qwen2-vl")]
    assert "--mm-encoder-only" in command and "--enforce-eager" in command and command[command.index("--port") + 1] == "1234"


def test_a_peer_process_stops_with_its_process_group(tmp_path: Path) -> None:
    proc = peer_process("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], {}, tmp_path / "s.log")
    proc.start()
    assert proc.exited() is None
    report = proc.stop(timeout_s=5)
    assert proc.exited() is not None
    assert report is not None and not report.killed  # SIGTERM was enough
    assert (tmp_path / "s.log").read_text().startswith("$ " + sys.executable)  # the log names the command


def test_wait_healthy_names_a_process_that_died(tmp_path: Path) -> None:
    proc = peer_process("dies", [sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"], {}, tmp_path / "d.log")
    proc.start()
    proc.process.wait(10)
    with pytest.raises(StartError, match="exited with code 3"):
        wait_healthy("http://127.0.0.1:9/health", [proc], timeout_s=5)
    assert "bad flag" in proc.log_tail()


# ---------------------------------------------------------------------------------------------
# comparisons
# ---------------------------------------------------------------------------------------------


def point(mode: str, load: str, ttft: float, e2e: float, rps: float, stages: dict[str, float] | None = None) -> dict[str, Any]:
    dist = {"ttft_ms": {"p50": ttft, "p90": ttft * 1.5}, "tpot_ms": {"p50": 5.0}, "itl_ms": {"p50": 5.0},
            "e2e_ms": {"p50": e2e, "p90": e2e * 1.2}}
    return {"mode": mode, "load_label": load, "status": "ran", "load_kind": "concurrency", "load": int(load[2:]),
            "summary": {**dist, "request_throughput": rps, "output_token_throughput": rps * 32},
            "stages": {"ms": stages or {}}}


POINTS = [
    point("epd", "c=1", 100, 300, 3.0, {"encode": 60, "prefill": 30, "decode": 200}),
    point("epd:repeated", "c=1", 20, 200, 5.0),
    point("vllm-colocated", "c=1", 60, 250, 4.0),
    point("vllm-colocated:repeated", "c=1", 25, 180, 6.0),
    point("vllm-epd", "c=1", 150, 280, 3.5),
    point("vllm-epd:repeated", "c=1", 30, 260, 4.5),
]


def test_best_peer_is_chosen_per_metric_and_media_policy() -> None:
    rows = {(r["mode"], r["load_label"]): r for r in best_peer_ratios(POINTS)}
    assert set(rows) == {("epd", "c=1"), ("epd:repeated", "c=1")}
    unique = rows[("epd", "c=1")]
    assert unique["ttft_ms_p50"] == pytest.approx(100 / 60) and unique["best_peer"]["ttft_ms_p50"] == "vllm-colocated"
    assert unique["e2e_ms_p50"] == pytest.approx(300 / 250)
    assert unique["request_throughput"] == pytest.approx(3.0 / 4.0) and unique["best_peer"]["request_throughput"] == "vllm-colocated"
    repeated = rows[("epd:repeated", "c=1")]
    assert repeated["ttft_ms_p50"] == pytest.approx(20 / 25)  # colocated:repeated beats vllm-epd:repeated here
    assert repeated["best_peer"]["e2e_ms_p50"] == "vllm-colocated:repeated"


def test_goal_checks_name_the_stages() -> None:
    goals = {(g["goal"], g["load_label"]): g for g in goal_checks(POINTS)}
    ttft = goals[("epd:repeated TTFT p50 < vllm-epd:repeated", "c=1")]
    assert ttft["met"] and ttft["ratio"] == pytest.approx(20 / 30)
    e2e = goals[("epd e2e p50 <= 1.15x vllm-colocated", "c=1")]
    assert e2e["met"] is False and e2e["ratio"] == pytest.approx(1.2)  # 1.2 > 1.15
    assert e2e["ours_stages"].startswith("decode 200 ms, encode 60 ms")


def eq_row(model: str, key: str, tokens: list[int], policy: str = "unique", error: str | None = None, hits: int | None = None) -> dict[str, Any]:
    return {"model": model, "mode": model if policy == "unique" else f"{model}:repeated", "key": key, "policy": policy,
            "error": error, "num_input_tokens": 298, "output_token_ids": tokens, "cache_hits": hits,
            "prompt_text_equal": True if model.startswith("vllm") else None}


def test_equality_table_compares_every_model_to_the_reference() -> None:
    rows = [eq_row("llm", "a", [1, 2, 3]), eq_row("epd", "a", [1, 2, 3]), eq_row("vllm-epd", "a", [1, 2, 3]),
            eq_row("llm", "b", [4, 5], "repeated"), eq_row("epd", "b", [4, 5], "repeated", hits=1),
            eq_row("vllm-epd", "b", [4, 6], "repeated")]
    table = equality_table(rows)
    assert table["models"] == ["llm", "epd", "vllm-epd"]
    assert table["modes"] == ["llm", "epd", "vllm-epd", "llm:repeated", "epd:repeated", "vllm-epd:repeated"]
    a, b = table["requests"]
    assert a["all_equal"] and not b["all_equal"] and not table["all_equal"]
    assert b["models"]["vllm-epd"]["verdict"] == "differs at token 1"
    assert b["models"]["epd"]["cache_hits"] == 1 and b["models"]["vllm-epd"]["mode"] == "vllm-epd:repeated"
    assert table["prompt_text_checked"] == 2 and table["prompt_text_all_equal"]
    # Without the reference model, the first served one is the reference.
    assert equality_table([r for r in rows if r["model"] != "llm"])["reference"] == "epd"
    errored = equality_table([eq_row("llm", "a", [1]), eq_row("epd", "a", [], error="boom")])
    assert errored["requests"][0]["models"]["epd"]["verdict"] == "error" and not errored["all_equal"]


def test_agreement_compares_each_mode_with_the_baseline_of_its_media_policy() -> None:
    def recs(tokens: list[list[int]]) -> list[RequestRecord]:
        return [RequestRecord(key=str(i), chunk_times=[0.1], output_token_ids=t) for i, t in enumerate(tokens)]

    records = {
        ("llm", "c=1"): recs([[1], [2]]), ("llm:repeated", "c=1"): recs([[3], [4]]),
        ("vllm-epd", "c=1"): recs([[1], [9]]), ("vllm-epd:repeated", "c=1"): recs([[3], [4]]),
    }
    assert agreement_by_policy(records) == {"vllm-epd c=1 vs llm": 0.5, "vllm-epd:repeated c=1 vs llm:repeated": 1.0}


# ---------------------------------------------------------------------------------------------
# a whole run over scripted server groups
# ---------------------------------------------------------------------------------------------

TTFT_S = {"llm": 0.06, "epd": 0.10, "vllm-colocated": 0.07, "vllm-epd": 0.09}


class ScriptedTarget:
    """Tokens depend on the request only; times on the model; epd reports stages and hits."""

    def __init__(self, models: tuple[str, ...], info: PeerServerInfo) -> None:
        self.models, self.client = models, info

    async def not_ready_reason(self, model: str) -> str | None:
        return None if model in self.models else f"'{model}' not served"

    def prepare(self, request: BenchRequest, model: str) -> BenchRequest:
        return request

    async def send(self, model: str, request: BenchRequest, timeout_s: float) -> RequestRecord:
        await asyncio.sleep(0)
        seed = zlib.crc32(request.prompt.encode() + b"".join(request.images))
        tokens = request.sampling["max_tokens"]
        record = RequestRecord(key=request.key, chunk_times=[TTFT_S[model] + 0.01 * i for i in range(tokens)],
                               chunk_tokens=[1] * tokens, num_input_tokens=298, num_output_tokens=tokens,
                               output_token_ids=[(seed + i) % 1000 for i in range(tokens)])
        if model == "epd":
            record.stage_ms = {"encode": 50.0, "prefill": 40.0, "decode": 10.0 * (tokens - 1)}
            record.cache_hits = request.reused_images
        return record

    async def close(self) -> None:
        pass


def scripted_group(name: str, models: tuple[str, ...], proof: bool = False) -> Any:
    configs = {m: {"backend": "fake", "instance_group": [{"count": 1}]} for m in models}
    info = PeerServerInfo(name, "fake", configs)

    @contextlib.contextmanager
    def group() -> Iterator[GroupHandle]:
        yield GroupHandle(
            name, models, lambda _want: ScriptedTarget(models, info), f"fake://{name}", None, [], 1.5,
            {"processes": {m: {} for m in models}} if name != "triton" else {"origin": "fake"},
            ec_proof=(lambda request, refs: {"request": request.key, "proved": True, "reason": "scripted",
                                             "reference_tokens": refs, "tokens_with_zeroed_cache": [0]}) if proof else None,
        )

    return group()


def test_peer_run_merges_groups_and_writes_every_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    modes = ["llm", "epd", "epd:repeated", "vllm-colocated", "vllm-epd", "vllm-epd:repeated", "ensemble"]
    config = SweepConfig(
        modes=[ModeSpec.parse(m) for m in modes],
        points=[LoadPoint("concurrency", 1), LoadPoint("concurrency", 2)],
        workload=WorkloadSpec(output_tokens=LengthDist.parse("4", minimum=1), image_sizes=((32, 24),)),
        requests_per_point=3, warmup_requests=1, progress=False,
    )
    settings = PeerSettings(tmp_path, {}, {}, {}, {}, tmp_path, tmp_path / "ec")
    run = PeerRun(PeerRunConfig(config, settings, equality_unique=2, equality_repeated=2), start_triton=lambda: None)
    groups = {"triton": ("llm", "epd"), "vllm-colocated": ("vllm-colocated",), "vllm-epd": ("vllm-epd",)}
    monkeypatch.setattr(run, "_group", lambda name, _models: scripted_group(name, groups[name], proof=name == "vllm-epd"))
    output = run.run()
    summary = output.summary
    peers = summary["peers"]

    assert [g["group"] for g in peers["groups"]] == ["triton", "vllm-colocated", "vllm-epd"]
    assert {m["label"]: m["status"] for m in summary["modes"]}["ensemble"] == "skipped"  # not loaded on the fake triton
    assert [m["label"] for m in summary["modes"]] == modes  # the order asked for
    assert {(p["mode"], p["load_label"]) for p in summary["points"]} >= {("vllm-epd:repeated", "c=2"), ("llm", "c=1")}
    assert {r["mode"] for r in peers["ratios_vs_best_peer"]} == {"llm", "epd", "epd:repeated"}
    assert any(g["goal"].startswith("epd e2e") for g in peers["goals"])
    eq = peers["equality"]
    assert eq["all_equal"] and eq["models"] == ["llm", "epd", "vllm-colocated", "vllm-epd"] and len(eq["requests"]) == 4
    assert peers["ec_load_proof"]["proved"]
    assert set(peers["ec_load_proof"]["reference_tokens"]) == {"llm", "epd", "vllm-colocated"}
    assert set(summary["token_agreement_vs_baseline"].values()) == {1.0}

    summary["meta"] = {"title": "peers test", "command": "python -m bench peers ..."}
    written = write_peer_outputs(tmp_path / "out", summary, output.raw)
    names = {p.name for p in written}
    assert {"summary.json", "raw.json", "results.csv", "results.md", "peers.csv",
            "peers_latency_vs_concurrency.png", "peers_ratio_vs_best_peer.png"} <= names
    text = (tmp_path / "out" / "results.md").read_text()
    for heading in ("## Server groups", "## Goals", "## Ratios vs the best peer", "## Output equality",
                    "## Does vLLM-EPD's consumer use", "## Latency and throughput"):
        assert heading in text
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["peers"]["equality"]["all_equal"]


def test_a_group_that_fails_to_start_is_reported_and_the_run_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = SweepConfig(modes=[ModeSpec.parse(m) for m in ("vllm-colocated", "vllm-epd")], points=[LoadPoint("concurrency", 1)],
                         workload=WorkloadSpec(output_tokens=LengthDist.parse("2", minimum=1), image_sizes=((32, 24),)),
                         requests_per_point=2, warmup_requests=0, progress=False)
    run = PeerRun(PeerRunConfig(config, PeerSettings(tmp_path, {}, {}, {}, {}, tmp_path, tmp_path / "ec"), 1, 0), lambda: None)

    @contextlib.contextmanager
    def broken() -> Iterator[GroupHandle]:
        raise StartError("vllm serve exited with code 1 while starting; log x:\nboom")
        yield  # pragma: no cover

    monkeypatch.setattr(run, "_group", lambda name, _m: broken() if name == "vllm-epd" else scripted_group(name, ("vllm-colocated",)))
    summary = run.run().summary
    modes = {m["label"]: m for m in summary["modes"]}
    assert modes["vllm-colocated"]["status"] == "ran"
    assert modes["vllm-epd"]["status"] == "skipped" and "did not start" in modes["vllm-epd"]["reason"]
    assert "error" in summary["peers"]["groups"][1]


def test_a_noisy_repetition_is_measured_again_with_fresh_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.sweep as sweep_module

    shares = iter([0.6, 0.1, 0.05])  # rep 1: noisy, then clean; rep 2: clean
    real = sweep_module.cpu_usage

    def scripted_usage(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return {**real(*args, **kwargs), "other_processes_cpu_share": next(shares)}

    monkeypatch.setattr(sweep_module, "cpu_usage", scripted_usage)
    config = SweepConfig(modes=[ModeSpec.parse("vllm-colocated")], points=[LoadPoint("concurrency", 1)],
                         workload=WorkloadSpec(output_tokens=LengthDist.parse("2", minimum=1), image_sizes=((32, 24),)),
                         requests_per_point=2, warmup_requests=0, reps=2, progress=False, max_noise=0.25)
    info = PeerServerInfo("f", "0", {"vllm-colocated": {"instance_group": [{"count": 1}]}})
    target = ScriptedTarget(("vllm-colocated",), info)
    sent: list[str] = []
    original_send = target.send

    async def send(model: str, request: BenchRequest, timeout_s: float) -> RequestRecord:
        sent.append(request.key)
        return await original_send(model, request, timeout_s)

    target.send = send  # type: ignore[method-assign]
    output = asyncio.run(sweep_module.Sweep(config, "fake", None, None).run(target))
    point = output.summary["points"][0]
    assert [rep["noisy_attempts_discarded"] for rep in point["reps"]] == [1, 0]
    assert len(sent) == 6 and len(set(sent)) == 6  # the retry used requests never sent before
    assert {r["key"] for r in output.raw} == set(sent[2:])  # the noisy attempt is not kept


def test_pool_primers_show_every_pool_image_once() -> None:
    from bench.workload import WorkloadBuilder

    spec = WorkloadSpec(media_pool_size=3, images_per_request=LengthDist.parse("2"), image_sizes=((32, 24), (16, 16)))
    builder = WorkloadBuilder(spec)
    primers = builder.pool_primers()
    assert [p.image_keys for p in primers] == [("pool/0",), ("pool/1",), ("pool/2",)]
    assert all(p.reused_images == 1 and p.prompt.count("<|image_pad|>") == 1 for p in primers)
    repeated = builder.build(20, 1.0, "measure", 0, 0)
    assert {k for r in repeated for k in r.image_keys} <= {"pool/0", "pool/1", "pool/2"}
    assert any(len(set(r.image_keys)) == 2 for r in repeated)  # slots of one request still draw independently
    # The same pool image has the same bytes in a primer and in a measured request.
    by_key = {k: img for r in repeated for k, img in zip(r.image_keys, r.images)}
    assert all(by_key.get(p.image_keys[0], p.images[0]) == p.images[0] for p in primers)


def test_media_salt_changes_images_not_prompts() -> None:
    from bench.workload import WorkloadBuilder

    plain = WorkloadBuilder(WorkloadSpec(image_sizes=((32, 24),))).build(3, 0.5, "measure", 0, 0)
    salted = WorkloadBuilder(WorkloadSpec(image_sizes=((32, 24),), media_salt="run-2")).build(3, 0.5, "measure", 0, 0)
    assert [r.prompt for r in plain] == [r.prompt for r in salted]
    assert [r.image_keys for r in plain] == [r.image_keys for r in salted]
    assert all(a != b for p, q in zip(plain, salted) for a, b in zip(p.images, q.images))
    again = WorkloadBuilder(WorkloadSpec(image_sizes=((32, 24),), media_salt="run-2")).build(3, 0.5, "measure", 0, 0)
    assert [r.images for r in again] == [r.images for r in salted]  # a given salt repeats exactly


def test_peers_command_salts_media_per_run_and_run_does_not() -> None:
    from bench.cli import _workload_spec, build_parser

    peers = _workload_spec(build_parser().parse_args(["peers"]))
    assert peers.media_salt  # a fresh salt
    assert _workload_spec(build_parser().parse_args(["peers", "--media-salt", "x"])).media_salt == "x"
    assert _workload_spec(build_parser().parse_args(["run"])).media_salt == ""  # bench run keeps its images


def test_unique_media_served_from_the_store_is_flagged() -> None:

    hit = point("epd", "c=1", 20, 150, 5.0)
    hit["summary"]["cache_hits"] = 24
    fine = point("epd:repeated", "c=1", 20, 150, 5.0)
    fine["summary"]["cache_hits"] = 24
    warnings = validity_warnings([hit, fine])
    assert len(warnings) == 1 and warnings[0].startswith("epd c=1: 24 store hits")

"""Input bounds on loopback: ``file://`` media through the OpenAI API, and abusive HTTP and gRPC
traffic against the OpenAI server and tritonserver, with normal requests going on meanwhile.

``file://`` (the API started with ``--media-dir``): every way out of the folder -- ``..``,
encoded separators and dots, double encoding, absolute paths, file and directory symlinks out,
other hosts, NUL, very long paths -- and a FIFO, a device node, a directory inside it are a 400
in OpenAI's shape, quickly (a FIFO must not block the server), while a file inside is served.

Abuse, each kind against each server (the probes: raw sockets, many at once, from one asyncio
loop): a 100 KB header, a header that never ends, 16 MiB of small header fields, a body over the
limit (declared, and streamed chunked), slowloris (connections sending their headers a byte a
second), a body sent a byte a second, and a flood of idle connections; for the OpenAI server also
more connections than it takes. Meanwhile and afterwards a health check and a real small chat
must succeed: that is what is asserted for every server. For the OpenAI server, run through
``client/openai_server/limits.py``'s ``serve``, each probe must also get its coded answer or be
closed within a generous bound (its defaults: 64 KiB of headers, 20 s for headers, 60 s for a
body, 2048 connections); for tritonserver, which has no such setting in 2.51 (``tritonserver
--help``: no header, body or read-timeout option for HTTP), what happens is measured and printed,
not asserted. ``in_process`` tests check each bound of the OpenAI server with tiny limits, in
seconds, without Triton.

The tables (``-s`` prints them; also written to build/test-logs/slot-N/hardening.md):

    python -m pytest tests/server/test_hardening.py -s
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import resource
import socket
import stat
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from builders.processes import ProcessGroup, http_ok, wait_until_ready
from builders.tritonserver import TritonServer, free_port
from client.epd_client import GrpcClient, chat_prompt
from client.openai_server.limits import ServerLimits
from tests.images import synthetic_image
from tests.server.conftest import LOG_DIR

pytestmark = pytest.mark.server


def _raise_descriptor_limit(wanted: int = 65536) -> None:
    """Room for the floods in this process and the servers it starts (they inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


_raise_descriptor_limit()

HOST = "127.0.0.1"
DEFAULTS = ServerLimits()  # what the OpenAI server runs with here (same descriptor limit)
TABLE = LOG_DIR / "hardening.md"
ROWS: list[str] = []
# Bounds that only catch a hang: far above the configured timeouts.
HANG_S = 30.0


def record(server: str, probe: str, load: str, outcome: str, normal: str) -> None:
    row = f"| {server} | {probe} | {load} | {outcome} | {normal} |"
    ROWS.append(row)
    print(row, flush=True)


@pytest.fixture(scope="module", autouse=True)
def table() -> Iterator[None]:
    yield
    if ROWS:
        header = "| server | probe | load | outcome | normal requests |\n|---|---|---|---|---|\n"
        TABLE.parent.mkdir(parents=True, exist_ok=True)
        TABLE.write_text(header + "\n".join(ROWS) + "\n")
        print(f"\n{header}" + "\n".join(ROWS), flush=True)


# -- probes ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """How a probe connection ended: a status code ("408"), "closed" (EOF, no answer), "reset",
    "open" (still open when the probe gave up), or "connect failed"; when, and what it had sent."""

    kind: str
    seconds: float
    sent: int = 0


def _kind(data: bytes) -> str:
    if not data:
        return "closed"
    if data.startswith(b"HTTP/"):
        return data.split(b" ", 2)[1].decode()
    return "other bytes"


def _result(answer: asyncio.Future[bytes]) -> str:
    if not answer.done():
        return "open"
    if answer.cancelled():
        return "open"
    error = answer.exception()
    if isinstance(error, ConnectionResetError):
        return "reset"
    if error is not None:
        return type(error).__name__
    return _kind(answer.result())


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    try:
        return await asyncio.wait_for(asyncio.open_connection(HOST, port), 30)
    except (OSError, asyncio.TimeoutError):
        return None


async def _answer(reader: asyncio.StreamReader, until_eof: bool) -> bytes:
    """The first bytes the server sends; with ``until_eof``, b"" once it closes (a gRPC server
    sends its own SETTINGS frame first: read on)."""
    data = await reader.read(65536)
    if not until_eof:
        return data
    while data:
        data = await reader.read(65536)
    return b""


@contextlib.asynccontextmanager
async def _probe(
    port: int, until_eof: bool = False
) -> AsyncIterator[tuple[asyncio.StreamWriter, asyncio.Future[bytes]] | None]:
    """A connection and the future of the server's first answer (:func:`_answer`); None when it
    cannot connect. Both are dropped on exit."""
    opened = await _open(port)
    if opened is None:
        yield None
        return
    reader, writer = opened
    answer = asyncio.ensure_future(_answer(reader, until_eof))
    try:
        yield writer, answer
    finally:
        answer.cancel()
        writer.close()


async def dribble(
    port: int, head: bytes, cap_s: float, interval: float = 1.0, pattern: bytes = b"a", repeat: bool = True,
    until_eof: bool = False,
) -> Outcome:  # fmt: skip
    """Sends ``head``, then the bytes of ``pattern`` one every ``interval`` s (over and over, or
    once and then nothing), until the server answers or closes (or ``cap_s`` passes)."""
    started = time.monotonic()
    async with _probe(port, until_eof) as probe:
        if probe is None:
            return Outcome("connect failed", time.monotonic() - started)
        writer, answer = probe
        writer.write(head)
        sent = len(head)
        tick = 0
        while time.monotonic() - started < cap_s:
            done, _ = await asyncio.wait({answer}, timeout=interval)
            if done:
                break
            if not pattern or (not repeat and tick >= len(pattern)):
                continue
            try:
                writer.write(pattern[tick % len(pattern) : tick % len(pattern) + 1])
                await writer.drain()
                sent += 1
                tick += 1
            except OSError:
                await asyncio.wait({answer}, timeout=5)
                break
        return Outcome(_result(answer), time.monotonic() - started, sent)


async def push(
    port: int, head: bytes, total: int, chunked: bool = False, cap_s: float = 120.0, filler: bytes = b"x",
    trailer: bytes = b"",
) -> Outcome:  # fmt: skip
    """Sends ``head`` and then up to ``total`` bytes of ``filler`` (body bytes, chunked-encoded if
    ``chunked``, or header fields) as fast as the server takes them, then ``trailer``, stopping
    at the server's answer, close or reset."""
    started = time.monotonic()
    sent = 0
    block = filler * ((1 << 20) // len(filler))
    async with _probe(port) as probe:
        if probe is None:
            return Outcome("connect failed", time.monotonic() - started)
        writer, answer = probe
        writer.write(head)
        await writer.drain()
        while sent < total and not answer.done() and time.monotonic() - started < cap_s:
            piece = block[: min(len(block), total - sent)]
            try:
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                await asyncio.wait_for(writer.drain(), max(1.0, cap_s - (time.monotonic() - started)))
            except (OSError, asyncio.TimeoutError):
                break
            sent += len(piece)
        if sent >= total and (chunked or trailer):
            with contextlib.suppress(OSError):
                writer.write(b"0\r\n\r\n" if chunked else trailer)
        await asyncio.wait({answer}, timeout=max(5.0, cap_s - (time.monotonic() - started)))
        return Outcome(_result(answer), time.monotonic() - started, sent)


async def idle(port: int, cap_s: float, until_eof: bool = False) -> Outcome:
    """Connects and sends nothing; ends when the server answers or closes (or at ``cap_s``)."""
    started = time.monotonic()
    async with _probe(port, until_eof) as probe:
        if probe is None:
            return Outcome("connect failed", time.monotonic() - started)
        await asyncio.wait({probe[1]}, timeout=cap_s)
        return Outcome(_result(probe[1]), time.monotonic() - started)


async def _peek(reader: asyncio.StreamReader, timeout_s: float) -> str | None:
    """What the server has sent on a connection within ``timeout_s`` (None: nothing)."""
    try:
        return _kind(await asyncio.wait_for(reader.read(65536), timeout_s))
    except asyncio.TimeoutError:
        return None
    except ConnectionResetError:
        return "reset"


async def many(count: int, probe: Callable[[], Awaitable[Outcome]], ramp: int = 100) -> list[Outcome]:
    """``count`` probes at once (started ``ramp`` at a time, so the listen backlog keeps up)."""
    tasks = []
    for start in range(0, count, ramp):
        tasks += [asyncio.ensure_future(probe()) for _ in range(min(ramp, count - start))]
        await asyncio.sleep(0.05)
    return list(await asyncio.gather(*tasks))


def summary(outcomes: list[Outcome]) -> str:
    """``408 ×200 in 20.1-20.4 s``: each kind with its count and when they ended."""
    parts = []
    for kind, count in sorted(collections.Counter(o.kind for o in outcomes).items()):
        times = [o.seconds for o in outcomes if o.kind == kind]
        when = f"{min(times):.1f} s" if max(times) - min(times) < 0.05 else f"{min(times):.1f}-{max(times):.1f} s"
        parts.append(f"{kind} ×{count} after {when}")
    return ", ".join(parts)


def request_head(method: str, path: str, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


FIELDS_HEAD = b"GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\n"
FIELD = b"X-a: a\r\n"  # 8 bytes: one small header field after another


def open_head(path: str) -> bytes:
    """A request line and the start of a header that the dribble never finishes."""
    return f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nX-Slow: ".encode()


@dataclass
class Normal:
    """Normal requests (name -> a call that returns an HTTP-like status) run every ``every`` s
    while probes run: each result kept."""

    checks: dict[str, Callable[[], int]]
    every: float = 3.0
    results: list[tuple[str, int | str, float]] = field(default_factory=list)

    def run_once(self) -> list[tuple[str, int | str, float]]:
        out = []
        for name, check in self.checks.items():
            started = time.monotonic()
            try:
                status: int | str = check()
            except Exception as exc:  # a hang ends in the check's own timeout
                status = f"{type(exc).__name__}: {exc}"[:120]
            out.append((name, status, time.monotonic() - started))
        return out

    async def during(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.results += await asyncio.to_thread(self.run_once)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.every)

    def failures(self) -> list[tuple[str, int | str, float]]:
        return [r for r in self.results if r[1] != 200]

    def describe(self) -> str:
        ok = len(self.results) - len(self.failures())
        slowest = max((r[2] for r in self.results), default=0.0)
        return f"{ok}/{len(self.results)} OK (slowest {slowest:.1f} s)"


async def with_normal_traffic(normal: Normal, probes: dict[str, Awaitable[Any]]) -> dict[str, Any]:
    """Runs ``probes`` at once while ``normal`` keeps checking; their results by name."""
    stop = asyncio.Event()
    checker = asyncio.ensure_future(normal.during(stop))
    try:
        results = await asyncio.gather(*probes.values())
    finally:
        stop.set()
        await checker
    return dict(zip(probes, results, strict=True))


def recovery_s(normal: Normal, bound_s: float = HANG_S) -> float:
    """Seconds until every normal request succeeds again (the bound if they never do)."""
    started = time.monotonic()
    while time.monotonic() - started < bound_s:
        if all(status == 200 for _, status, _ in normal.run_once()):
            return time.monotonic() - started
        time.sleep(0.5)
    return bound_s


# -- the OpenAI server -------------------------------------------------------------------------

SECRET = b"SECRET-OUTSIDE-THE-MEDIA-FOLDER"
IMAGE = synthetic_image(64, 48, seed=701)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("hardening-media")
    media, outside = base / "media", base / "outside"
    (media / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.jpg").write_bytes(SECRET)
    (media / "cat.jpg").write_bytes(IMAGE)
    (media / "link_out.jpg").symlink_to(outside / "secret.jpg")
    (media / "dirlink_out").symlink_to(outside)
    (media / "link_dev").symlink_to("/dev/zero")
    (media / "link_in.jpg").symlink_to("cat.jpg")
    os.mkfifo(media / "fifo.jpg")
    if os.geteuid() == 0:
        os.mknod(media / "zero.jpg", 0o600 | stat.S_IFCHR, os.makedev(1, 5))
    return media


@pytest.fixture(scope="module")
def api(server: TritonServer, model_dir: Path, media_dir: Path) -> Iterator[tuple[str, int]]:
    """``python -m client.openai_server`` with ``--media-dir``, in front of the session's Triton:
    its URL and pid."""
    port = free_port()
    command = [sys.executable, "-m", "client.openai_server", "--triton-grpc-url", server.grpc_url,
               "--model-dir", str(model_dir), "--port", str(port), "--media-dir", str(media_dir)]  # fmt: skip
    app = ProcessGroup("openai-server", command, log_path=LOG_DIR / "openai-hardening.log").start()
    try:
        wait_until_ready(lambda: http_ok(f"http://{HOST}:{port}/health"), [app], 120, "the OpenAI server")
        assert app.pid is not None
        yield f"http://{HOST}:{port}", app.pid
    finally:
        report = app.stop(timeout_s=30)
        assert report is not None and not report.killed, report and report.describe()


@pytest.fixture(scope="module")
def api_url(api: tuple[str, int]) -> str:
    return api[0]


def memory(pid: int | None) -> str:
    """``RSS now (peak)`` of a process, in MiB."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (OSError, TypeError):
        return "?"
    values = {line.split(":")[0]: int(line.split()[1]) >> 10 for line in status.splitlines() if line.startswith("Vm")}
    return f"{values.get('VmRSS', '?')} MiB (peak {values.get('VmHWM', '?')})"


def descriptor_limit(pid: int | None) -> str:
    try:
        limits = Path(f"/proc/{pid}/limits").read_text()
    except (OSError, TypeError):
        return "?"
    return next((line.split()[3] for line in limits.splitlines() if line.startswith("Max open files")), "?")


def chat_body(content: Any, max_tokens: int = 2) -> dict[str, Any]:
    return {"model": "llm", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}  # fmt: skip


def image_chat(url: str) -> dict[str, Any]:
    return chat_body([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}])


def api_checks(api_url: str) -> dict[str, Callable[[], int]]:
    def health() -> int:
        return httpx.get(f"{api_url}/health", timeout=60).status_code

    def chat() -> int:
        response = httpx.post(f"{api_url}/v1/chat/completions", json=chat_body("Hi."), timeout=120)
        if response.status_code == 200:
            assert response.json()["usage"]["completion_tokens"] >= 1
        return response.status_code

    return {"health": health, "chat": chat}


FILE_ESCAPES = {
    "dot-dot": "file://{media}/../outside/secret.jpg",
    "encoded dot-dot-slash": "file://{media}/%2e%2e%2foutside%2fsecret.jpg",
    "encoded separators": "file://{media}%2F..%2Foutside%2Fsecret.jpg",
    "double-encoded": "file://{media}/%252e%252e/outside/secret.jpg",
    "absolute outside": "file://{outside}/secret.jpg",
    "/etc/passwd": "file:///etc/passwd",
    "file symlink out": "file://{media}/link_out.jpg",
    "directory symlink out": "file://{media}/dirlink_out/secret.jpg",
    "symlink to /dev/zero": "file://{media}/link_dev",
    "another host": "file://otherhost{media}/cat.jpg",
    "unbalanced [ in the host": "file://[{media}/cat.jpg",
    "encoded NUL": "file://{media}/cat.jpg%00.png",
    "raw NUL": "file://{media}/cat.jpg\x00.png",
    "very long path (1 MB)": "file://{media}/" + "a/" * 500_000,
    "a FIFO": "file://{media}/fifo.jpg",
    "a device node": "file://{media}/zero.jpg",
    "a directory": "file://{media}/sub",
    "the folder": "file://{media}",
}


def test_file_urls_outside_the_media_folder_are_400_through_the_api(api_url: str, media_dir: Path):
    outside = media_dir.parent / "outside"
    with httpx.Client(base_url=api_url, timeout=120) as http:
        served = http.post("/v1/chat/completions", json=image_chat(f"file://{media_dir}/cat.jpg"))
        assert served.status_code == 200, served.text
        assert http.post("/v1/chat/completions", json=image_chat(f"file://{media_dir}/link_in.jpg")).status_code == 200
        answers = {}
        for name, template in FILE_ESCAPES.items():
            if name == "a device node" and not (media_dir / "zero.jpg").exists():
                continue
            started = time.monotonic()
            url = template.format(media=media_dir, outside=outside)
            response = http.post("/v1/chat/completions", json=image_chat(url))
            seconds = time.monotonic() - started
            answers[name] = (response.status_code, seconds)
            assert response.status_code == 400, (name, response.status_code, response.text[:300])
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, (name, error)
            expected = ("invalid_request_error", "messages[0].content[0].image_url", "invalid_image_url")
            assert (error["type"], error["param"], error["code"]) == expected, (name, error)
            assert SECRET.decode() not in response.text and "Traceback" not in response.text
            assert seconds < HANG_S, (name, seconds)
        assert http.get("/health").status_code == 200
        assert http.post("/v1/chat/completions", json=image_chat(f"file://{media_dir}/cat.jpg")).status_code == 200
    slowest = max(answers.items(), key=lambda item: item[1][1])
    record("OpenAI", "file:// outside --media-dir", f"{len(answers)} kinds", f"400 ×{len(answers)} (slowest: "
           f"{slowest[0]}, {slowest[1][1]:.2f} s)", "file inside: 200")  # fmt: skip


def test_the_openai_server_answers_or_closes_abuse_and_keeps_serving(api: tuple[str, int]):
    api_url, pid = api
    port = int(api_url.rsplit(":", 1)[1])
    before = memory(pid)
    normal = Normal(api_checks(api_url))
    chat_head = {"Content-Type": "application/json"}
    over = DEFAULTS.max_body_bytes + 1

    async def probes() -> dict[str, Any]:
        return await with_normal_traffic(normal, {
            "100 KB header": push(port, request_head("GET", "/health", {"X-Big": "a" * 100_000}), 0),
            "endless header": push(port, open_head("/health"), 16 << 20, cap_s=HANG_S),
            "many fields": push(port, FIELDS_HEAD % b"/health", 16 << 20, cap_s=HANG_S, filler=FIELD, trailer=b"\r\n"),
            "declared body": push(port, request_head("POST", "/v1/chat/completions",
                                                     {**chat_head, "Content-Length": str(over)}), 0),
            "chunked body": push(port, request_head("POST", "/v1/chat/completions",
                                                    {**chat_head, "Transfer-Encoding": "chunked"}),
                                 over + (16 << 20), chunked=True),
            "slowloris": many(200, lambda: dribble(port, open_head("/health"), cap_s=DEFAULTS.header_timeout_s + 60)),
            "slow body": many(20, lambda: dribble(port, request_head("POST", "/v1/chat/completions", {
                **chat_head, "Content-Length": "100000"}), cap_s=DEFAULTS.body_timeout_s + 60, interval=1.0)),
            "idle flood": many(1000, lambda: idle(port, cap_s=DEFAULTS.header_timeout_s + 60)),
        })  # fmt: skip

    results = asyncio.run(probes())
    during = normal.describe()
    recovered = recovery_s(normal)
    print(f"OpenAI server memory: {before} before the probes, {memory(pid)} after", flush=True)
    header, endless = results["100 KB header"], results["endless header"]
    declared, chunked = results["declared body"], results["chunked body"]
    record("OpenAI", "100 KB header", "1 connection", summary([header]), during)
    record("OpenAI", "header never ends", f"{endless.sent >> 10} KiB sent before the answer", summary([endless]),
           during)  # fmt: skip
    fields = results["many fields"]
    record("OpenAI", "16 MiB of 8-byte header fields", f"{fields.sent >> 10} KiB sent before the answer",
           summary([fields]), during)  # fmt: skip
    record("OpenAI", "body over the limit, declared", f"Content-Length {over}", summary([declared]), during)
    record("OpenAI", "body over the limit, chunked", f"{chunked.sent >> 20} MiB taken", summary([chunked]), during)
    record("OpenAI", "slowloris (1 byte/s)", "200 connections", summary(results["slowloris"]), during)
    record("OpenAI", "slow body (1 byte/s)", "20 connections", summary(results["slow body"]), during)
    record("OpenAI", "idle connections", "1000 connections", summary(results["idle flood"]),
           f"{during}; all OK again {recovered:.1f} s after")  # fmt: skip
    record("OpenAI", "(all of the above at once)", f"memory {before} before, {memory(pid)} after", "", "")

    assert not normal.failures(), normal.failures()
    assert recovered < HANG_S
    assert header.kind == "431", (header, "is the OpenAI server run by client/openai_server/limits.py's serve()?")
    assert endless.kind in ("431", "reset") and endless.sent < 16 << 20, endless
    assert fields.kind == "431", fields
    assert declared.kind == "413", declared
    # sent: what the client pushed before the answer: the bound plus what the sockets' buffers took
    assert chunked.kind in ("413", "reset", "closed") and chunked.sent < over + (32 << 20), chunked
    bound = {"slowloris": DEFAULTS.header_timeout_s, "slow body": DEFAULTS.body_timeout_s,
             "idle flood": DEFAULTS.header_timeout_s}  # fmt: skip
    expected = {"slowloris": {"408"}, "slow body": {"408"}, "idle flood": {"closed"}}
    for name, timeout_s in bound.items():
        kinds = {o.kind for o in results[name]}
        assert kinds <= expected[name], (name, summary(results[name]))
        assert max(o.seconds for o in results[name]) < timeout_s + HANG_S, (name, summary(results[name]))


def test_the_openai_server_refuses_connections_past_its_limit_and_recovers(api_url: str):
    port = int(api_url.rsplit(":", 1)[1])
    cap = DEFAULTS.max_connections
    normal = Normal(api_checks(api_url))

    async def flood() -> tuple[list[Outcome], int | str, float]:
        started = time.monotonic()
        opened = []
        for start in range(0, cap + 20, 200):  # all open within seconds, well inside the header timeout
            opened += await asyncio.gather(*(_open(port) for _ in range(min(200, cap + 20 - start))))
        held = [pair for pair in opened if pair is not None]
        refused = [Outcome("connect failed", 0.0) for pair in opened if pair is None]
        try:
            await asyncio.sleep(1.0)  # each accepted and counted, the ones past the limit answered
            answers = await asyncio.gather(*(_peek(reader, 1.0) for reader, _writer in held))
            refused += [Outcome(kind, time.monotonic() - started) for kind in answers if kind is not None]
            full = await asyncio.to_thread(lambda: normal.run_once()[0][1])  # health while full
        finally:
            closed_at = time.monotonic()
            for _reader, writer in held:
                writer.close()
        return refused, full, closed_at

    refused, full, closed_at = asyncio.run(flood())
    recovered = recovery_s(normal)
    record("OpenAI", "connections past the limit", f"{cap + 20} connections (limit {cap})",
           summary(refused) if refused else "none refused", f"health while full: {full}; all OK "
           f"{time.monotonic() - closed_at:.1f} s after they closed")  # fmt: skip
    assert len([o for o in refused if o.kind == "503"]) >= 10, summary(refused)
    assert full in (200, 503), full
    assert recovered < HANG_S


# -- tritonserver: measured ------------------------------------------------------------------------


def triton_checks(server: TritonServer) -> dict[str, Callable[[], int]]:
    def health() -> int:
        return httpx.get(f"http://{server.http_url}/v2/health/ready", timeout=60).status_code

    def generate() -> int:
        client = GrpcClient(server.grpc_url, "llm")
        try:
            result = client.generate(chat_prompt("Hi.", 0), [], {"max_tokens": 2, "temperature": 0})
            return 200 if result.num_output_tokens >= 1 else 500
        finally:
            client.close()

    return {"http health": health, "grpc generate": generate}


TRITON_CAP_S = 20.0  # how long a probe waits for Triton to answer or close (it bounds none of them)


def test_tritons_http_under_abuse_is_measured(server: TritonServer):
    port = server.options.ports.http
    normal = Normal(triton_checks(server))
    index = "/v2/repository/index"  # reads a JSON body; no model request (a model's error answer
    # on a kept-alive connection is what makes Triton 2.51 wait its exit timeout, epd_client.HttpClient)
    json_head = {"Content-Type": "application/json", "Connection": "close"}

    async def probes() -> dict[str, Any]:
        return await with_normal_traffic(normal, {
            "100 KB header": push(port, request_head("GET", "/v2/health/ready", {"X-Big": "a" * 100_000}), 0,
                                  cap_s=TRITON_CAP_S),
            "endless header": push(port, open_head("/v2/health/ready"), 64 << 20, cap_s=TRITON_CAP_S),
            "many fields": push(port, FIELDS_HEAD % b"/v2/health/ready", 16 << 20, cap_s=TRITON_CAP_S, filler=FIELD,
                                trailer=b"\r\n"),
            "declared body": push(port, request_head("POST", index, {**json_head, "Content-Length": str(1 << 30)}), 0,
                                  cap_s=TRITON_CAP_S),
            "big body": push(port, request_head("POST", index, {**json_head, "Content-Length": str(256 << 20)}),
                             256 << 20, cap_s=TRITON_CAP_S),
            "slowloris": many(200, lambda: dribble(port, open_head("/v2/health/ready"), cap_s=TRITON_CAP_S)),
            "slow body": many(20, lambda: dribble(port, request_head("POST", index, {
                **json_head, "Content-Length": "100000"}), cap_s=TRITON_CAP_S)),
            "idle flood": many(1000, lambda: idle(port, cap_s=TRITON_CAP_S)),
        })  # fmt: skip

    pid = server.process.pid if server.process is not None else None
    before = memory(pid)
    results = asyncio.run(probes())
    after = memory(pid)
    during = normal.describe()
    recovered = recovery_s(normal)
    endless, big = results["endless header"], results["big body"]
    record("Triton HTTP", "100 KB header", "1 connection", summary([results["100 KB header"]]), during)
    record("Triton HTTP", "header never ends", f"{endless.sent >> 10} KiB sent before the answer", summary([endless]),
           during)  # fmt: skip
    fields = results["many fields"]
    record("Triton HTTP", "16 MiB of 8-byte header fields", f"{fields.sent >> 10} KiB sent", summary([fields]), during)
    record("Triton HTTP", "body declared 1 GiB, not sent", "1 connection", summary([results["declared body"]]), during)
    record("Triton HTTP", "256 MiB body (no limit to set)", f"{big.sent >> 20} MiB taken", summary([big]), during)
    record("Triton HTTP", "slowloris (1 byte/s)", "200 connections", summary(results["slowloris"]), during)
    record("Triton HTTP", "slow body (1 byte/s)", "20 connections", summary(results["slow body"]), during)
    record("Triton HTTP", "idle connections", "1000 connections", summary(results["idle flood"]),
           f"{during}; all OK again {recovered:.1f} s after")  # fmt: skip
    record("Triton HTTP", "(all of the above at once)", f"tritonserver memory {before} before, {after} after; "
           f"descriptor limit {descriptor_limit(pid)}", "", "")  # fmt: skip
    assert not normal.failures(), normal.failures()
    assert recovered < HANG_S


def test_tritons_grpc_under_abuse_is_measured(server: TritonServer):
    import grpc
    import tritonclient.grpc as grpcclient

    port = server.options.ports.grpc
    normal = Normal(triton_checks(server))

    def big_metadata() -> str:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            client.is_server_ready(headers={"x-big": "a" * 100_000})
            return "200"
        except Exception as exc:  # tritonclient wraps grpc errors
            text = str(exc)
            return next((code.name for code in grpc.StatusCode if code.name in text), type(exc).__name__)
        finally:
            client.close()

    async def timed_metadata() -> Outcome:
        started = time.monotonic()
        kind = await asyncio.to_thread(big_metadata)
        return Outcome(kind, time.monotonic() - started)

    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    settings = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty SETTINGS frame

    async def probes() -> dict[str, Any]:
        return await with_normal_traffic(normal, {
            "100 KB metadata": timed_metadata(),
            "slow preface": many(200, lambda: dribble(port, b"", cap_s=TRITON_CAP_S, pattern=preface + settings,
                                                      repeat=False, until_eof=True)),
            "idle flood": many(1000, lambda: idle(port, cap_s=TRITON_CAP_S, until_eof=True)),
        })  # fmt: skip

    results = asyncio.run(probes())
    during = normal.describe()
    recovered = recovery_s(normal)
    record("Triton gRPC", "100 KB metadata", "1 call", summary([results["100 KB metadata"]]), during)
    record(
        "Triton gRPC",
        "HTTP/2 preface + SETTINGS 1 byte/s, then silence",
        "200 connections",
        summary(results["slow preface"]),
        during,
    )
    record("Triton gRPC", "idle connections", "1000 connections", summary(results["idle flood"]),
           f"{during}; all OK again {recovered:.1f} s after")  # fmt: skip
    assert not normal.failures(), normal.failures()
    assert recovered < HANG_S


# -- each bound of the OpenAI server, in process, with tiny limits -----------------------------

TINY = ServerLimits(max_body_bytes=1000, max_inflight_body_bytes=2500, max_header_bytes=2048, header_timeout_s=1.0,
                    body_timeout_s=1.0, min_body_rate=1 << 30, max_connections=40, keep_alive_s=1)  # fmt: skip


@contextlib.contextmanager
def in_process(limits: ServerLimits) -> Iterator[int]:
    """A FastAPI app like the API's (its HTTPException handler answers in OpenAI's shape; ``POST
    /echo`` reads the whole JSON body) under ``limits.serve``'s config, in a thread: its port."""
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from client.openai_server.limits import uvicorn_config

    app = FastAPI()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = {"message": str(exc.detail), "type": "invalid_request_error", "param": None, "code": None}
        return JSONResponse({"error": error}, status_code=exc.status_code)

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def pieces() -> AsyncIterator[bytes]:
            for _ in range(10):  # 2.5 s: past the header and body timeouts of TINY
                await asyncio.sleep(0.25)
                yield b"data: piece\n\n"

        return StreamingResponse(pieces(), media_type="text/event-stream")

    @app.post("/echo")
    async def echo(body: dict[str, Any]) -> dict[str, int]:
        return {"size": len(json.dumps(body))}

    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, HOST, port, "warning", limits))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(30)


def _tiny_checks(port: int) -> dict[str, Callable[[], int]]:
    def echo() -> int:
        return httpx.post(f"http://{HOST}:{port}/echo", json={"text": "x" * 100}, timeout=30).status_code

    return {"health": lambda: httpx.get(f"http://{HOST}:{port}/health", timeout=30).status_code, "echo": echo}


def test_in_process_each_bound_answers_its_code_and_normal_requests_go_on():
    with in_process(TINY) as port:
        normal = Normal(_tiny_checks(port), every=0.3)
        echo = {"Content-Type": "application/json"}

        async def probes() -> dict[str, Any]:
            return await with_normal_traffic(normal, {
                "big header": push(port, request_head("GET", "/health", {"X-Big": "a" * 3000}), 0),
                "endless header": push(port, open_head("/health"), 4 << 20, cap_s=HANG_S),
                "many fields": push(port, FIELDS_HEAD % b"/health", 1 << 20, cap_s=HANG_S, filler=FIELD,
                                    trailer=b"\r\n"),
                "declared": push(port, request_head("POST", "/echo", {**echo, "Content-Length": "1001"}), 0),
                "chunked": push(port, request_head("POST", "/echo", {**echo, "Transfer-Encoding": "chunked"}), 4000,
                                chunked=True, cap_s=HANG_S),
                "slowloris": many(10, lambda: dribble(port, open_head("/health"), cap_s=HANG_S, interval=0.2)),
                "slow body": many(5, lambda: dribble(port, request_head("POST", "/echo", {
                    **echo, "Content-Length": "500"}), cap_s=HANG_S, interval=0.2)),
                "idle": many(10, lambda: idle(port, cap_s=HANG_S)),
            })  # fmt: skip

        results = asyncio.run(probes())
        assert not normal.failures(), normal.failures()
        assert results["big header"].kind == "431"
        assert results["endless header"].kind == "431", results["endless header"]
        assert results["many fields"].kind == "431", results["many fields"]
        assert results["declared"].kind == "413"
        assert results["chunked"].kind in ("413", "reset", "closed"), results["chunked"]
        assert {o.kind for o in results["slowloris"]} == {"408"}, summary(results["slowloris"])
        assert {o.kind for o in results["slow body"]} == {"408"}, summary(results["slow body"])
        assert {o.kind for o in results["idle"]} == {"closed"}, summary(results["idle"])


def test_in_process_refusals_are_in_openais_shape():
    with in_process(TINY) as port, httpx.Client(base_url=f"http://{HOST}:{port}", timeout=30) as http:
        for response in (
            http.post("/echo", content=b"{" + b" " * 1000 + b"}", headers={"Content-Type": "application/json"}),
            http.post(
                "/echo", content=iter([b'{"a": "', b"x" * 1200, b'"}']), headers={"Content-Type": "application/json"}
            ),  # fmt: skip
            http.get("/health", headers={"X-Big": "a" * 3000}),
        ):
            assert response.status_code in (413, 431), response.text
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
            assert response.headers.get("connection") == "close"
        assert http.get("/health").status_code == 200


def test_in_process_connections_past_the_limit_get_503_and_it_recovers():
    with in_process(TINY) as port:
        held = [socket.create_connection((HOST, port), timeout=10) for _ in range(TINY.max_connections)]
        try:
            extra = [socket.create_connection((HOST, port), timeout=10) for _ in range(5)]
            answers = []
            for sock in extra:
                sock.settimeout(10)
                answers.append(_kind(sock.recv(65536)))
                sock.close()
            assert answers == ["503"] * 5
        finally:
            for sock in held:
                sock.close()
        started = time.monotonic()
        while httpx.get(f"http://{HOST}:{port}/health", timeout=10).status_code != 200:
            assert time.monotonic() - started < HANG_S
            time.sleep(0.1)


def test_in_process_body_bytes_held_at_once_are_bounded():
    """Three requests each holding 900 body bytes (of 1000 declared) while the bound is 2500: the
    third is refused 503 when its bytes arrive; the others end 408; then all is normal again."""
    with in_process(TINY) as port:
        head = request_head("POST", "/echo", {"Content-Type": "application/json", "Content-Length": "1000"})

        async def probes() -> list[Outcome]:
            async def partial(delay: float) -> Outcome:
                await asyncio.sleep(delay)
                return await dribble(port, head + b"x" * 900, cap_s=HANG_S, interval=0.2, pattern=b"")

            return list(await asyncio.gather(partial(0), partial(0.1), partial(0.3)))

        outcomes = asyncio.run(probes())
        assert sorted(o.kind for o in outcomes) == ["408", "408", "503"], summary(outcomes)
        assert httpx.post(f"http://{HOST}:{port}/echo", json={"a": 1}, timeout=30).status_code == 200


def test_in_process_normal_use_is_untouched():
    """Pipelined requests, a body at the limit sent in pieces within the time, keep-alive reuse, an
    answer streamed for longer than the header and body timeouts."""
    with in_process(TINY) as port:
        with socket.create_connection((HOST, port), timeout=10) as sock:
            sock.sendall(request_head("GET", "/health") * 3)
            data = b""
            while data.count(b"HTTP/1.1 200") < 3:
                chunk = sock.recv(65536)
                assert chunk, data
                data += chunk
        body = json.dumps({"text": "y" * 900}).encode()
        assert len(body) <= TINY.max_body_bytes
        with socket.create_connection((HOST, port), timeout=10) as sock:
            sock.sendall(request_head("POST", "/echo", {"Content-Type": "application/json",
                                                        "Content-Length": str(len(body))}))  # fmt: skip
            for start in range(0, len(body), 300):
                sock.sendall(body[start : start + 300])
                time.sleep(0.1)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        with httpx.Client(base_url=f"http://{HOST}:{port}", timeout=10) as http:
            assert [http.get("/health").status_code for _ in range(5)] == [200] * 5
            streamed = http.get("/stream")  # a long answer on a kept-alive connection, then another request
            assert streamed.status_code == 200 and streamed.text.count("piece") == 10
            assert http.get("/health").status_code == 200


def test_in_process_bytes_between_requests_get_a_deadline_too():
    """uvicorn's keep-alive timer stops at any byte: blank lines sent after a response, a byte a
    tenth of a second, must not keep the connection open."""
    with in_process(TINY) as port, socket.create_connection((HOST, port), timeout=10) as sock:
        sock.sendall(request_head("GET", "/health"))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        with contextlib.suppress(OSError):
            while time.monotonic() - started < HANG_S:
                sock.sendall(b"\r\n")
                time.sleep(0.1)
                sock.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    if sock.recv(65536) == b"":
                        break
                sock.setblocking(True)
        assert time.monotonic() - started < HANG_S

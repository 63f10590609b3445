"""HTTP cancel: does a client that disconnects from Triton's HTTP ``generate_stream`` leave a
model that cannot unload, as a cancelled gRPC stream can (docs/benchmarks/cancel-storm.md)?

Per round: a fresh server with one tiny decoupled model (tests/server/tiny_models.py: ``ticker``,
our DecoupledModel, or ``canonical``, Triton's own pattern), ``--disconnects`` streams from
``--clients`` threads, each ``POST /v2/models/<model>/generate_stream`` (SSE) on its own loopback
connection, ended by the client at a random point:

- ``early``: 0-30 ms after the request was sent (the gRPC leak window's start);
- ``mid``: after 1-4 events;
- ``after_final``: right after the last event, before the server's end of the chunked body
  (the gRPC leak window's end);
- ``complete`` (1 in 5): read to the server's end.

Half of the disconnects close the socket (FIN), half reset it (``SO_LINGER`` 0: RST). Then
(``ticker`` only) ``--long`` requests of 1,000 tokens disconnected after 2 events: how long until
the model's ``epd_ticker_running_requests`` is 0 again, i.e. whether the disconnect reached the
model as a cancellation. Then the running-requests gauge and Triton's pending count once idle, and
a SIGINT stop: clean or not, "Exit timeout expired" in the log, the model's "successfully
unloaded" line, and when the stop hangs whether Triton alone holds the model
(tests/server/stop_dump.py). Loopback only; bounded by ``--disconnects`` and ``--seconds`` per round.

``--grpc-rule N`` adds one round of our gRPC clients' rule on ``ticker`` (which takes the in-band
abort): N streams given up after 1-4 responses, ended by python_backends/runtime/grpc_streams.py
(in-band abort, drain, hard cancel only after the grace): how many the server closed, how many
needed the hard cancel, and the stop.

    python -m tests.stress.http_cancel --out results/http-cancel
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import re
import socket
import struct
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from builders.machine import describe_machine, one_line
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer
from python_backends.runtime.heartbeat import HEARTBEAT_DIR_ENV
from tests.server.stop_dump import watch_stuck_stop
from tests.server.tiny_models import CANONICAL, TICKER, streaming_repository, with_tick
from tests.stress.cancel_storm import stop_signs

DEFAULT_OUT = REPO_ROOT / "results" / "latest" / "http-cancel"
MODELS = {"ticker": TICKER, "canonical": CANONICAL}
KINDS = ("early", "mid", "after_final", "complete")
TICK_S = 0.01
LONG_TOKENS = 1000  # 10 s at TICK_S: a disconnect that reaches the model ends it far sooner
READ_TIMEOUT_S = 30.0


def _request(model: str, tokens: int) -> bytes:
    body = json.dumps({"text_input": str(tokens)}).encode()
    head = (
        f"POST /v2/models/{model}/generate_stream HTTP/1.1\r\nHost: localhost\r\n"
        f"Content-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _leave(sock: socket.socket, reset: bool) -> None:
    """The client goes away: FIN (close) or RST (close with a zero linger)."""
    if reset:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def one_stream(address: tuple[str, int], model: str, kind: str, tokens: int, events_before: int, reset: bool) -> str:
    """One generate_stream request on its own connection, left as ``kind`` says; returns how it
    ended (``kind``, or ``error`` when the server answered something else than the events)."""
    sock = socket.create_connection(address, timeout=READ_TIMEOUT_S)
    try:
        sock.sendall(_request(model, tokens))
        if kind == "early":
            time.sleep(random.random() * 0.03)
            return kind
        wanted = {"mid": events_before, "after_final": tokens}.get(kind)
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
            if len(data) >= 12 and not data.startswith(b"HTTP/1.1 200"):
                return "error"
            if wanted is not None and data.count(b"data: ") >= wanted:
                return kind
            if data.endswith(b"\r\n0\r\n\r\n"):  # the server ended the chunked body
                break
        return "complete" if data.count(b"data: ") == tokens else "error"
    except OSError:
        return "error"
    finally:
        _leave(sock, reset)


def metrics(server: TritonServer, model: str) -> dict[str, float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()

    def gauge(pattern: str) -> float:
        found = re.search(pattern, text, re.M)
        return float(found.group(1)) if found else float("nan")

    return {
        "running": gauge(rf'^epd_{model}_running_requests\{{model="{model}"\}} (\S+)$'),
        "pending": gauge(rf'^nv_inference_pending_request_count\{{model="{model}",version="1"\}} (\S+)$'),
    }


def idle_metrics(server: TritonServer, model: str, within_s: float = 15.0) -> dict[str, float]:
    """The gauges once they are 0 (or after ``within_s``); ``canonical`` has no running gauge."""
    deadline = time.monotonic() + within_s
    while True:
        found = metrics(server, model)
        settled = all(v == 0 or v != v for v in found.values())  # nan: not exported
        if settled or time.monotonic() > deadline:
            return found
        time.sleep(0.25)


def long_disconnects(server: TritonServer, address: tuple[str, int], count: int) -> list[float]:
    """``ticker``: seconds from a disconnect 2 events into a 1,000-token stream until the model
    serves nothing (10 s = the disconnect never reached it)."""
    seconds = []
    for index in range(count):
        one_stream(address, "ticker", "mid", LONG_TOKENS, 2, reset=bool(index % 2))
        left = time.monotonic()
        while metrics(server, "ticker")["running"] > 0 and time.monotonic() - left < LONG_TOKENS * TICK_S + 5:
            time.sleep(0.02)
        seconds.append(round(time.monotonic() - left, 2))
    return seconds


def run_round(model: str, index: int, args: argparse.Namespace, logs: Path, repos: Path) -> dict[str, Any]:
    repository = streaming_repository(repos / f"{model}-{index}", {model: with_tick(MODELS[model], TICK_S)})
    log_path = logs / f"{model}-{index}.log"
    heartbeats = repos / f"heartbeats-{model}-{index}"
    heartbeats.mkdir()
    options = ServerOptions(
        repository, Ports.free(), exit_timeout_s=args.exit_timeout_s, extra_env={HEARTBEAT_DIR_ENV: str(heartbeats)}
    )
    server = TritonServer(options, log_path).start()
    server.wait_ready(timeout_s=120)
    host, port = server.http_url.rsplit(":", 1)
    address = ("127.0.0.1" if host in ("localhost", "0.0.0.0") else host, int(port))
    ends: Counter[str] = Counter()
    resets = Counter[bool]()
    lock = threading.Lock()
    left = [args.disconnects]  # disconnects still to make (complete streams do not count)
    until = time.monotonic() + args.seconds

    def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < until:
            with lock:
                if left[0] <= 0:
                    return
            kind = "complete" if rng.random() < 0.2 else rng.choice(KINDS[:3])
            tokens, reset = rng.randint(2, 30), rng.random() < 0.5
            end = one_stream(address, model, kind, tokens, rng.randint(1, min(4, tokens - 1)), reset)
            with lock:
                ends[end] += 1
                if end in KINDS[:3]:
                    left[0] -= 1
                    resets[reset] += 1

    threads = [threading.Thread(target=client_loop, args=(index * 1000 + k,)) for k in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    long_s = long_disconnects(server, address, args.long) if model == "ticker" else []
    gc.collect()
    idle = idle_metrics(server, model)
    with watch_stuck_stop(server, heartbeats, after_s=args.exit_timeout_s / 3) as stuck:
        report = server.stop()
    log_text = log_path.read_text(errors="replace")
    row = {
        "model": model,
        "round": index,
        **{kind: ends[kind] for kind in (*KINDS, "error")},
        "disconnects": sum(ends[kind] for kind in KINDS[:3]),
        "resets": resets[True],
        "long_disconnect_to_idle_s": long_s,
        "running_when_idle": idle["running"],
        "pending_when_idle": idle["pending"],
        "clean_stop": bool(report and report.clean),
        "stop_s": round(report.seconds, 1) if report else None,
        "unloaded": f"successfully unloaded '{model}'" in log_text,
        "held_by_triton": stuck.held_by_triton,
        **stop_signs(log_path),
    }
    print(json.dumps(row), flush=True)
    return row


def grpc_rule_round(count: int, args: argparse.Namespace, logs: Path, repos: Path) -> dict[str, Any]:
    import asyncio

    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.aio as grpcaio

    from client.grpc_streams import InBandAbort, StreamEnds

    repository = streaming_repository(repos / "grpc-rule", {"ticker": with_tick(TICKER, TICK_S)})
    heartbeats = repos / "heartbeats-grpc-rule"
    heartbeats.mkdir()
    log_path = logs / "grpc-rule.log"
    options = ServerOptions(
        repository, Ports.free(), exit_timeout_s=args.exit_timeout_s, extra_env={HEARTBEAT_DIR_ENV: str(heartbeats)}
    )
    server = TritonServer(options, log_path).start()
    server.wait_ready(timeout_s=120)

    async def load() -> dict[str, int]:
        client = grpcaio.InferenceServerClient(server.grpc_url)
        ends, aborts = StreamEnds(), InBandAbort(client, grpcclient)
        assert await aborts.supported("ticker")
        rng, slots = random.Random(1), asyncio.Semaphore(args.clients)

        async def one(index: int) -> None:
            async with slots:
                request_id = f"rule-{index}"
                tokens = grpcclient.InferInput("text_input", [1], "BYTES")
                tokens.set_data_from_numpy(np.array([str(rng.randint(30, 300)).encode()], dtype=np.object_))
                inputs = [tokens, aborts.request_id_input(request_id)]

                async def request() -> Any:
                    yield {"model_name": "ticker", "inputs": inputs, "request_id": request_id}

                responses = client.stream_infer(request())
                wanted, received = rng.randint(1, 4), 0
                async for _ in responses:
                    received += 1
                    if received >= wanted:
                        break
                await ends.close_stream(responses, False, aborts.for_request("ticker", request_id, ends))

        await asyncio.gather(*(one(i) for i in range(count)))
        await ends.wait(30)
        await client.close()
        return dict(ends.ended)

    ended = asyncio.run(load())
    idle = idle_metrics(server, "ticker")
    with watch_stuck_stop(server, heartbeats, after_s=args.exit_timeout_s / 3) as stuck:
        report = server.stop()
    row = {
        "given_up": count,
        "streams_closed_by_server": ended["closed"],  # the given-up streams and their abort streams
        "hard_cancels": ended["cancelled"],
        "running_when_idle": idle["running"],
        "clean_stop": bool(report and report.clean),
        "unloaded": "successfully unloaded 'ticker'" in log_path.read_text(errors="replace"),
        "held_by_triton": stuck.held_by_triton,
        **stop_signs(log_path),
    }
    print(json.dumps(row), flush=True)
    return row


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    table = []
    for model in MODELS:
        mine = [r for r in rows if r["model"] == model]
        if mine:
            longs = [s for r in mine for s in r["long_disconnect_to_idle_s"]]
            table.append({
                "model": model,
                "rounds": len(mine),
                **{kind: sum(r[kind] for r in mine) for kind in (*KINDS, "error")},
                "disconnects": sum(r["disconnects"] for r in mine),
                "resets": sum(r["resets"] for r in mine),
                "long_max_s": max(longs) if longs else None,
                "long_count": len(longs),
                "busy_when_idle": sum(r["running_when_idle"] > 0 or r["pending_when_idle"] > 0 for r in mine),
                "unclean_stops": sum(not r["clean_stop"] for r in mine),
                "exit_timeouts": sum(r["exit_timeout"] for r in mine),
                "not_unloaded": sum(not r["unloaded"] for r in mine),
                "held_by_triton": sum(bool(r["held_by_triton"]) for r in mine),
            })  # fmt: skip
    return table


def markdown(table: list[dict[str, Any]], args: argparse.Namespace, machine: dict[str, Any]) -> str:
    lines = [
        "# HTTP cancel: client disconnects from generate_stream",
        "",
        f"`python -m tests.stress.http_cancel --rounds {args.rounds} --disconnects {args.disconnects}"
        f" --clients {args.clients} --long {args.long}` ({args.exit_timeout_s} s exit timeout,"
        f" {TICK_S * 1000:.0f} ms per token); {one_line(machine)}.",
        "",
        "| model | rounds | disconnects (early / mid / after final; RST) | read to the end | errors "
        "| long streams: s to idle (max) | gauges not 0 when idle | unclean stops | exit timeout "
        "| model not unloaded | held by Triton |",
        "|---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for t in table:
        long = f"{t['long_count']}: {t['long_max_s']}" if t["long_count"] else "n/a"
        lines.append(
            f"| {t['model']} | {t['rounds']} | {t['disconnects']} ({t['early']} / {t['mid']} / {t['after_final']};"
            f" {t['resets']}) | {t['complete']} | {t['error']} | {long} | {t['busy_when_idle']} "
            f"| {t['unclean_stops']} of {t['rounds']} | {t['exit_timeouts']} | {t['not_unloaded']} "
            f"| {t['held_by_triton']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="servers per model")
    parser.add_argument("--disconnects", type=int, default=200, help="disconnects per round")
    parser.add_argument("--seconds", type=float, default=120.0, help="most load per round")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--long", type=int, default=4, help="ticker: 1,000-token streams disconnected per round")
    parser.add_argument("--exit-timeout-s", type=int, default=15)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--grpc-rule", type=int, default=0, help="streams of our gRPC clients' rule (ticker)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "servers"
    logs.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="http-cancel-") as repos:
        rows = [
            run_round(model, index, args, logs, Path(repos)) for model in args.models for index in range(args.rounds)
        ]
        rule = grpc_rule_round(args.grpc_rule, args, logs, Path(repos)) if args.grpc_rule else None
    machine = describe_machine()
    table = summarize(rows)
    (args.out / "http_cancel.json").write_text(
        json.dumps({"machine": machine, "table": table, "rounds": rows, "grpc_rule": rule}, indent=2)
    )
    (args.out / "http_cancel.md").write_text(markdown(table, args, machine))
    print(markdown(table, args, machine))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

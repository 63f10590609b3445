"""Cancel storm: does a tiny decoupled model unload at stop after many cancelled gRPC streams?

The residual stop hang of docs/benchmarks/cancel-storm.md ("Exit timeout expired", the model never
unloads, its stub idle) needs thousands of cancels to show. This runs it without vLLM, on tiny
models that start in seconds (tests/server/tiny_models.py), one model per server so the live model
is known:

- ``ticker``: our DecoupledModel (every request ends with one FINAL, counted as running until then);
- ``canonical``: Triton's own decoupled pattern (a thread per request, no code of ours);

- ``ticker_late_final``: ``ticker`` that waits 200 ms after noticing a cancel before its FINAL;

each under ``cancel`` load (per stream: 30% cancelled 0-30 ms after the send, 50% after 1-4
responses, 20% read to the end), ``complete`` load (every stream read to its end), and only one
kind of cancel: ``cancel_early`` (every stream cancelled 0-30 ms after the send) or ``cancel_mid``
(every stream cancelled after 1-4 responses); and ``cancel_after_final``: every stream read to its
final response and then cancelled at once, as a grpc.aio call dropped after its final response is
(grpc cancels a call it garbage-collects before the server has closed it). Per
round: ``--seconds`` of ``--clients`` closed-loop gRPC streaming clients, then SIGINT with a
``--exit-timeout-s`` exit timeout, and whether the server stopped cleanly; when it did not,
whether Triton alone held the model (tests/server/stop_dump.py ``held_by_triton``: the model's own
counters at 0, its stub alive and never finalized, no client connection left).

    python -m tests.stress.cancel_storm --rounds 5 --seconds 40 --clients 8 --out results/latest/cancel-storm
"""

from __future__ import annotations

import argparse
import gc
import json
import queue
import random
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from builders.machine import describe_machine, one_line
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer
from python_backends.runtime.heartbeat import HEARTBEAT_DIR_ENV
from tests.server.stop_dump import watch_stuck_stop
from tests.server.tiny_models import CANONICAL, TICKER, TICKER_LATE_FINAL, streaming_repository, with_tick

DEFAULT_OUT = REPO_ROOT / "results" / "latest" / "cancel-storm"
MODELS = {"ticker": TICKER, "canonical": CANONICAL, "ticker_late_final": TICKER_LATE_FINAL}
LOADS = ("cancel", "complete", "cancel_early", "cancel_mid", "cancel_after_final")
TICK_S = 0.01
RESPONSE_TIMEOUT_S = 30.0


def is_final(response: Any) -> bool:
    final = response.get_response().parameters.get("triton_final_response")
    return final is not None and final.bool_param


def one_stream(url: str, model: str, load: str, rng: random.Random) -> str:
    """One request on its own stream; returns how it ended (``cancel_early``, ``cancel_mid``,
    ``complete``, or ``error``)."""
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        count = grpcclient.InferInput("text_input", [1], "BYTES")
        count.set_data_from_numpy(np.array([str(rng.randint(1, 30)).encode()], dtype=np.object_))
        client.async_stream_infer(model, [count], enable_empty_final_response=True)
        draw = {"cancel": rng.random(), "cancel_early": 0.0, "cancel_mid": 0.5}.get(load, 1.0)
        if draw < 0.3:
            time.sleep(rng.random() * 0.03)
            client.stop_stream(cancel_requests=True)
            return "cancel_early"
        wanted = rng.randint(1, 4) if draw < 0.8 else None
        received = 0
        while wanted is None or received < wanted:
            response, error = responses.get(timeout=RESPONSE_TIMEOUT_S)
            if error is not None:
                return "error"
            if is_final(response):
                if load == "cancel_after_final":  # the call dropped once its final response is in
                    client.stop_stream(cancel_requests=True)
                return "complete"
            received += 1
        client.stop_stream(cancel_requests=True)
        return "cancel_mid"
    finally:
        client.stop_stream()
        client.close()


def stop_signs(log_path: Path) -> dict[str, Any]:
    """What the server log says about the end: tritonserver's own crash, Triton's exit timeout,
    and its last "live models" countdown line."""
    lines = log_path.read_text(errors="replace").splitlines()
    live = [line.split('"')[1] for line in lines if "live models" in line]
    return {
        "tritonserver_segfault": any("Signal (11) received" in line for line in lines),
        "exit_timeout": any("Exit timeout expired" in line for line in lines),
        "last_live_models_line": live[-1] if live else "",
    }


def run_round(model: str, load: str, index: int, args: argparse.Namespace, logs: Path, repos: Path) -> dict[str, Any]:
    repository = streaming_repository(repos / model, {model: with_tick(MODELS[model], TICK_S)})
    log_path = logs / f"{model}-{load}-{index}.log"
    heartbeats = repos / f"heartbeats-{model}-{load}-{index}"
    heartbeats.mkdir()
    options = ServerOptions(
        repository, Ports.free(), exit_timeout_s=args.exit_timeout_s, extra_env={HEARTBEAT_DIR_ENV: str(heartbeats)}
    )
    server = TritonServer(options, log_path).start()
    server.wait_ready(timeout_s=120)
    ends: Counter[str] = Counter()
    lock = threading.Lock()
    until = time.monotonic() + args.seconds

    def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < until:
            try:
                end = one_stream(server.grpc_url, model, load, rng)
            except Exception:  # a response that never came, or the client failed
                end = "error"
            with lock:
                ends[end] += 1

    threads = [threading.Thread(target=client_loop, args=(index * 1000 + k,)) for k in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    gc.collect()  # no client object of ours outlives its stream
    time.sleep(2)
    # A stop still running after a third of the exit timeout: is the model held by Triton alone?
    with watch_stuck_stop(server, heartbeats, after_s=args.exit_timeout_s / 3) as stuck:
        report = server.stop()
    row = {
        "model": model,
        "load": load,
        "round": index,
        "requests": sum(ends.values()),
        **{end: ends[end] for end in ("cancel_early", "cancel_mid", "complete", "error")},
        "clean_stop": report.clean,
        "stop_s": round(report.seconds, 1),
        "held_by_triton": stuck.held_by_triton,
        **stop_signs(log_path),
    }
    print(json.dumps(row), flush=True)
    return row


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    table = []
    for model in MODELS:
        for load in LOADS:
            mine = [r for r in rows if r["model"] == model and r["load"] == load]
            if mine:
                table.append({
                    "model": model,
                    "load": load,
                    "rounds": len(mine),
                    "requests": sum(r["requests"] for r in mine),
                    "cancelled": sum(r["cancel_early"] + r["cancel_mid"] for r in mine),
                    "errors": sum(r["error"] for r in mine),
                    "unclean_stops": sum(not r["clean_stop"] for r in mine),
                    "exit_timeouts": sum(r["exit_timeout"] for r in mine),
                    "held_by_triton": sum(r.get("held_by_triton", False) for r in mine),
                    "tritonserver_segfaults": sum(r["tritonserver_segfault"] for r in mine),
                })  # fmt: skip
    return table


def markdown(table: list[dict[str, Any]], args: argparse.Namespace, machine: dict[str, Any]) -> str:
    lines = [
        "# Cancel storm: unclean stops after cancelled gRPC streams",
        "",
        f"`python -m tests.stress.cancel_storm --rounds {args.rounds} --seconds {args.seconds:g}"
        f" --clients {args.clients}`"
        f" ({args.exit_timeout_s} s exit timeout, {TICK_S * 1000:.0f} ms per token); {one_line(machine)}.",
        "",
        "| model | load | rounds | requests | cancelled | errors | unclean stops | of them: exit timeout "
        "| of them: held by Triton alone | of them: tritonserver segfault |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {t['model']} | {t['load']} | {t['rounds']} | {t['requests']} | {t['cancelled']} | {t['errors']} "
        f"| {t['unclean_stops']} of {t['rounds']} | {t['exit_timeouts']} | {t['held_by_triton']} "
        f"| {t['tritonserver_segfaults']} |"
        for t in table
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="servers per (model, load)")
    parser.add_argument("--seconds", type=float, default=40.0, help="load per round")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--exit-timeout-s", type=int, default=15)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--loads", nargs="+", choices=LOADS, default=list(LOADS))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "servers"  # each server's log: the "live models" countdown of an unclean stop
    logs.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cancel-storm-") as repos:
        rows = [
            run_round(model, load, index, args, logs, Path(repos))
            for model in args.models
            for load in args.loads
            for index in range(args.rounds)
        ]
    machine = describe_machine()
    table = summarize(rows)
    results = {"machine": machine, "table": table, "rounds": rows}
    (args.out / "cancel_storm.json").write_text(json.dumps(results, indent=2))
    (args.out / "cancel_storm.md").write_text(markdown(table, args, machine))
    print(markdown(table, args, machine))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

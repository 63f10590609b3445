"""A finished BLS response iterator is let go by Python, never by the stub's messaging thread
(``BlsCaller._retire`` in python_backends/triton_edge/bls.py).

Triton 2.51's stub holds each BLS response iterator in a map until its stub-to-parent thread
erases it, without the GIL, after the final response. If Python had let go first, that erase
destroys the iterator there, with every response it read and their numpy outputs: Python objects
freed without the GIL. ``relay`` (the real DecoupledModel and BlsCaller, as epd) streams many short
``ticker`` streams while another thread of its stub allocates Python objects. Without the
retirement (``RETIRE_S`` 0) its stub crashed in 4 of 6 runs of 45-120 s (glibc's "malloc(): unaligned
fastbin chunk detected", a segfault in ``pymalloc_alloc`` under ``PyArray_NewFromDescr_int`` as in
the epd stub's crash in the path benchmark, or a stop that hung), with it in none of 4
(``python -m tests.server.test_bls_release --out DIR`` runs both, interleaved;
docs/benchmarks/bls-release.md). A race: this test catches a regression about half the time.
"""

from __future__ import annotations

import argparse
import json
import queue
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from builders.tritonserver import Ports, ServerOptions, TritonServer
from client.grpc_streams import end_sync_stream
from tests.server.tiny_models import TICKER, relay_allocating, streaming_repository, with_tick

pytestmark = pytest.mark.server

pytest.importorskip("tvm_ffi", reason="relay's stub imports it to print a segfault's trace into the log")

TOKENS = 16  # per stream: a stream's responses are what its iterator frees


@dataclass
class Stress:
    retire_s: float | None  # None: BlsCaller's RETIRE_S
    seconds: float
    streams_finished: int
    errors: list[str]
    crash_lines: list[str]  # PROBLEM_MARKERS lines of the server log (a stub crash, an exit timeout)
    stop: str
    log: str


def stress(folder: Path, retire_s: float | None, seconds: float, concurrency: int = 16) -> Stress:
    """Keep ``concurrency`` relay streams going for ``seconds``; then stop the server and read its log."""
    repository = streaming_repository(
        folder / "repo", {"ticker": with_tick(TICKER, 0.0), "relay": relay_allocating(retire_s)}
    )
    log = folder / "server.log"
    server = TritonServer(ServerOptions(repository, Ports.free(), exit_timeout_s=10), log).start()
    finished, errors = 0, []
    try:
        server.wait_ready(timeout_s=120)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        answers: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        count = grpcclient.InferInput("text_input", [1], "BYTES")
        count.set_data_from_numpy(np.array([str(TOKENS).encode()], dtype=np.object_))
        in_flight, deadline = 0, time.monotonic() + seconds
        while time.monotonic() < deadline and len(errors) < 5:
            for _ in range(concurrency - in_flight):
                client.async_stream_infer("relay", [count], enable_empty_final_response=True)
                in_flight += 1
            try:
                result, error = answers.get(timeout=30)
            except queue.Empty:
                errors.append("no response for 30 s")
                break
            if error is not None:
                errors.append(str(error))
                in_flight -= 1
            elif result.get_response().parameters["triton_final_response"].bool_param:
                in_flight -= 1
                finished += 1
        end_sync_stream(client, finished=in_flight == 0)  # never a cancel after the final (Triton 2.51's leak)
        client.close()
    finally:
        report = server.stop()
    crash_lines = list(report.problems) if report else []  # the log's PROBLEM_MARKERS lines
    return Stress(retire_s, seconds, finished, errors, crash_lines, report.describe() if report else "", str(log))


def test_relay_stays_healthy_through_many_finished_streams(tmp_path: Path) -> None:
    result = stress(tmp_path, None, seconds=45)
    assert not result.errors and not result.crash_lines, asdict(result)
    assert result.streams_finished >= 50, asdict(result)


def main() -> None:
    parser = argparse.ArgumentParser(description="relay stress with and without retiring finished BLS iterators")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        for retire_s in (0.0, None):  # interleaved: the same machine state for both
            name = "default" if retire_s is None else f"{retire_s:g}"
            result = stress(args.out / f"retire-{name}-run{i}", retire_s, args.seconds)
            print(f"RETIRE_S={name} run {i}: {result.streams_finished} streams, errors {result.errors[:2]}, "
                  f"crash lines {result.crash_lines[:2]}", flush=True)
            runs.append(asdict(result))
    (args.out / "runs.json").write_text(json.dumps(runs, indent=1))
    table = ["| RETIRE_S | run | streams finished | errors | crash lines (first) | stop |",
             "|---|---|---:|---:|---|---|"]
    for i, run in enumerate(runs):
        first = run["crash_lines"][0][:80] if run["crash_lines"] else ""
        name = "default (10)" if run["retire_s"] is None else f"{run['retire_s']:g}"
        table.append(f"| {name} | {i // 2} | {run['streams_finished']} | {len(run['errors'])} | "
                     f"{first} | {run['stop'].splitlines()[0][:80]} |")
    (args.out / "runs.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()

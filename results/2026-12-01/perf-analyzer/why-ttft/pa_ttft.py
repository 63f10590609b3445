"""Run: PYTHONPATH=. .venv/bin/python results/2026-12-01/perf-analyzer/why-ttft/pa_ttft.py OUT_DIR ROUNDS
(starts its own llm-only server; hold a server slot).

Why perf_analyzer's first response and the harness's TTFT differ on llm: interleaved rounds on one
server, each round: perf_analyzer c=1; harness as is (aio, stream per request); a persistent-stream
sync client (one stream, clock right before async_stream_infer, time taken in the gRPC callback);
the harness's aio client but with one stream kept open for all requests."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.perf_analyzer import write_inputs
from bench.perf_analyzer_run import perf_analyzer_command, read_run
from bench.perf_analyzer_tool import locate
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer

OUT = Path(sys.argv[1])
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3


def load() -> float:
    return os.getloadavg()[0]


def med(xs):
    return statistics.median(xs) if xs else None


async def harness(url, requests, reps):
    from bench.loadgen import closed_loop
    from bench.metrics import e2e_s, ttft_s
    from bench.triton_target import TritonGrpcTarget

    target = TritonGrpcTarget(url)
    try:
        prepared = [target.prepare(r, "llm") for r in requests]
        records = []
        for _ in range(reps):
            records += (await closed_loop(lambda p: target.send("llm", p, 600), prepared, 1, 600, lambda: None)).records
    finally:
        await target.close()
    ok = [r for r in records if r.ok]
    return [ttft_s(r) * 1e3 for r in ok], [e2e_s(r) * 1e3 for r in ok], len(records) - len(ok)


async def harness_one_stream(url, requests, reps):
    """The harness's aio client and tensors, one stream for all requests (like perf_analyzer)."""
    import tritonclient.grpc.aio as grpcaio

    from bench.triton_target import TritonGrpcTarget

    target = TritonGrpcTarget(url)
    prepared = [target.prepare(r, "llm") for r in requests]
    await target.close()
    client = grpcaio.InferenceServerClient(url)
    outbox: asyncio.Queue = asyncio.Queue()

    async def gen():
        while True:
            item = await outbox.get()
            if item is None:
                return
            yield item

    firsts, lasts = [], []
    responses = client.stream_infer(gen()).__aiter__()
    for _ in range(reps):
        for i, p in enumerate(prepared):
            started = time.perf_counter()
            await outbox.put({"model_name": "llm", "inputs": p.inputs, "request_id": str(i)})
            first = None
            while True:
                result, error = await responses.__anext__()
                t = (time.perf_counter() - started) * 1e3
                assert error is None, error
                resp = result.get_response()
                if len(resp.outputs) and first is None:
                    first = t
                final = resp.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    break
            firsts.append(first)
            lasts.append(t)
    await outbox.put(None)
    await client.close()
    return firsts, lasts


def sync_one_stream(url, requests, reps):
    """tritonclient's sync gRPC client, one stream; times taken in the callback thread."""
    import tritonclient.grpc as grpcclient

    from client.epd_client import build_inputs

    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)

    def cb(result, error):
        events.put((time.perf_counter(), result, error))

    client.start_stream(callback=cb)
    inputs = [build_inputs(grpcclient, r.prompt, r.images, True, r.sampling, True) for r in requests]
    firsts, lasts = [], []
    for _ in range(reps):
        for i, inp in enumerate(inputs):
            started = time.perf_counter()
            client.async_stream_infer("llm", inp, request_id=str(i))
            first = None
            while True:
                t, result, error = events.get(timeout=600)
                assert error is None, error
                resp = result.get_response()
                if len(resp.outputs) and first is None:
                    first = (t - started) * 1e3
                final = resp.parameters.get("triton_final_response")
                if final is None or final.bool_param:
                    break
            firsts.append(first)
            lasts.append((t - started) * 1e3)
    client.stop_stream()
    client.close()
    return firsts, lasts


def pa_run(tool, url, inputs, out, count):
    out.mkdir(parents=True, exist_ok=True)
    cmd = perf_analyzer_command(tool, "llm", url, inputs, 1, False, out, count)
    done = subprocess.run(cmd, env=tool.env(), capture_output=True, text=True, timeout=600)
    (out / "stdout.txt").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stdout[-2000:]
    exported = json.loads((out / "profile.json").read_text())
    reqs = [r for e in exported["experiments"] for r in e["requests"]]
    firsts = [(r["response_timestamps"][0] - r["timestamp"]) / 1e6 for r in reqs if r["response_timestamps"]]
    lasts = [(r["response_timestamps"][-1] - r["timestamp"]) / 1e6 for r in reqs if r["response_timestamps"]]
    return firsts, lasts, read_run(out)


def main():
    import argparse

    from bench.cli import _workload_arguments, _workload_spec
    from bench.workload import WorkloadBuilder

    p = argparse.ArgumentParser()
    _workload_arguments(p)
    args = p.parse_args(["--output-tokens", "16", "--image-size", "128x96"])
    spec = _workload_spec(args)
    requests = WorkloadBuilder(spec).build(8, spec.reuse_ratio, phase="perf_analyzer")
    tool, reason = locate()
    assert tool, reason
    from builders.launcher import prepare

    repository = REPO_ROOT / "model_repository"
    prepare("cpu", None, repository)
    OUT.mkdir(parents=True, exist_ok=True)
    opts = ServerOptions(repository, Ports.free(), extra_args=("--model-control-mode=explicit", "--load-model=llm"))
    results = {"rounds": []}
    with TritonServer(opts, OUT / "server.log") as server:
        server.wait_ready(timeout_s=900)
        url = server.grpc_url
        write_inputs(requests, OUT / "inputs", ["llm"], "binary", None, url)
        inputs = OUT / "inputs" / "llm.json"
        # warm-up: every entry once with each client
        asyncio.run(harness(url, requests, 1))
        sync_one_stream(url, requests, 1)
        for rnd in range(ROUNDS):
            row = {}
            for name in ("pa", "harness", "sync1", "aio1"):
                l0 = load()
                t0 = time.time()
                if name == "pa":
                    f, last, run = pa_run(tool, url, inputs, OUT / f"pa-r{rnd}", 8)
                    row["pa_csv_p50"] = run["p50_latency_ms"]
                elif name == "harness":
                    f, last, errors = asyncio.run(harness(url, requests, 3))
                elif name == "sync1":
                    f, last = sync_one_stream(url, requests, 3)
                else:
                    f, last = asyncio.run(harness_one_stream(url, requests, 3))
                row[name] = {"first": f, "last": last, "first_p50": med(f), "last_p50": med(last),
                             "n": len(f), "load": [l0, load()], "wall_s": time.time() - t0}
                print(f"round {rnd} {name}: n={len(f)} first p50 {med(f):.1f} last p50 {med(last):.1f} "
                      f"load {l0:.1f}", flush=True)
            results["rounds"].append(row)
            (OUT / "exp.json").write_text(json.dumps(results, indent=1))
    for name in ("pa", "harness", "sync1", "aio1"):
        f = [x for r in results["rounds"] for x in r[name]["first"]]
        last = [x for r in results["rounds"] for x in r[name]["last"]]
        print(f"ALL {name}: n={len(f)} first p50 {med(f):.1f} last p50 {med(last):.1f}")


if __name__ == "__main__":
    main()

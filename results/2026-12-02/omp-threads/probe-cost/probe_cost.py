"""Where a lone disaggregated request's CPU goes on a server serving colocated traffic (issue 14).

Path benchmark runs 14 and 16: a repetition of `epd:adaptive:unique` at c=4 with one
disaggregated probe in 24 requests used 80-140 ms more server CPU per request than one without,
~2-3 s for one probe, while a disaggregated request costs ~450-650 ms of CPU at steady load.
This starts the cpu target's server (as `python -m bench run` does), then per round: 24
colocated requests at c=4, a quiet second, one request alone on a path (disaggregated, then
colocated for comparison) and 3 s after it, reading each server process's CPU time (by role:
builders/stage_watch.py) around every phase. With ``beside``: per round, 24 colocated requests
at c=4, then the same with one disaggregated request sent beside them (the probe under load).

    .venv/bin/python results/2026-12-02/omp-threads/probe-cost/probe_cost.py OUT_DIR [ROUNDS] [alone|beside]
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import psutil

from bench.loadgen import closed_loop
from bench.triton_target import TritonGrpcTarget
from bench.workload import WorkloadBuilder, WorkloadSpec
from builders.launcher import prepare
from builders.stage_watch import server_processes
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer


def cpu_by_role(server_pid: int) -> dict[str, float]:
    times: dict[str, float] = {}
    for process in server_processes(server_pid):
        try:
            cpu = psutil.Process(process.pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        times[process.role] = times.get(process.role, 0.0) + cpu.user + cpu.system
    return times


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {role: round((after[role] - before.get(role, 0.0)) * 1000) for role in after
            if after[role] - before.get(role, 0.0) >= 0.005}


async def main(out: Path, rounds: int, beside: bool) -> None:
    repository = REPO_ROOT / "model_repository"
    prepare("cpu", None, repository)
    out.mkdir(parents=True, exist_ok=True)
    builder = WorkloadBuilder(WorkloadSpec(tokenizer=REPO_ROOT / "build/models/tiny-qwen2-vl/tokenizer.json"))
    rows = []
    with TritonServer(ServerOptions(repository, Ports.free()), out / "server.log") as server:
        server.wait_ready(timeout_s=900)
        pid = server.process.pid
        target = TritonGrpcTarget(server.grpc_url)

        async def run(path: str, count: int, concurrency: int, key: int) -> list:
            requests = builder.build(count, 0.0, "measure", 9, key, namespace=f"probe-{path}/")
            items = [target.prepare(r, "epd", parameters={"path": path}) for r in requests]
            result = await closed_loop(lambda item: target.send("epd", item, 120.0), items, concurrency, 600.0,
                                       lambda: None)
            return result.records

        await run("colocated", 8, 4, 10_000)  # warm both paths
        await run("disaggregated", 4, 2, 10_001)
        for r in range(rounds if beside else 0):
            for with_probe in (False, True):
                start = cpu_by_role(pid)
                t0 = time.perf_counter()
                load = run("colocated", 24, 4, 20_000 + 2 * r + with_probe)
                if with_probe:
                    records, probe = await asyncio.gather(load, run("disaggregated", 1, 1, 30_000 + r))
                else:
                    records, probe = await load, []
                wall_ms = (time.perf_counter() - t0) * 1000
                after = cpu_by_role(pid)
                await asyncio.sleep(3.0)
                row = {"round": r, "probe_beside": with_probe, "wall_ms": round(wall_ms),
                       "colocated_e2e_ms_p50": round(sorted(x.chunk_times[-1] for x in records)[12] * 1000),
                       "probe_e2e_ms": [round(x.chunk_times[-1] * 1000) for x in probe],
                       "cpu_ms": delta(start, after), "cpu_ms_total": sum(delta(start, after).values())}
                print(json.dumps(row), flush=True)
                rows.append(row)
                await asyncio.sleep(1.0)
        for r in range(0 if beside else rounds):
            for alone in ("disaggregated", "colocated"):
                phases = {}
                start = cpu_by_role(pid)
                records = await run("colocated", 24, 4, 2 * r + (alone == "colocated") * 1000)
                after_load = cpu_by_role(pid)
                await asyncio.sleep(1.0)
                quiet = cpu_by_role(pid)
                t0 = time.perf_counter()
                (one,) = await run(alone, 1, 1, 5000 + 2 * r + (alone == "colocated"))
                e2e_ms = (time.perf_counter() - t0) * 1000
                after_one = cpu_by_role(pid)
                await asyncio.sleep(3.0)
                later = cpu_by_role(pid)
                phases["24 colocated at c=4"] = delta(start, after_load)
                phases["1 s quiet"] = delta(after_load, quiet)
                phases[f"1 {alone} alone"] = delta(quiet, after_one)
                phases["3 s after it"] = delta(after_one, later)
                row = {"round": r, "alone": alone, "alone_e2e_ms": round(e2e_ms), "alone_error": one.error,
                       "load_errors": sum(x.error is not None for x in records), "cpu_ms": phases}
                print(json.dumps(row), flush=True)
                rows.append(row)
        await target.close()
    (out / "rounds.json").write_text(json.dumps(rows, indent=1) + "\n")
    if server.stop_report is not None:
        print(server.stop_report.describe())


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 4, sys.argv[3:] == ["beside"]))

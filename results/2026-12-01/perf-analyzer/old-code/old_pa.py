"""Old code (issue 15's time): start its server, run perf_analyzer on epd at c=2 as the issue did, and
the replay of perf_analyzer's pattern (current bench.perf_analyzer_replay, client-only)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

OLD = Path(__file__).resolve().parent
NEW = Path(os.environ.get("NEW", "/work/wt/clients"))
OUT = Path(sys.argv[1])
TRIES = min(int(sys.argv[2]) if len(sys.argv) > 2 else 3, 2)
sys.path.insert(0, str(OLD))

import builders.repository as repo  # noqa: E402
from python_backends.launcher import prepare  # noqa: E402
from python_backends.tritonserver import Ports, ServerOptions, TritonServer  # noqa: E402

tag = os.environ.get("TAG", "old")
cpu = repo.TARGETS["cpu"]
repo.TARGETS["cpu"] = dataclasses.replace(
    cpu,
    cache=dataclasses.replace(cpu.cache, path=f"/dev/shm/clients-{tag}-store"),
    pd=dataclasses.replace(cpu.pd, kv_store_path=f"/dev/shm/clients-{tag}-kv"),
)
repository = OLD / "model_repository"
OUT.mkdir(parents=True, exist_ok=True)
prepare("cpu", None, repository)
pa = NEW / "build/tools/perf_analyzer"
env = dict(os.environ, LD_LIBRARY_PATH=f"{pa}/lib")
py = str(NEW / ".venv/bin/python")


def newpy(args, **kw):
    return subprocess.run([py, *args], env=dict(os.environ, PYTHONPATH=str(NEW)), capture_output=True, text=True, **kw)


with TritonServer(ServerOptions(repository, Ports.free()), OUT / "server.log") as server:
    server.wait_ready(timeout_s=420)
    url = server.grpc_url
    metrics = f"http://127.0.0.1:{server.options.ports.metrics}/metrics"
    # the old generator with its defaults (8 entries, 640x480 JPEG, 32 output tokens), as the issue ran it
    done = subprocess.run([sys.executable, "-m", "client.bench", "perf-analyzer-inputs", "--out", str(OUT / "inputs"),
                           "--models", "epd", "--url", url], capture_output=True, text=True, cwd=OLD,
                          env=dict(os.environ, PYTHONPATH=str(OLD)))
    print(done.stdout[-500:], done.stderr[-2000:], flush=True)
    inputs = OUT / "inputs" / "epd.json"
    summary = []
    for i in range(TRIES):
        for mode, extra in (("time", ["--measurement-interval", "10000"]),
                            ("count", ["--measurement-mode", "count_windows", "--measurement-request-count", "8",
                                       "--max-trials", "3", "--stability-percentage", "1000"])):
            run = OUT / f"pa-{mode}-{i}"
            run.mkdir(exist_ok=True)
            cmd = [str(pa / "bin/perf_analyzer"), "-m", "epd", "-i", "grpc", "-u", url, "--streaming", "--input-data",
                   str(inputs), "--concurrency-range", "2", *extra, "-f", str(run / "report.csv"),
                   "--profile-export-file", str(run / "profile.json")]
            t0 = time.time()
            try:
                d = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90)
                rc, text = d.returncode, d.stdout + d.stderr
            except subprocess.TimeoutExpired as exc:
                rc, text = "timeout", (exc.stdout or b"").decode() + (exc.stderr or b"").decode()
            (run / "stdout.txt").write_text(" ".join(cmd) + "\n" + text)
            m = subprocess.run(["curl", "-s", metrics], capture_output=True, text=True).stdout
            counts = [ln for ln in m.splitlines() if ln.startswith("nv_inference_request_") and 'model="epd"' in ln]
            line = {"run": run.name, "rc": rc, "s": round(time.time() - t0, 1), "failed": "Failed to retrieve" in text,
                    "no_valid": "No valid requests" in text, "counters": counts}
            print(json.dumps(line), flush=True)
            summary.append(line)
        for c in (2, 4):
            code = ("import json,sys; from bench.perf_analyzer_replay import replay; "
                    f"r=replay({url!r}, 'epd', {str(inputs)!r}, {c}, 4, None, 60); "
                    "print(json.dumps({'problems': r.problems(), 'traces': len(r.traces)}))")
            d = newpy(["-c", code], timeout=300)
            line = {"run": f"replay-c{c}-{i}", "rc": d.returncode, "out": d.stdout[-3000:], "err": d.stderr[-1500:]}
            print(json.dumps(line), flush=True)
            summary.append(line)
    (OUT / "summary.json").write_text(json.dumps(summary, indent=1))

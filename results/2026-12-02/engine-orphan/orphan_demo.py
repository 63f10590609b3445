"""SIGKILL llm's stub on a running server (no launcher watch); does its vLLM engine core exit?"""
import json, os, signal, sys, time
from pathlib import Path
from builders.tritonserver import Ports, ServerOptions, TritonServer

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
repo = Path(sys.argv[2])

def procs():
    rows = {}
    for e in Path("/proc").iterdir():
        if e.name.isdigit():
            try:
                stat = (e / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (e / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            rows[int(e.name)] = (int(stat[1]), stat[0], cmd)
    return rows

server = TritonServer(ServerOptions(repo, Ports.free(), exit_timeout_s=60), out / "server.log").start()
report = {}
try:
    server.wait_ready(timeout_s=900)
    p = procs()
    stub = next(pid for pid, (_, _, cmd) in p.items() if "triton_python_backend_stub" in cmd and " llm_0_0 " in cmd)
    cores = [pid for pid, (ppid, _, cmd) in p.items() if ppid == stub and "EngineCore" in cmd]
    report.update(stub=stub, engine_cores=cores)
    os.kill(stub, signal.SIGKILL)
    t0 = time.monotonic()
    gone_at = None
    while time.monotonic() - t0 < 30:
        alive = [pid for pid in cores if pid in (q := procs()) and q[pid][1] != "Z"]
        if not alive:
            gone_at = time.monotonic() - t0
            break
        time.sleep(0.1)
    report.update(engine_core_gone_after_s=gone_at, still_alive_after_30s=None if gone_at is not None else alive)
finally:
    stop = server.stop()
    report["stop"] = stop.describe() if stop else None
(out / "report.json").write_text(json.dumps(report, indent=1))
print(json.dumps(report, indent=1))

import asyncio, json, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, "/work/main/results/2026-12-02/omp-threads/probe-cost")
from probe_cost import *  # noqa
from builders.stage_watch import find_role

async def go(out: Path):
    repository = REPO_ROOT / "model_repository"
    prepare("cpu", None, repository)
    out.mkdir(parents=True, exist_ok=True)
    builder = WorkloadBuilder(WorkloadSpec(tokenizer=REPO_ROOT / "build/models/tiny-qwen2-vl/tokenizer.json"))
    with TritonServer(ServerOptions(repository, Ports.free()), out / "server.log") as server:
        server.wait_ready(timeout_s=900)
        pid = server.process.pid
        target = TritonGrpcTarget(server.grpc_url)
        async def run(path, count, concurrency, key):
            requests = builder.build(count, 0.0, "measure", 9, key, namespace=f"spy-{path}/")
            items = [target.prepare(r, "epd", parameters={"path": path}) for r in requests]
            return (await closed_loop(lambda item: target.send("epd", item, 120.0), items, concurrency, 600.0, lambda: None)).records
        await run("colocated", 8, 4, 1)
        await run("disaggregated", 4, 1, 2)
        decode = find_role(pid, "engine:decode"); epd = find_role(pid, "engine:epd")
        for name, which in (("decode-alone", None), ("decode-beside", 1)):
            import psutil
            print(name, "threads decode", psutil.Process(decode).num_threads(), "epd", psutil.Process(epd).num_threads(),
                  "affinity", psutil.Process(decode).cpu_affinity(), psutil.Process(epd).cpu_affinity(), flush=True)
            spy = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "499", "-g", "-o", str(out / f"{name}.data"),
                                    "-p", f"{decode},{epd}", "--", "sleep", "8"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 9:
                if which:
                    await asyncio.gather(run("colocated", 12, 4, int(t0) % 1000 + 10), run("disaggregated", 2, 1, int(t0) % 1000 + 20))
                else:
                    await run("disaggregated", 2, 1, int(t0 * 10) % 10000 + 30)
            spy.wait()
            print(name, "done", flush=True)
        await target.close()

asyncio.run(go(Path(sys.argv[1])))

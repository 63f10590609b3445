"""Native stacks of the EngineCore while it exits, and of this process during its own exit."""
import os, subprocess, sys, threading, time
from pathlib import Path

REPO = Path(sys.argv[1])
PYSPY = str(Path(__file__).resolve().parents[1] / "tools/pyspy/py_spy-0.4.2.data/scripts/py-spy")
T0 = time.monotonic()
def say(msg):
    print(f"[{time.monotonic()-T0:7.2f}] {msg}", flush=True)

def watch(pid, label, out, until_dead=True, period=0.3, limit=12.0):
    start = time.monotonic()
    while time.monotonic() - start < limit:
        try:
            os.kill(pid, 0)
        except OSError:
            break
        r = subprocess.run([PYSPY, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True)
        out.append(f"--- {label} t+{time.monotonic()-start:.2f}s\n{r.stdout[-3000:]}{r.stderr[-300:]}")
        time.sleep(period)

def main():
    import psutil
    from python_backends.event_loop import EventLoopThread
    from python_backends.llm_engine import LlmEngine, apply_vllm_environment, load_engine_args
    apply_vllm_environment({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    args = load_engine_args(REPO / "llm/1/engine_args.json")
    loop = EventLoopThread()
    engine = loop.run(LlmEngine.start(args))
    from vllm import SamplingParams
    async def one():
        async for out in engine.engine.generate({"prompt": "hello there"}, SamplingParams(max_tokens=8), "r1"):
            pass
    loop.run(one())
    core = [p for p in psutil.Process().children(recursive=True) if "EngineCore" in p.name()][0]
    dumps = []
    t = threading.Thread(target=watch, args=(core.pid, "core", dumps), daemon=True)
    start = time.monotonic()
    t.start()
    say("shutdown begins")
    loop.stop()
    engine.shutdown()
    say(f"shutdown returned after {time.monotonic()-start:.2f}s")
    t.join()
    print("\n".join(dumps), flush=True)
    # this process's own exit, watched from outside
    subprocess.Popen([sys.executable, __file__, "--watch", str(os.getpid())])
    time.sleep(0.5)
    say("main returns")

if __name__ == "__main__":
    if sys.argv[1] == "--watch":
        out = []
        watch(int(sys.argv[2]), "self-exit", out, period=0.25, limit=15)
        print("\n".join(out), flush=True)
    else:
        main()

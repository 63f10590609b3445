"""Where does an llm engine's shutdown spend its time? (issue 17, not a test)

Starts LlmEngine like the llm model does (same engine args and VLLM_* env), serves one request,
then shuts down in the order finalize uses (ORDER=current) or engine-first-on-the-loop
(ORDER=loop), dumping the EngineCore process's stacks with py-spy while it tears down.
"""
import json, os, subprocess, sys, threading, time
from pathlib import Path

REPO = Path(sys.argv[1])
ORDER = os.environ.get("ORDER", "current")
PYSPY = str(Path(__file__).resolve().parents[1] / "tools/pyspy/py_spy-0.4.2.data/scripts/py-spy")
T0 = time.monotonic()
def say(msg):
    print(f"[{time.monotonic()-T0:7.2f}] {msg}", flush=True)

def main():
    import psutil
    from python_backends.event_loop import EventLoopThread
    from python_backends.llm_engine import LlmEngine, apply_vllm_environment, load_engine_args
    apply_vllm_environment({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    args = load_engine_args(REPO / "llm/1/engine_args.json")
    loop = EventLoopThread()
    engine = loop.run(LlmEngine.start(args))
    say("engine started")
    from vllm import SamplingParams
    async def one():
        out = None
        async for out in engine.engine.generate({"prompt": "hello there"}, SamplingParams(max_tokens=8), "r1"):
            pass
        return out.outputs[0].token_ids
    say(f"generated {loop.run(one())}")
    core = [p for p in psutil.Process().children(recursive=True)]
    say(f"children: {[(p.pid, p.name()) for p in core]}")
    dumps = []
    def spy():
        for delay in (0.5, 1.5, 3.0, 4.5):
            time.sleep(delay - (time.monotonic() - start))
            for p in core:
                if p.is_running():
                    r = subprocess.run([PYSPY, "dump", "--pid", str(p.pid)], capture_output=True, text=True)
                    dumps.append(f"--- t+{delay}s pid {p.pid}\n{r.stdout}{r.stderr}")
    start = time.monotonic()
    threading.Thread(target=spy, daemon=True).start()
    say(f"shutdown begins, order={ORDER}")
    if ORDER == "current":
        loop.stop()
        engine.shutdown()
    elif ORDER == "loop":
        async def down():
            engine.shutdown()
        loop.run(down())
        loop.stop()
    say(f"shutdown returned after {time.monotonic()-start:.2f}s; children alive: {[p.pid for p in core if p.is_running() and p.status()!='zombie']}")
    time.sleep(5.0)
    print("\n".join(dumps), flush=True)
    say("main returns; interpreter finalization next")

if __name__ == "__main__":
    main()

"""An llm engine's unload, old order vs new, in one process each: shutdown time and process exit."""
import gc, os, sys, time
from pathlib import Path

REPO = Path(sys.argv[1]); MODE = sys.argv[2]
T0 = time.monotonic()
def say(msg): print(f"[{MODE} {time.monotonic()-T0:7.2f}] {msg}", flush=True)

def main():
    from python_backends.event_loop import EventLoopThread
    from python_backends.llm_engine import LlmEngine, apply_vllm_environment, load_engine_args
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if MODE == "new":
        env["VLLM_EPD_ENGINE_EXIT_GRACE_S"] = "2"
    apply_vllm_environment(env)
    loop = EventLoopThread()
    engine = loop.run(LlmEngine.start(load_engine_args(REPO / "llm/1/engine_args.json")))
    from vllm import SamplingParams
    async def one():
        async for out in engine.engine.generate({"prompt": "hello there"}, SamplingParams(max_tokens=8), "r1"):
            pass
    loop.run(one())
    start = time.monotonic()
    if MODE == "old":
        loop.stop(); engine.shutdown()
    else:
        loop.stop(last=engine.shutdown); gc.freeze()
    say(f"SHUTDOWN {time.monotonic()-start:.2f}s")
    print(f"EXITSTART {time.time():.3f}", flush=True)

if __name__ == "__main__":
    main()

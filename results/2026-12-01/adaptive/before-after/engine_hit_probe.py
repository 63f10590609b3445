"""Where does a colocated hit's time go inside vLLM? Same engine, same prompt, three inputs:
media (llm's way), embeddings + multi_modal_uuids (epd colocated's way), embeddings without uuid.
Reports TTFT and num_cached_tokens per request, interleaved."""
import asyncio
import json
import os
import statistics
import sys
import time

os.environ.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
sys.path.insert(0, os.getcwd())  # run from the repository root


async def main():
    import numpy as np
    import torch
    from PIL import Image
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from client.epd_client import chat_prompt

    args = json.load(open("model_repository/epd/1/engine_args.json"))
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (480, 640, 3), dtype=np.uint8))
    grid = (1, 24, 24)
    embeds = torch.from_numpy(rng.standard_normal((144, 128)).astype(np.float32))
    prompt = chat_prompt("Describe this picture in detail please, word by word.", 1)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    def mm(kind):
        p = {"prompt": prompt}
        if kind == "media":
            p["multi_modal_data"] = {"image": [img]}
        else:
            p["multi_modal_data"] = {"image": {"image_embeds": embeds.clone(), "image_grid_thw": torch.tensor([grid])}}
            if kind == "embeds+uuid":
                p["multi_modal_uuids"] = {"image": ["k" * 32]}
        return p

    results = {k: [] for k in ("media", "embeds+uuid", "embeds")}
    n = 0
    for rnd in range(9):
        for kind in results:
            n += 1
            t0 = time.perf_counter()
            ttft = None
            cached = None
            async for out in engine.generate(mm(kind), params, f"r{n}"):
                if ttft is None:
                    ttft = (time.perf_counter() - t0) * 1000
                    cached = out.num_cached_tokens
            e2e = (time.perf_counter() - t0) * 1000
            results[kind].append((ttft, cached, e2e))
            print(f"round {rnd} {kind:12s} ttft {ttft:7.1f} ms cached {cached} e2e {e2e:7.1f}", flush=True)
    for kind, rows in results.items():
        warm = rows[1:]
        ttft_p50 = statistics.median(r[0] for r in warm)
        e2e_p50 = statistics.median(r[2] for r in warm)
        print(f"{kind:12s} median TTFT {ttft_p50:.1f} ms, cached {[r[1] for r in rows]}, median e2e {e2e_p50:.1f}")
    engine.shutdown()

if __name__ == "__main__":
    asyncio.run(main())

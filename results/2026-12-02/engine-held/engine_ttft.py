"""One vLLM engine (the cpu target's llm engine args), no Triton: time to first token of the same
640x480 JPEG repeated, by the form its image takes (issue 14, epd's colocated path):

- media+uuid: decoded here each time, as llm does (llm sends no uuid: vLLM hashes the pixels);
- embeds+uuid: precomputed embeddings of the image's grid, as epd sends a store hit;
- none+uuid: None under a uuid the engine's processor cache holds (epd: media the engine holds).

Rounds interleave the forms; every form's prompt is served from the prefix cache alike (128 of
250 tokens). Run: PYTHONPATH=. VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
.venv/bin/python results/2026-12-02/engine-held/engine_ttft.py [ROUNDS]
"""

import asyncio
import io
import json
import statistics
import sys
import time

import numpy as np
import torch
from PIL import Image

ARGS = "model_repository/llm/1/engine_args.json"
PROMPT = "<|vision_start|><|image_pad|><|vision_end|>Describe the picture in a few words, please."
GRID = (1, 26, 36)  # what Qwen2-VL's processor makes of 640x480 with the tiny model's config
FORMS = ("media+uuid", "embeds+uuid", "none+uuid")


def jpeg(seed: int) -> bytes:
    pixels = (np.random.default_rng(seed).random((480, 640, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return buffer.getvalue()


async def main(rounds: int) -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**json.load(open(ARGS))))
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    data = jpeg(1)
    embeds = torch.randn(GRID[1] * GRID[2] // 4, 128)

    def prompt(form: str) -> dict:
        if form == "media+uuid":
            image = Image.open(io.BytesIO(data)).convert("RGB")
            return {"prompt": PROMPT, "multi_modal_data": {"image": [image]}, "multi_modal_uuids": {"image": ["m"]}}
        if form == "none+uuid":  # "m" is held once media+uuid ran
            return {"prompt": PROMPT, "multi_modal_data": {"image": [None]}, "multi_modal_uuids": {"image": ["m"]}}
        mm = {"image_embeds": embeds.clone(), "image_grid_thw": torch.tensor([GRID])}
        return {"prompt": PROMPT, "multi_modal_data": {"image": mm}, "multi_modal_uuids": {"image": ["e"]}}

    async def ttft_ms(form: str, request_id: str) -> tuple[float, int]:
        start = time.perf_counter()
        request = prompt(form)
        first, cached = None, 0
        async for output in engine.generate(request, params, request_id):
            if first is None:
                first, cached = time.perf_counter(), output.num_cached_tokens
        return (first - start) * 1000, cached

    for i in range(3):  # warm every cache
        for form in FORMS:
            await ttft_ms(form, f"warm-{form}-{i}")
    samples: dict[str, list[float]] = {form: [] for form in FORMS}
    cached: dict[str, set[int]] = {form: set() for form in FORMS}
    for i in range(rounds):
        for form in FORMS:
            ms, tokens = await ttft_ms(form, f"{form}-{i}")
            samples[form].append(ms)
            cached[form].add(tokens)
    print(f"| form | TTFT p50 ms | p10 | p90 | prefix-cached tokens |\n|---|---:|---:|---:|---|")
    for form, values in samples.items():
        deciles = statistics.quantiles(values, n=10)
        print(f"| {form} | {statistics.median(values):.1f} | {deciles[0]:.1f} | {deciles[-1]:.1f} | {sorted(cached[form])} |")
    engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 100))

"""Greedy tokens from offline vLLM (``vllm.LLM``) for the parity test.

Run as a script (vLLM spawns processes, so it needs the __main__ guard):
``python tests/server/offline_vllm.py cases.json out.json``. It uses the engine args and
engine environment (the ``cpu`` target's: KV cache size, one torch thread) the server uses and
the same prompt and image handling as the ``llm`` model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from builders.targets import TARGETS
from builders.tritonserver import REPO_ROOT
from python_backends.engines.llm import apply_vllm_environment, load_engine_args
from python_backends.request.generate import with_image_placeholders
from python_backends.request.images import ImageLimits, decode_images


def main(cases_path: Path, out_path: Path) -> None:
    from vllm import LLM, SamplingParams

    apply_vllm_environment(TARGETS["cpu"].role_environment("llm"))
    engine_args = load_engine_args(REPO_ROOT / "model_repository" / "llm" / "1" / "engine_args.json")
    llm = LLM(**engine_args)
    cases = json.loads(cases_path.read_text())
    results = []
    for case in cases:
        images = decode_images([Path(p).read_bytes() for p in case["images"]], ImageLimits())
        prompt: dict = {"prompt": with_image_placeholders(case["prompt"], len(images))}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        output = llm.generate([prompt], SamplingParams(**case["sampling"]), use_tqdm=False)[0]
        results.append(list(output.outputs[0].token_ids))
    out_path.write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))

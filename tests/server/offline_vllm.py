"""Greedy tokens from offline vLLM (``vllm.LLM``) for the parity test.

Run as a script (vLLM spawns processes, so it needs the __main__ guard):
``python tests/server/offline_vllm.py cases.json out.json [engine_args.json]``. It uses the engine
args (model_repository's ``llm``, or the file given) and engine environment (the ``cpu`` target's:
KV cache size, one torch thread) the server uses and the same prompt, image and audio handling
as the ``llm`` model. A case has ``prompt``, ``sampling`` and ``images`` or ``audios`` (paths).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from builders.targets import TARGETS
from builders.tritonserver import REPO_ROOT
from python_backends.engines.llm import apply_vllm_environment, load_engine_args
from python_backends.request.audios import AudioLimits, decode_audio
from python_backends.request.generate import with_audio_placeholders, with_image_placeholders
from python_backends.request.images import ImageLimits, decode_images

DEFAULT_ENGINE_ARGS = REPO_ROOT / "model_repository" / "llm" / "1" / "engine_args.json"
AUDIO_RATE = 16_000  # the tiny Qwen2-Audio's feature extractor's


def main(cases_path: Path, out_path: Path, engine_args_path: Path = DEFAULT_ENGINE_ARGS) -> None:
    from vllm import LLM, SamplingParams

    apply_vllm_environment(TARGETS["cpu"].role_environment("llm"))
    llm = LLM(**load_engine_args(engine_args_path))
    cases = json.loads(cases_path.read_text())
    results = []
    for case in cases:
        images = decode_images([Path(p).read_bytes() for p in case.get("images", [])], ImageLimits())
        audios = [
            (decode_audio(Path(p).read_bytes(), i, AudioLimits(), AUDIO_RATE), AUDIO_RATE)
            for i, p in enumerate(case.get("audios", []))
        ]
        text = with_audio_placeholders(case["prompt"], len(audios))
        prompt: dict = {"prompt": with_image_placeholders(text, len(images))}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        if audios:
            prompt["multi_modal_data"] = {"audio": audios}
        output = llm.generate([prompt], SamplingParams(**case["sampling"]), use_tqdm=False)[0]
        results.append(list(output.outputs[0].token_ids))
    out_path.write_text(json.dumps(results))


if __name__ == "__main__":
    main(*(Path(arg) for arg in sys.argv[1:4]))

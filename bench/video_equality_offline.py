"""Do video embeddings made our way give vLLM's greedy tokens? An offline check (one vLLM engine,
no Triton) of the data path issue 16's `epd` will use, before any model serves video.

For each prompt (1 video, 2 videos, 1 video + 1 image), greedy tokens from three inputs:

- ``raw``: the clip's bytes through vLLM's own Qwen2-VL video loader (what ``llm`` will do);
- ``dali``: the ``cpu`` target's preprocess pixels (:mod:`python_backends.preprocess.videos`:
  the sampled frames decoded with OpenCV as vLLM's loader does since issue 16 step 1,
  DALI's CPU decoder before; DALI resize + normalize) -> the ONNX vision encoder (the one
  ``vit_encoder`` serves) -> ``video_embeds`` + ``video_grid_thw`` (``enable_mm_embeds``);
- ``vllm-pixels``: vLLM's loader + transformers' processor pixels -> the same ONNX encoder, which
  separates the encoder from the decoders' pixel differences.

Starts a vLLM engine (``python -m bench.video_equality_offline --out DIR``): on a shared machine,
run it when no test server is up. Writes ``results.json`` and ``results.md``.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    from builders.targets import TARGETS
    from python_backends.engines.llm import apply_vllm_environment

    apply_vllm_environment(TARGETS["cpu"].role_environment("llm"))  # the server's llm engine's

    import torch
    from PIL import Image
    from transformers import AutoVideoProcessor
    from vllm import LLM, SamplingParams
    from vllm.multimodal.video import Qwen2VLVideoBackend

    from builders.default_model import build_default_model
    from builders.encoder import export_onnx, load_vision_tower
    from python_backends.encode.vit_onnx import OnnxVisionEncoder
    from python_backends.preprocess.video_pipeline import VideoTransformConfig
    from python_backends.preprocess.videos import DaliVideoPreprocessor
    from tests.images import synthetic_image
    from tests.videos import ClipSpec, make_clip

    model_dir = build_default_model()
    with tempfile.TemporaryDirectory() as scratch:
        encoder = OnnxVisionEncoder(export_onnx(load_vision_tower(model_dir), Path(scratch)))
    transform = VideoTransformConfig.from_file(model_dir)
    dali = DaliVideoPreprocessor.for_config(transform)
    processor = AutoVideoProcessor.from_pretrained(str(model_dir))

    clips = [
        make_clip(spec)
        for spec in (
            ClipSpec("vp9", 160, 120, 10, 2.0, seed=1),
            ClipSpec("vp8", 320, 240, 30, 3.0, seed=2),
            ClipSpec("mjpeg", 176, 144, 5, 8.0, seed=3),
            ClipSpec("vp9", 640, 360, 25, 4.0, seed=4),
            ClipSpec("vp8", 96, 200, 24, 2.0, seed=5),
            ClipSpec("mjpeg", 256, 256, 15, 3.0, seed=6),
        )
    ]
    image = Image.open(io.BytesIO(synthetic_image(320, 240, seed=7))).convert("RGB")
    cases: list[dict[str, Any]] = [
        {"name": f"1 video ({i})", "videos": [i], "image": False, "text": "Describe the video."} for i in range(5)
    ]
    cases += [
        {"name": "2 videos (0, 3)", "videos": [0, 3], "image": False, "text": "Compare the videos."},
        {"name": "2 videos (5, 2)", "videos": [5, 2], "image": False, "text": "Compare the videos."},
        {"name": "1 video + 1 image", "videos": [1], "image": True, "text": "Video and picture?"},
        {"name": "1 video (5) + 1 image", "videos": [5], "image": True, "text": "What moves?"},
    ]

    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=4096,
        enforce_eager=True,
        seed=0,
        limit_mm_per_prompt={"image": 1, "video": 2},
        enable_mm_embeds=True,
    )
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def embeds_input(pixels: np.ndarray, grid: np.ndarray) -> dict[str, Any]:
        embeds = np.concatenate(encoder.encode(pixels, grid))
        return {"video_embeds": torch.from_numpy(embeds), "video_grid_thw": torch.from_numpy(grid)}

    results = []
    for case in cases:
        data = [clips[i] for i in case["videos"]]
        placeholders = (IMAGE_PLACEHOLDER if case["image"] else "") + VIDEO_PLACEHOLDER * len(data)
        prompt = f"<|im_start|>user\n{placeholders}{case['text']}<|im_end|>\n<|im_start|>assistant\n"
        extra = {"image": [image]} if case["image"] else {}

        raw_videos = [Qwen2VLVideoBackend.load_bytes(clip) for clip in data]
        ours = dali.preprocess(data)
        reference = processor(videos=[frames for frames, _ in raw_videos], return_tensors="np")
        inputs = {
            "raw": {"video": raw_videos, **extra},
            "dali": {"video": embeds_input(ours.pixel_values_videos, ours.video_grid_thw), **extra},
            "vllm-pixels": {
                "video": embeds_input(
                    np.asarray(reference["pixel_values_videos"]), np.asarray(reference["video_grid_thw"])
                ),
                **extra,
            },
        }
        tokens = {}
        for name, mm_data in inputs.items():
            output = llm.generate([{"prompt": prompt, "multi_modal_data": mm_data}], sampling, use_tqdm=False)[0]
            tokens[name] = list(output.outputs[0].token_ids)
        row = {
            "case": case["name"],
            "frames": ours.frame_indices,
            "video_grid_thw": ours.video_grid_thw.tolist(),
            "tokens": tokens,
            "dali_equals_raw": tokens["dali"] == tokens["raw"],
            "vllm_pixels_equal_raw": tokens["vllm-pixels"] == tokens["raw"],
        }
        print(json.dumps(row), flush=True)
        results.append(row)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        "# Video: greedy tokens from our embeddings vs vLLM's raw video (offline vLLM, tiny model)",
        "",
        f"`python -m bench.video_equality_offline --out {args.out}`; {args.max_tokens} greedy tokens.",
        "",
        "| prompt | video_grid_thw | DALI embeds == raw | vLLM-pixel embeds == raw |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['case']} | {r['video_grid_thw']} | {r['dali_equals_raw']} | {r['vllm_pixels_equal_raw']} |"
        for r in results
    ]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark video preprocessing on this machine, in one run (not a test): encoded clip ->
``pixel_values_videos`` + ``video_grid_thw``.

- ``dali-cpu``: :class:`python_backends.preprocess.videos.DaliVideoPreprocessor` (the probe, the
  sampler, OpenCV decode of the sampled frames as vLLM's loader does, DALI resize + normalize,
  numpy patch layout; before issue 16 step 1 DALI's CPU decoder decoded);
- ``vllm``: what the ``llm`` model does with raw video: vLLM's ``Qwen2VLVideoBackend.load_bytes``
  (OpenCV decode + fps sampling) then transformers' ``Qwen2VLVideoProcessor``.

Both produce the same frames (tests/unit/test_video_parity.py). Clips are generated with PyAV
(``tests/videos.py``), one per codec the CPU decoder reads, including a 10 s 1280x720 one.
Frames/s counts the *sampled* frames each path returns (what the encoder sees); the decoder
decodes more (every frame up to the last sampled one, for inter-coded streams).

Writes ``results.json`` and ``results.md`` under ``--results`` (default
results/latest/video-preprocess).

    python -m bench.video_preprocess [--repeats 3] [--results DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS = REPO_ROOT / "results" / "latest" / "video-preprocess"


@dataclass(frozen=True)
class ClipTiming:
    clip: str
    bytes: int
    total_frames: int
    sampled_frames: int
    grid_thw: list[int]
    implementation: str
    seconds_per_clip: float  # best of the repeats: the machine is shared, noise only adds
    median_seconds_per_clip: float
    sampled_frames_per_second: float


def _time(call: Callable[[], object], repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return samples


def run(repeats: int, model_dir: Path) -> list[ClipTiming]:
    from transformers import AutoVideoProcessor
    from vllm.multimodal.video import Qwen2VLVideoBackend

    from python_backends.preprocess.video_pipeline import VideoTransformConfig
    from python_backends.preprocess.videos import DaliVideoPreprocessor
    from python_backends.request.videos import VideoLimits
    from tests.videos import ClipSpec, make_clip

    specs = (
        ClipSpec("vp9", 1280, 720, 30, 10.0, seed=1),
        ClipSpec("vp8", 1280, 720, 30, 10.0, seed=2),
        ClipSpec("mjpeg", 1280, 720, 30, 10.0, seed=3),
        ClipSpec("vp9", 640, 360, 25, 10.0, seed=4),
        ClipSpec("vp9", 320, 240, 60, 4.0, seed=5),
    )
    transform = VideoTransformConfig.from_file(model_dir)
    dali = DaliVideoPreprocessor.for_config(transform, limits=VideoLimits(max_video_bytes=1 << 30), max_batch_size=1)
    processor = AutoVideoProcessor.from_pretrained(str(model_dir))
    timings: list[ClipTiming] = []
    for spec in specs:
        data = make_clip(spec)
        ours = dali.preprocess([data])  # warm-up, and the shape for the report
        sampled = len(ours.frame_indices[0])
        grid = [int(v) for v in ours.video_grid_thw[0]]

        def vllm_path(data: bytes = data) -> object:
            frames, _ = Qwen2VLVideoBackend.load_bytes(data)
            return processor(videos=[frames], return_tensors="np")

        vllm_path()
        for name, call in (("dali-cpu", lambda data=data: dali.preprocess([data])), ("vllm", vllm_path)):
            samples = _time(call, repeats)
            best = min(samples)
            timings.append(
                ClipTiming(
                    spec.name,
                    len(data),
                    spec.num_frames,
                    sampled,
                    grid,
                    name,
                    best,
                    statistics.median(samples),
                    sampled / best,
                )
            )
            print(f"{spec.name} {name}: {best * 1000:.1f} ms/clip, {sampled / best:.1f} sampled frames/s", flush=True)
    return timings


def write_results(timings: list[ClipTiming], out: Path, repeats: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "load_average": os.getloadavg()}
    (out / "results.json").write_text(
        json.dumps({"machine": machine, "repeats": repeats, "timings": [asdict(t) for t in timings]}, indent=2) + "\n"
    )
    by_clip: dict[str, dict[str, ClipTiming]] = {}
    for timing in timings:
        by_clip.setdefault(timing.clip, {})[timing.implementation] = timing
    lines = [
        "# Video preprocessing: DALI (CPU) vs vLLM's loader + transformers' processor",
        "",
        f"`python -m bench.video_preprocess --repeats {repeats}`; best of {repeats} per clip; "
        f"{machine['cpus']} CPUs, load average at the end {machine['load_average'][0]:.1f} (shared machine).",
        "",
        "| clip | bytes | frames (total / sampled) | video_grid_thw | DALI ms/clip | vLLM ms/clip "
        "| DALI frames/s | vLLM frames/s | DALI / vLLM speed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for clip, pair in by_clip.items():
        dali, vllm = pair["dali-cpu"], pair["vllm"]
        lines.append(
            f"| {clip} | {dali.bytes} | {dali.total_frames} / {dali.sampled_frames} | {dali.grid_thw} "
            f"| {dali.seconds_per_clip * 1000:.1f} | {vllm.seconds_per_clip * 1000:.1f} "
            f"| {dali.sampled_frames_per_second:.1f} | {vllm.sampled_frames_per_second:.1f} "
            f"| {vllm.seconds_per_clip / dali.seconds_per_clip:.2f}x |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: the tiny default model)")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    args = parser.parse_args(argv)
    if args.model is None:
        from builders.default_model import build_default_model

        args.model = build_default_model()
    timings = run(args.repeats, args.model)
    write_results(timings, args.results, args.repeats)
    print(f"wrote {args.results}/results.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

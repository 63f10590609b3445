"""What enabling video on a vLLM engine costs at start-up (issue 16): wall time and peak RSS.

vLLM profiles start-up memory with the largest dummy multimodal input ``limit_mm_per_prompt``
allows, so adding ``"video": N`` there changes every engine that gets it. This starts ``llm``'s
engine (the cpu target's engine args and environment, the default model) in a fresh process per
run, images only and with video, alternating, and writes one JSON line per run.

    PYTHONPATH=$PWD .venv/bin/python -m bench.video_engine_start \\
        --repeats 2 --results results/2026-12-01/video-engine-start

Each run: the seconds ``vllm.LLM(...)`` takes (imports excluded: they are done before the
clock starts), the process's peak RSS (the engine core runs in-process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as the target sets it) and vLLM's own start-up log lines
about profiling and the encoder cache.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import time
from pathlib import Path
from typing import Any


def _start(label: str, extra_limits: dict[str, int], queue: Any) -> None:
    from builders.default_model import build_default_model
    from builders.model_configs import checkpoint_positions
    from builders.targets import TARGETS
    from python_backends.engines.llm import apply_vllm_environment

    target = TARGETS["cpu"]
    apply_vllm_environment(target.role_environment("llm"))
    import vllm  # imported before the clock starts

    model_dir = build_default_model()
    args = target.engine_args_for("llm", checkpoint_positions(model_dir))
    args["limit_mm_per_prompt"] = {**args["limit_mm_per_prompt"], **extra_limits}
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.perf_counter()
    llm = vllm.LLM(model=str(model_dir), enable_mm_embeds=True, **args)
    seconds = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    del llm
    queue.put(
        {
            "config": label,
            "limit_mm_per_prompt": args["limit_mm_per_prompt"],
            "engine_start_s": round(seconds, 2),
            "peak_rss_mib_before_engine": round(rss_before, 1),
            "peak_rss_mib": round(rss, 1),
        }
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-videos", type=int, default=2, help="the video limit llm is generated with")
    parser.add_argument("--results", type=Path, required=True)
    args = parser.parse_args(argv)
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / "runs.jsonl"
    context = multiprocessing.get_context("spawn")
    configs = [("images only", {}), (f"images + video {args.max_videos}", {"video": args.max_videos})]
    with out.open("w") as handle:
        for repeat in range(args.repeats):
            for label, extra in configs:
                queue = context.Queue()
                process = context.Process(target=_start, args=(label, extra, queue))
                process.start()
                row = {"repeat": repeat, **queue.get(timeout=900)}
                process.join(timeout=120)
                print(json.dumps(row), flush=True)
                handle.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: server cold start (launch -> ready) and first-request latency.

Not a test: it writes ``cold_start.json`` and ``cold_start.md`` under ``--out``. In
the same run it measures two baselines so the numbers read as ratios on a noisy,
shared machine: tritonserver with no model (the server's own floor) and vLLM's
offline ``LLM()`` start in a plain Python process (what any vLLM user pays).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from builders.launcher import SAMPLE_IMAGE, prepare
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer
from client.epd_client import GrpcClient, chat_prompt

OFFLINE_START = textwrap.dedent(
    """
    import json, os, sys, time
    t0 = time.perf_counter()
    if __name__ == "__main__":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM
        args = json.load(open(sys.argv[1]))
        llm = LLM(**args)
        print("COLD_START " + json.dumps({"ready_s": time.perf_counter() - t0}), flush=True)
    """
)


def time_server(repository: Path, log_path: Path, with_request: bool) -> dict[str, float]:
    started = time.perf_counter()
    with TritonServer(ServerOptions(repository, Ports.free()), log_path) as server:
        server.wait_ready(timeout_s=900)
        result = {"ready_s": time.perf_counter() - started}
        if with_request:
            client = GrpcClient(server.grpc_url, "llm")
            sent = time.perf_counter()
            answer = client.generate(
                chat_prompt("What is in this picture?", 1),
                [SAMPLE_IMAGE.read_bytes()],
                {"max_tokens": 16, "temperature": 0.0},
            )
            result["first_request_ttft_s"] = answer.chunk_times[0] - sent
            result["first_request_e2e_s"] = answer.chunk_times[-1] - sent
            client.close()
    return result


def time_offline_vllm(engine_args_path: Path) -> dict[str, float]:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(OFFLINE_START)
    out = subprocess.run(
        [sys.executable, script.name, str(engine_args_path)], capture_output=True, text=True, check=True, timeout=900
    )
    marked = [line for line in out.stdout.splitlines() if line.startswith("COLD_START ")]
    return json.loads(marked[-1].removeprefix("COLD_START "))


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "latest" / "cold_start")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    repository = REPO_ROOT / "model_repository"
    prepare("cpu", None, repository)
    empty = Path(tempfile.mkdtemp(prefix="empty-repo-"))

    llm_runs, floor_runs, offline_runs = [], [], []
    logs = REPO_ROOT / "build" / "bench-logs"
    for i in range(args.repeat):
        llm_runs.append(time_server(repository, logs / f"cold-start-llm-{i}.log", with_request=True))
        floor_runs.append(time_server(empty, logs / f"cold-start-floor-{i}.log", with_request=False))
        offline_runs.append(time_offline_vllm(repository / "llm" / "1" / "engine_args.json"))
        print(f"run {i}: llm {llm_runs[-1]}, floor {floor_runs[-1]}, offline vLLM {offline_runs[-1]}", flush=True)

    llm, floor, offline = median_of(llm_runs), median_of(floor_runs), median_of(offline_runs)
    summary = {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, {_cpu_count()} cores",
        "repeat": args.repeat,
        "triton_llm": llm,
        "triton_no_model": floor,
        "offline_vllm": offline,
        "ratios": {
            "llm_ready_vs_offline_vllm_start": llm["ready_s"] / offline["ready_s"],
            "llm_ready_minus_triton_floor_s": llm["ready_s"] - floor["ready_s"],
        },
        "target": "llm ready <= 30 s on a 2-core machine",
        "runs": {"triton_llm": llm_runs, "triton_no_model": floor_runs, "offline_vllm": offline_runs},
    }
    (args.out / "cold_start.json").write_text(json.dumps(summary, indent=2))
    (args.out / "cold_start.md").write_text(_markdown(summary))
    print(_markdown(summary))
    return 0


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _markdown(s: dict) -> str:
    llm, floor, offline = s["triton_llm"], s["triton_no_model"], s["offline_vllm"]
    return (
        f"# Cold start ({s['machine']}, median of {s['repeat']})\n\n"
        "| what | seconds |\n|---|---|\n"
        f"| tritonserver + `llm` (vLLM, tiny Qwen2-VL): launch -> ready | {llm['ready_s']:.1f} |\n"
        f"| first request (image + text, 16 tokens): TTFT | {llm['first_request_ttft_s']:.3f} |\n"
        f"| first request: end to end | {llm['first_request_e2e_s']:.3f} |\n"
        f"| tritonserver with no model: launch -> ready | {floor['ready_s']:.1f} |\n"
        f"| offline `vllm.LLM(...)` in a plain process | {offline['ready_s']:.1f} |\n\n"
        f"Ratio `llm` ready / offline vLLM start: {s['ratios']['llm_ready_vs_offline_vllm_start']:.2f}. "
        f"Target: {s['target']}.\n"
    )


if __name__ == "__main__":
    sys.exit(main())

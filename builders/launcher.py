"""``triton-epd-serve``: build what is missing, start tritonserver, wait until ready.

Builds the default model and the repository for the target when they are missing,
starts a real ``tritonserver --model-repository model_repository`` (the NGC image's if
it is on PATH, else the pytriton wheel's), prints the endpoints and serves until
Ctrl-C. ``--demo`` instead answers one bundled image+text request and stops.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer

SAMPLE_IMAGE = REPO_ROOT / "client" / "samples" / "sample.jpg"
SAMPLE_PROMPT = "What is in this picture?"


def prepare(target: str, model: Path | None, repository: Path, cache: Any = None) -> Path:
    """Default model (or the given checkpoint) + generated repository; returns the model dir.
    ``cache``: a ``builders.repository.CachePolicy`` replacing the target's."""
    from builders.default_model import build_default_model, resolve_model  # noqa: PLC0415
    from builders.repository import write_repository  # noqa: PLC0415

    model_dir = resolve_model(model) if model else build_default_model()
    write_repository(target, model_dir, repository, cache=cache)
    return model_dir


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--model", type=Path, help="a Qwen2-VL checkpoint dir (default: the tiny built-in one)")
    parser.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--log-file", type=Path, help="tritonserver log (default: the terminal)")
    parser.add_argument("--demo", action="store_true", help="answer the bundled sample request, then stop")
    from builders.repository import add_cache_arguments  # noqa: PLC0415 - light, no torch

    add_cache_arguments(parser)
    return parser.parse_args(argv)


def run_demo(server: TritonServer) -> int:
    from client.epd_client import ClientError, GrpcClient, chat_prompt  # noqa: PLC0415

    client = GrpcClient(server.grpc_url, "llm")
    print(f"\n>>> prompt: {SAMPLE_PROMPT!r} + image {SAMPLE_IMAGE.name}")
    print(">>> answer: ", end="", flush=True)
    try:
        result = client.generate(
            chat_prompt(SAMPLE_PROMPT, 1),
            [SAMPLE_IMAGE.read_bytes()],
            {"max_tokens": 24, "temperature": 0.0},
            on_text=lambda text: print(text, end="", flush=True),
        )
    except ClientError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(f"\n>>> {result.num_input_tokens} input tokens, {result.num_output_tokens} output tokens "
          f"(random weights: the text is meaningless, the pipeline is real)")
    return 0


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    from builders.repository import cache_policy_from  # noqa: PLC0415

    model_dir = prepare(args.target, args.model, args.model_repository, cache_policy_from(args, args.target))
    ports = Ports(args.http_port, args.grpc_port, args.metrics_port)
    server = TritonServer(ServerOptions(args.model_repository, ports), args.log_file)
    print(f"model: {model_dir}\nstarting: {' '.join(server.command())}", flush=True)
    # SIGTERM (docker stop, systemd) stops as cleanly as Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)
    with server:
        try:
            waited = server.wait_ready()
            print(
                f"ready in {waited:.1f} s ({time.monotonic() - started:.1f} s with builds)\n"
                f"  HTTP    http://{server.http_url}\n  gRPC    {server.grpc_url}\n"
                f"  metrics {server.metrics_url}",
                flush=True,
            )
            if args.demo:
                return run_demo(server)
            print("serving; Ctrl-C to stop", flush=True)
            while server.process is not None and server.process.poll() is None:
                time.sleep(0.5)
            return server.process.returncode if server.process else 1
        except KeyboardInterrupt:
            print("\nstopping", flush=True)
            return 0


if __name__ == "__main__":
    sys.exit(main())

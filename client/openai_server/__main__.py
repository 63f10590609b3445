"""``python -m client.openai_server``: serve the OpenAI-compatible API in front of a running Triton.

    python -m client.openai_server --triton-grpc-url localhost:8001 --model-dir <checkpoint> --port 9000

``--model-dir`` is the checkpoint Triton serves (its tokenizer's chat template renders the prompts);
``--media-dir`` lets ``file://`` image, video and audio URLs read files under that folder (off by default).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from client.openai_server.prompt import MediaPolicy
from client.openai_server.triton_backend import CHAT_MODELS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triton-grpc-url", default="localhost:8001")
    parser.add_argument("--model-dir", type=Path, required=True, help="the checkpoint Triton serves")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--models", nargs="+", default=list(CHAT_MODELS), help="Triton models served by name")
    parser.add_argument("--media-dir", type=Path, help="folder that file:// media URLs may read (default: none)")
    parser.add_argument("--max-image-bytes", type=int, default=MediaPolicy.max_image_bytes)
    parser.add_argument("--max-video-bytes", type=int, default=MediaPolicy.max_video_bytes)
    parser.add_argument("--max-audio-bytes", type=int, default=MediaPolicy.max_audio_bytes)
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import uvicorn

    from client.openai_server.app import create_app
    from client.openai_server.prompt import ChatRenderer
    from client.openai_server.triton_backend import TritonChatBackend

    policy = MediaPolicy(args.media_dir, args.max_image_bytes, args.max_video_bytes, args.max_audio_bytes)
    renderer = ChatRenderer.from_checkpoint(args.model_dir, policy)
    app = create_app(TritonChatBackend(args.triton_grpc_url, args.models), renderer)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``triton-epd-client``: send a prompt, images and audio files to a running triton-epd server.

``triton-epd-client sign-tenant --secret-file PATH TENANT`` prints the token that names TENANT to a
deployment with that tenant secret (the ``tenant`` request parameter it then requires; Python code
calls ``python_backends.request.tenants.sign_tenant``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from client.epd_client import DEFAULT_MODEL, ClientError, GrpcClient, HttpClient, chat_prompt
from python_backends.request.tenants import TenantSecretError, read_tenant_secret, sign_tenant

SIGN_TENANT = "sign-tenant"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", help="the question or instruction")
    parser.add_argument("--image", action="append", type=Path, default=[], help="image file (repeatable)")
    parser.add_argument(
        "--audio", action="append", type=Path, default=[], help="audio file: WAV, FLAC, MP3, Ogg (repeatable; llm)"
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="llm, ensemble or epd")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--url", help="host:port (default localhost:8001 for gRPC, localhost:8000 for HTTP)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--sampling", default="{}", help='extra sampling parameters as JSON, e.g. {"temperature": 0}')
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat format")
    parser.add_argument("--show-tokens", action="store_true", help="also print token ids and counts")
    return parser.parse_args(argv)


def sign_tenant_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"triton-epd-client {SIGN_TENANT}", description="print a signed tenant token")
    parser.add_argument("--secret-file", type=Path, required=True, help="the deployment's tenant secret (mode 600)")
    parser.add_argument("tenant")
    args = parser.parse_args(argv)
    try:
        print(sign_tenant(read_tenant_secret(args.secret_file), args.tenant))
    except TenantSecretError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [SIGN_TENANT]:
        return sign_tenant_main(argv[1:])
    args = parse_args(argv)
    try:
        images = [path.read_bytes() for path in args.image]
        audios = [path.read_bytes() for path in args.audio]
        sampling = {"max_tokens": args.max_tokens, **json.loads(args.sampling)}
    except (OSError, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prompt = args.prompt if args.raw else chat_prompt(args.prompt, len(images), len(audios))
    try:
        if args.protocol == "grpc":
            client = GrpcClient(args.url or "localhost:8001", args.model)
            client.check_ready()
            result = client.generate(
                prompt, images, sampling, on_text=lambda t: print(t, end="", flush=True), audios=audios
            )
            print()
        else:
            client = HttpClient(args.url or "localhost:8000", args.model)
            client.check_ready()
            result = client.generate(prompt, images, sampling, audios=audios)
            print(result.text)
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.show_tokens:
        print(
            f"[{result.num_input_tokens} input tokens, {result.num_output_tokens} output tokens, "
            f"finish_reason={result.finish_reason}] token_ids={result.token_ids}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

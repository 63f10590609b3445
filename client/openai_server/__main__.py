"""``python -m client.openai_server``: serve the OpenAI-compatible API in front of a running Triton.

    python -m client.openai_server --triton-grpc-url localhost:8001 --model-dir <checkpoint> --port 9000

``--model-dir`` is the checkpoint Triton serves (its tokenizer's chat template renders the prompts);
``--media-dir`` lets ``file://`` image, video and audio URLs read files under that folder (off by default).
``--api-key KEY`` (repeatable; or ``TRITON_EPD_API_KEY``, else ``VLLM_API_KEY``) and ``--api-keys-file
PATH`` (``KEY TENANT`` lines, re-read when it changes and on SIGHUP) make every route but ``/health``
need ``Authorization: Bearer KEY`` (``auth.py``). ``--tenant-secret-file PATH`` (or
``TRITON_EPD_TENANT_SECRET_FILE``): the deployment's tenant secret; the tenant is then sent to Triton
signed (``python_backends/request/tenants.py``). It binds 127.0.0.1 unless ``--host`` says otherwise.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
from pathlib import Path

from client.openai_server.auth import ApiKeys, KeysError, configured_keys
from client.openai_server.limits import add_limit_arguments, serve, server_limits
from client.openai_server.prompt import MediaPolicy
from client.openai_server.triton_backend import CHAT_MODELS
from python_backends.request.tenants import TENANT_SECRET_FILE_ENV, TenantSecretError, read_tenant_secret


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
    parser.add_argument(
        "--api-key",
        action="extend",
        nargs="+",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health (one or more, repeatable, as "
        "vllm serve takes them; default: "
        "$TRITON_EPD_API_KEY, comma-separated, else $VLLM_API_KEY); these keys name no tenant",
    )
    parser.add_argument(
        "--api-keys-file",
        type=Path,
        metavar="PATH",
        help="keys with their tenants, one 'KEY TENANT' per line ('-': no tenant), mode 600; "
        "re-read when it changes and on SIGHUP",
    )
    parser.add_argument(
        "--tenant-secret-file",
        type=Path,
        metavar="PATH",
        help="the deployment's tenant secret (mode 600, the file Triton's models read): sign the tenant sent "
        f"to Triton with it (default: ${TENANT_SECRET_FILE_ENV}; none: the tenant is sent as a plain name)",
    )
    parser.add_argument("--log-level", default="info")
    add_limit_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from client.openai_server.app import create_app
    from client.openai_server.prompt import ChatRenderer
    from client.openai_server.triton_backend import TritonChatBackend

    api_keys = api_keys_from(args)
    if api_keys is None:
        return 2
    try:
        tenant_secret = tenant_secret_from(args)
    except TenantSecretError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    policy = MediaPolicy(args.media_dir, args.max_image_bytes, args.max_video_bytes, args.max_audio_bytes)
    renderer = ChatRenderer.from_checkpoint(args.model_dir, policy)
    app = create_app(TritonChatBackend(args.triton_grpc_url, args.models), renderer, api_keys, tenant_secret)
    if api_keys.keys_file is not None:
        signal.signal(signal.SIGHUP, api_keys.handle_sighup)
    serve(app, args.host, args.port, args.log_level, server_limits(args, policy))
    return 0


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def tenant_secret_from(args: argparse.Namespace, environ: dict[str, str] | None = None) -> bytes | None:
    """The secret of ``--tenant-secret-file``, else of ``$TRITON_EPD_TENANT_SECRET_FILE``; None
    when neither names a file. TenantSecretError when the file cannot be used."""
    path = args.tenant_secret_file or (os.environ if environ is None else environ).get(TENANT_SECRET_FILE_ENV)
    if path is None:
        return None
    if not str(path):  # set but empty: refuse rather than send unsigned tenants
        raise TenantSecretError(f"{TENANT_SECRET_FILE_ENV} is set but names no file")
    secret = read_tenant_secret(path)
    print("tenant secret read: tenants are sent to Triton signed", file=sys.stderr, flush=True)
    return secret


def api_keys_from(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ApiKeys | None:
    """The keys the command line and environment configure (printed: how many, never which), or
    None after printing why the server cannot start with them."""
    try:
        keys = configured_keys(args.api_key, os.environ if environ is None else environ)
        api_keys = ApiKeys(keys, args.api_keys_file)
    except KeysError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return None
    static, in_file = api_keys.counts
    if api_keys.enabled:
        where = f" + {in_file} from {args.api_keys_file}" if args.api_keys_file is not None else ""
        print(f"API keys: {static}{where}; every route but /health needs one", file=sys.stderr, flush=True)
    elif not is_loopback(args.host):
        print(
            f"warning: serving on {args.host} with no API key: anyone who reaches it may use it and name "
            "any tenant (--api-key / --api-keys-file)",
            file=sys.stderr,
            flush=True,
        )
    return api_keys


if __name__ == "__main__":
    raise SystemExit(main())

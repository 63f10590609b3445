"""``triton-epd-serve``: build what is missing, start tritonserver, wait until ready.

Builds the default model and the repository for the target when they are missing,
starts a real ``tritonserver --model-repository model_repository`` (the NGC image's if
it is on PATH, else the pytriton wheel's), prints the endpoints and serves until
Ctrl-C or SIGTERM, then prints how the server stopped (``stopped: ...``). ``--demo`` instead
answers one bundled image+text request and stops.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from builders.access import (
    ADMIN_CATEGORIES,
    ADMIN_HEADER,
    PEER_HEADER,
    PEER_KEY_FILE_ENV,
    Access,
    KeyFileError,
    default_admin_key_file,
    load_or_create_key,
    read_key,
    redacted,
)
from builders.processes import ProcessGroup, StartError, StartTimeout, http_ok, wait_until_ready
from builders.roles import ROLES, Role, load_model_args, server_cpus
from builders.stage_watch import HUNG_AFTER_S, StageWatch
from builders.targets import target_named
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer
from python_backends import contract
from python_backends.request.tenants import TENANT_SECRET_FILE_ENV, TenantSecretError, read_tenant_secret
from python_backends.runtime.heartbeat import HEARTBEAT_DIR_ENV

SAMPLE_IMAGE = REPO_ROOT / "client" / "samples" / "sample.jpg"
SAMPLE_PROMPT = "What is in this picture?"


def prepare(
    target: str,
    model: Path | None,
    repository: Path,
    cache: Any = None,
    kv_store_path: str | None = None,
    role: Role = "all",
    gpus: int | None = None,
    remote_encoders: str = "",
    max_videos: int | None = None,
    engine_threads: int | None = None,
    cpus: Sequence[str] = (),
    colocated_encodes: str | None = None,
    path_policy: str | None = None,
    vit_precision: str | None = None,
    generation_config: str | None = None,
) -> Path:
    """Default model (or the given checkpoint) + generated repository; returns the model dir.
    ``cache``: a ``builders.repository.CachePolicy`` replacing the target's; ``kv_store_path``:
    the prefill/decode KV transfer folder replacing the target's; ``role``: write only that
    server role's models (``builders/roles.py``); ``gpus``: the gpu target's number of GPUs;
    ``max_videos``: videos per request (None: the target's; 0: no model declares ``video``);
    ``engine_threads``: OpenMP threads per vLLM engine (None: the target's; 0: torch's default);
    ``cpus``, ``colocated_encodes``, ``path_policy``, ``vit_precision``, ``generation_config``: as
    ``write_repository`` takes them."""
    from builders.default_model import build_default_model, resolve_model
    from builders.repository import write_repository

    model_dir = resolve_model(model) if model else build_default_model()
    write_repository(
        target, model_dir, repository, cache=cache, kv_store_path=kv_store_path, role=role, gpus=gpus,
        remote_encoders=remote_encoders, max_videos=max_videos, engine_threads=engine_threads, cpus=cpus,
        colocated_encodes=colocated_encodes, path_policy=path_policy, vit_precision=vit_precision,
        generation_config=generation_config,
    )
    return model_dir


def cache_policy(args: argparse.Namespace) -> Any:
    """The target's cache policy with the command line's overrides, or None for none."""
    from builders.repository import TARGETS, cache_policy_from

    policy = cache_policy_from(args, args.target)
    if args.cache_path is not None:
        policy = dataclasses.replace(policy or TARGETS[args.target].cache, path=str(args.cache_path))
    if args.node_id is not None:
        policy = dataclasses.replace(policy or TARGETS[args.target].cache, node_id=args.node_id)
    return policy


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--model", type=Path, help="a Qwen2-VL checkpoint dir (default: the tiny built-in one)")
    parser.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument("--role", choices=ROLES, default="all", help="serve this role's models (scale-out): "
                        "encoder = preprocess, vit_encoder, encode, encoder_<i> and the node store; "
                        "pd = epd, prefill, decode, llm; all (default) = every model, one server")
    parser.add_argument("--node-id", help="this server's node (default: 'local'); servers with the same node id "
                        "and store path share embeddings by reference")
    parser.add_argument("--remote-encoders", metavar="SPEC", help="pd role: epd's encoder servers, as "
                        "HOST:PORT,... or dns:NAME:PORT (re-resolved every few seconds) or file:PATH (re-read)")
    parser.add_argument("--host", default="127.0.0.1", help="tritonserver's HTTP, gRPC and metrics address "
                        "(default 127.0.0.1: this machine only; 0.0.0.0: every interface, e.g. in a container)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--log-file", type=Path, help="tritonserver log (default: the terminal)")
    parser.add_argument("--hung-stage-s", type=float, default=HUNG_AFTER_S, metavar="S",
                        help="stop the server (exit 3, like a crashed stage) when a python model's stub has run no "
                        f"Python for S seconds: a deadlock inside Triton's python backend (default {HUNG_AFTER_S:.0f}; "
                        "0: off, e.g. while a debugger holds a stub)")
    parser.add_argument("--exit-timeout-s", type=int, help="on stop, wait this long for in-flight requests and "
                        "model unloads before tritonserver gives up (default: Triton's, 30 s)")
    parser.add_argument("--demo", action="store_true", help="answer the bundled sample request, then stop")
    parser.add_argument("--check", action="store_true", help="gpu target: run the preflight checks (each failed "
                        "one with its fix) and exit; every gpu start runs them before tritonserver")
    parser.add_argument("--openai-port", type=int, help="also serve the OpenAI-compatible chat API on this port")
    parser.add_argument("--openai-host", default="127.0.0.1", help="the OpenAI API's address (default 127.0.0.1: "
                        "this machine only; 0.0.0.0: every interface, with --api-key or --api-keys-file)")
    parser.add_argument("--api-key", action="extend", nargs="+", metavar="KEY", help="the OpenAI API requires "
                        "'Authorization: Bearer KEY' (one or more, repeatable; default: $TRITON_EPD_API_KEY, else "
                        "$VLLM_API_KEY)")
    parser.add_argument("--api-keys-file", type=Path, metavar="PATH", help="the OpenAI API's keys with their "
                        "tenants, 'KEY TENANT' lines (client/openai_server/auth.py), re-read when it changes")
    parser.add_argument("--admin-key-file", type=Path, metavar="PATH", help="the key that opens Triton's admin "
                        f"APIs ({', '.join(ADMIN_CATEGORIES)}; header '{ADMIN_HEADER}'), generated there (0600) when "
                        "missing (default: $XDG_CONFIG_HOME/triton-epd/admin-key, else ~/.config/triton-epd/admin-key)")
    parser.add_argument("--open-admin-apis", nargs="*", choices=ADMIN_CATEGORIES, metavar="CATEGORY",
                        help="leave these admin categories (none named: all) open to every client that reaches the "
                        "ports, as Triton does by default; perf_analyzer 2.41 sends no header over gRPC and reads "
                        "model-config (add shared-memory for --shared-memory)")
    parser.add_argument("--peer-key-file", type=Path, metavar="PATH", help="encoder role: callers must send this "
                        f"key (header '{PEER_HEADER}'; every inference and the model configs); pd role: the key "
                        "sent to the encoder servers")
    parser.add_argument("--tenant-secret-file", type=Path, metavar="PATH", help="the 'tenant' request parameter "
                        "must be a token signed with this secret (python_backends/request/tenants.py); the OpenAI "
                        "API signs the tenants it sends")
    parser.add_argument("--path-policy", choices=contract.PATH_POLICIES,
                        help="epd's path policy (default: the target's, adaptive)")
    from builders.repository import (  # light, no torch
        add_cache_arguments,
        add_colocated_encodes_argument,
        add_cpus_argument,
        add_engine_threads_argument,
        add_generation_config_argument,
        add_gpus_argument,
        add_max_videos_argument,
        add_vit_precision_argument,
    )

    add_cache_arguments(parser)
    add_gpus_argument(parser)
    add_max_videos_argument(parser)
    add_engine_threads_argument(parser)
    add_cpus_argument(parser)
    add_colocated_encodes_argument(parser)
    add_vit_precision_argument(parser)
    add_generation_config_argument(parser)
    # Two servers on one node share a store and KV folder unless given their own (tests do).
    parser.add_argument("--cache-path", type=Path, help="embedding store directory (default: the target's)")
    parser.add_argument("--kv-store-path", type=Path, help="prefill->decode KV folder (default: the target's)")
    args = parser.parse_args(argv)
    if args.gpus is not None and args.target != "gpu":
        parser.error("--gpus is for --target gpu")
    if (args.api_key or args.api_keys_file) and args.openai_port is None:
        parser.error("--api-key and --api-keys-file are for the OpenAI API (--openai-port)")
    if args.peer_key_file is not None and args.role == "all":
        parser.error("--peer-key-file is for --role encoder (the key it requires) and --role pd (the key it sends)")
    if any(not key or "," in key or any(c.isspace() for c in key) for key in args.api_key or ()):
        parser.error("--api-key: a key has no whitespace or comma")
    return args


def openai_app(args: argparse.Namespace, model_dir: Path, server: TritonServer) -> ProcessGroup | None:
    """The OpenAI-compatible API (``client/openai_server``) in front of ``server``, not started;
    None without ``--openai-port``. Its log goes beside Triton's when there is one. ``--api-key``
    keys reach it in its environment (``TRITON_EPD_API_KEY``), not on its command line, which any
    local user may read; ``--host HOST --port PORT`` stay last (``serve`` reads them there)."""
    if args.openai_port is None:
        return None
    keys_file = ["--api-keys-file", str(args.api_keys_file.absolute())] if args.api_keys_file else []
    command = [sys.executable, "-m", "client.openai_server", "--triton-grpc-url", server.grpc_url,
               "--model-dir", str(model_dir), *keys_file, "--host", args.openai_host,
               "--port", str(args.openai_port)]  # fmt: skip
    env = {"TRITON_EPD_API_KEY": ",".join(args.api_key)} if args.api_key else {}
    if args.tenant_secret_file is not None:
        env[TENANT_SECRET_FILE_ENV] = str(args.tenant_secret_file.absolute())
    log_path = args.log_file.with_name("openai-server.log") if args.log_file else None
    return ProcessGroup("openai-server", command, env=env, log_path=log_path)


def demo_api_key(args: argparse.Namespace) -> str | None:
    """A key the OpenAI API accepts, for ``--demo``: the first ``--api-key``, else the keys file's first."""
    from client.openai_server.auth import parse_keys_file

    if args.api_key:
        return str(args.api_key[0])
    if args.api_keys_file is not None:
        return next(iter(parse_keys_file(args.api_keys_file.read_text(), str(args.api_keys_file))), None)
    return None


def run_demo(server: TritonServer, openai_url: str | None = None, api_key: str | None = None) -> int:
    """The sample request, greedy, to ``llm`` (one engine, raw image in) and to ``epd`` (encoder,
    store, its path): both must answer the same tokens."""
    from client.epd_client import ClientError, GenerateResult, GrpcClient, chat_prompt

    print(f"\n>>> prompt: {SAMPLE_PROMPT!r} + image {SAMPLE_IMAGE.name}, greedy (temperature 0)")
    answers: dict[str, GenerateResult] = {}
    for model in ("llm", "epd"):
        client = GrpcClient(server.grpc_url, model)
        print(f">>> {model}: ", end="", flush=True)
        try:
            answers[model] = client.generate(
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
        print()
    llm, epd = answers["llm"], answers["epd"]
    print(f">>> {llm.num_input_tokens} input tokens, {llm.num_output_tokens} output tokens "
          f"(random weights: the text is meaningless, the pipeline is real)")
    if epd.token_ids != llm.token_ids:
        print(f">>> epd's tokens differ from llm's: {epd.token_ids} vs {llm.token_ids}", file=sys.stderr)
        return 1
    print(f">>> epd answered the same {len(epd.token_ids)} tokens as llm")
    if openai_url is not None:  # the same question through the OpenAI API, with the official client
        from client.openai_server.demo import run as openai_demo

        return openai_demo(openai_url, expected=llm.text, api_key=api_key)
    return 0


class _Stopping:
    """SIGINT/SIGTERM handler: the first signal interrupts serving; later ones are ignored so
    that a second Ctrl-C cannot cut the stop short and orphan tritonserver."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, _frame: object) -> None:
        if self.requested:
            print(f"already stopping ({signal.Signals(signum).name} ignored)", flush=True)
            return
        self.requested = True
        raise KeyboardInterrupt


def install_stop_handlers() -> None:
    """Handle SIGINT and SIGTERM (docker stop, systemd) explicitly: Python installs no SIGINT
    handler in a process started with SIGINT ignored (``cmd &`` from a script, nohup)."""
    handler = _Stopping()
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    install_stop_handlers()
    started = time.monotonic()
    kv_store_path = str(args.kv_store_path) if args.kv_store_path else None
    if args.check:
        from builders.preflight import check_for_launch, print_report

        report = check_for_launch(args.target, args.model, args.model_repository, cache_policy(args), args.gpus)
        return 0 if print_report(report) else 1
    try:
        access, access_env = server_access(args)
    except (KeyFileError, TenantSecretError) as exc:
        print(f"error: {exc}", flush=True)
        return 1
    try:
        model_dir = prepare(
            args.target, args.model, args.model_repository, cache_policy(args), kv_store_path,
            role=args.role, gpus=args.gpus, remote_encoders=args.remote_encoders or "", max_videos=args.max_videos,
            engine_threads=args.engine_threads, cpus=args.cpus, colocated_encodes=args.colocated_encodes,
            path_policy=args.path_policy, vit_precision=args.vit_precision, generation_config=args.generation_config,
        )
    except KeyboardInterrupt:
        print("\ninterrupted while building; nothing was started", flush=True)
        return 130
    if args.target == "gpu":  # Triton would stop at the first model it cannot load, far from the cause
        from builders.preflight import check_for_launch, print_report

        report = check_for_launch(args.target, model_dir, args.model_repository, cache_policy(args), args.gpus)
        if not print_report(report):
            print("not starting tritonserver: fix the failed checks above", flush=True)
            return 1
    ports = Ports(args.http_port, args.grpc_port, args.metrics_port)
    role_args = load_model_args(target_named(args.target, cache_policy(args)), args.role)
    # Each stub beats in this folder (python_backends/runtime/heartbeat.py); the stage watch reads it.
    heartbeats = tempfile.mkdtemp(prefix="triton-epd-heartbeats-")
    options = ServerOptions(
        args.model_repository, ports, extra_args=(*role_args, *access.tritonserver_args()),
        exit_timeout_s=args.exit_timeout_s, extra_env={HEARTBEAT_DIR_ENV: heartbeats, **access_env},
        cpus=server_cpus(args.cpus), host=args.host,
    )
    try:
        return run_server(args, options, model_dir, started, access)
    finally:
        shutil.rmtree(heartbeats, ignore_errors=True)


def server_access(args: argparse.Namespace) -> tuple[Access, dict[str, str]]:
    """The server's :class:`~builders.access.Access` and the environment that hands its stubs the
    peer key (pd role) and the tenant secret, as file paths. Says where the admin key is, and the
    key itself once, when it was just generated. Raises ``KeyFileError``, ``TenantSecretError``."""
    env: dict[str, str] = {}
    admin_key = peer_key = None
    opened = set(ADMIN_CATEGORIES if args.open_admin_apis == [] else args.open_admin_apis or ())
    closed = tuple(category for category in ADMIN_CATEGORIES if category not in opened)
    if closed:
        path = (args.admin_key_file or default_admin_key_file()).absolute()
        admin_key, created = load_or_create_key(path)
        if created:
            print(f"admin key (shown once): {admin_key}\n  kept in {path} (0600); Triton's admin APIs "
                  f"({', '.join(closed)}) want it as header '{ADMIN_HEADER}'", flush=True)
        else:
            print(f"admin APIs ({', '.join(closed)}) closed: header '{ADMIN_HEADER}' with the key in {path}",
                  flush=True)
    if args.peer_key_file is not None:
        path = args.peer_key_file.absolute()
        if args.role == "encoder":
            peer_key = read_key(path)
        else:
            read_key(path)  # refuse a bad file here, not at the first encode
            env[PEER_KEY_FILE_ENV] = str(path)
    if args.tenant_secret_file is not None:
        read_tenant_secret(args.tenant_secret_file)  # refuse a bad file now, not at the model's load
        env[TENANT_SECRET_FILE_ENV] = str(args.tenant_secret_file.absolute())
    return Access(admin_key, peer_key, args.role, closed), env


def run_server(
    args: argparse.Namespace, options: ServerOptions, model_dir: Path, started: float, access: Access
) -> int:
    """Serve (``serve``), then stop and say how the server stopped; the launcher's exit code."""
    server = TritonServer(options, args.log_file)
    print(f"model: {model_dir}\nrole: {args.role} (node {args.node_id or 'local'})", flush=True)
    print(f"starting: {' '.join(redacted(server.command(), access))}", flush=True)
    openai = openai_app(args, model_dir, server)
    try:
        code = serve(server, args.demo, started, openai, hung_stage_s=args.hung_stage_s,
                     api_key=demo_api_key(args) if args.demo else None)
    except (StartError, StartTimeout) as exc:  # serve stopped it; the reason (with the log's tail), no traceback
        print(f"tritonserver did not start: {exc}", flush=True)
        return 1
    if openai is not None and openai.stop(timeout_s=10) is not None:
        print("stopped: the OpenAI API", flush=True)
    report = server.stop()
    if report is None:
        return code
    print(f"stopped: {report.describe()}", flush=True)
    # A server that had to be killed or exited with an error is a failed run, whatever came before.
    return code if not report.killed and report.exit_code == 0 else (code or 1)


def serve(
    server: TritonServer, demo: bool, started: float, openai: ProcessGroup | None = None,
    hung_stage_s: float = HUNG_AFTER_S, api_key: str | None = None,
) -> int:
    """Start, wait until ready, then the demo or serve until interrupted; the caller stops."""
    try:
        server.start()
        waited = server.wait_ready()
        print(
            f"ready in {waited:.1f} s ({time.monotonic() - started:.1f} s with builds)\n"
            f"  HTTP    http://{server.http_url}\n  gRPC    {server.grpc_url}\n"
            f"  metrics {server.metrics_url}",
            flush=True,
        )
        openai_url = None
        if openai is not None:
            openai.start()
            host, port = openai.command[-3], openai.command[-1]
            host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
            wait_until_ready(lambda: http_ok(f"http://{host}:{port}/health"), [openai], 120, "the OpenAI API")
            openai_url = f"http://{host}:{port}/v1"
            print(f"  OpenAI  {openai_url}", flush=True)
        if demo:
            return run_demo(server, openai_url, api_key)
        print("serving; Ctrl-C to stop", flush=True)
        return watch_stages(server, hung_stage_s)
    except KeyboardInterrupt:
        print("\nstopping", flush=True)
        return 0
    except BaseException:
        if openai is not None:
            openai.stop(timeout_s=10)
        server.stop()  # never leave tritonserver behind, whatever failed
        raise


def watch_stages(server: TritonServer, hung_after_s: float = HUNG_AFTER_S, poll_s: float = 0.5) -> int:
    """Until tritonserver exits: its exit code; or, when a stage died or a stub hangs, stop it
    and return ``STAGE_CRASHED``."""
    if server.process is None:
        return 1
    heartbeats = server.options.extra_env.get(HEARTBEAT_DIR_ENV)
    watch = StageWatch(server.process.pid, Path(heartbeats) if heartbeats else None, hung_after_s)
    while server.process.poll() is None:
        lost, hung = watch.lost(), watch.hung()
        if lost or hung:
            if hung and server.log_path is not None:
                print(f"stacks of the hung stage: {watch.save_hung_stacks(server.log_path.parent)}", flush=True)
            return stop_after_stage_crash(server, lost, hung)
        time.sleep(poll_s)
    return server.process.returncode


# Exit code of a launcher whose server lost a stage (a stub or a vLLM engine core died, or a stub hangs).
STAGE_CRASHED = 3
# A dead stub's model never unloads: Triton would wait its whole exit timeout for it.
STOP_AFTER_CRASH_S = 15.0


def stop_after_stage_crash(server: TritonServer, lost: Sequence[str], hung: Sequence[str] = ()) -> int:
    """A stage died or hangs: Triton cannot recover it (builders/stage_watch.py says why), so stop
    the server at once; health checks then fail and the orchestrator starts it again on the same store."""
    if lost:
        print(f"stage crashed: {', '.join(sorted(set(lost)))} died", flush=True)
    if hung:
        print(f"stage hung: {', '.join(sorted(set(hung)))}: it runs no Python any more (a deadlock inside "
              "Triton's python backend: its requests would never end)", flush=True)
    print("stopping tritonserver so that its health checks fail and an orchestrator restarts it (the "
          "embedding store is reused)", flush=True)
    server.stop(timeout_s=STOP_AFTER_CRASH_S)
    return STAGE_CRASHED


if __name__ == "__main__":
    sys.exit(main())

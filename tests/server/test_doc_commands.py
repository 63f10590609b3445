"""Every command block of README.md and docs/**/*.md, run as written (the project's rule).

Each ```bash block names its runner with a ``<!-- command-test: NAME -->`` marker; REGISTRY in
tests/doc_commands.py gives each NAME its kind, and RUNNERS here run it:

- ci-itself: `make test` is what CI runs (.ci/run); `make demo` runs in test_make_demo; any other
  target of such a block must be a part of `make test` (checked with `make -n`).
- client-commands: the block's text with ``bash -euo pipefail`` in the repository root against the
  session server (the OpenAI API in front of it for port 9000), its fixed ports replaced by the
  server's and its placeholders by files of the test's; the output must hold a real answer.
- serves: each serving line started in the background as written, save the ports (and folders)
  a test must not share; once each answers /v2/health/ready, one real request, then Ctrl-C
  (SIGINT) and a check that every server stopped cleanly (its log read like the other tests').
- opt-in: run the same ways, only with TRITON_EPD_DOC_COMMANDS=all (long, or needs docker, a GPU
  or a real checkpoint: TRITON_EPD_CHECKPOINT).
- offline: as written, no server.

Every run sees the virtual environment first on PATH, as after ``source .venv/bin/activate``: the
docs write ``triton-epd-serve``, ``triton-epd-advise`` and ``python -m ...`` without ``.venv/bin/``.
Logs: build/test-logs/slot-N/doc-*.log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import psutil
import pytest

from bench.audio_clips import tone, wav
from bench.perf_analyzer_tool import locate
from bench.server_stats import scrape_required
from builders.launcher import SAMPLE_IMAGE, SAMPLE_PROMPT, prepare
from builders.processes import ProcessGroup, StopReport, http_ok, log_lines_with, wait_until_ready
from builders.tritonserver import PROBLEM_MARKERS, REPO_ROOT, Ports, TritonServer, find_tritonserver, free_port
from client.epd_client import GrpcClient, chat_prompt
from tests.doc_commands import (
    REGISTRY,
    Block,
    command_blocks,
    commands,
    option_value,
    replace_option,
    split_comment,
    substitute_ports,
    with_args,
)
from tests.images import synthetic_image, with_note
from tests.server.conftest import CACHE_POLICY, LOG_DIR, SLOT, TEST_EXIT_TIMEOUT_S, check_stop
from tests.server.test_epd_acceptance import Answer, stream_generate
from tests.server.test_llm_audio import audio_repository, audio_server, audio_store  # noqa: F401  (fixtures: an audio server)
from tests.server.test_openai import api_url  # noqa: F401  (a fixture: the OpenAI API in front of the session server)

pytestmark = pytest.mark.server

OPT_IN = os.environ.get("TRITON_EPD_DOC_COMMANDS") == "all"
CHECKPOINT_ENV = "TRITON_EPD_CHECKPOINT"
FIXED = Ports()  # 8000/8001/8002: where the docs' servers listen
SLOTS_DIR = REPO_ROOT / "build" / "test-slots"
PEER_SUMMARY = REPO_ROOT / "tests" / "data" / "advisor" / "peers-summary.json"  # a real run's summary.json
START_TIMEOUT_S = 900.0  # a server with three vLLM engines on a shared 2-core machine
STOP_TIMEOUT_S = TEST_EXIT_TIMEOUT_S + 60.0
SAMPLING = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}  # ignore_eos: exactly 8 tokens
# pytest-timeout per NAME (0: none); the others get pyproject's 900 s.
TIMEOUTS = {
    "make-serve": 1200, "tritonserver": 1200, "scale-out": 2400, "serve-checkpoint": 3600, "bench-url": 3600,
    "perf-analyzer": 1800, "advise": 1800, "benchmark": 0, "aiperf": 0, "sustained-load": 0, "docker": 0,
}  # fmt: skip


# --------------------------------------------------------------------------- running a block


def doc_env(first_on_path: Sequence[Path] = (), base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["PATH"] = os.pathsep.join([*map(str, first_on_path), str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def log_path(block: Block, what: str = "") -> Path:
    return LOG_DIR / f"doc-{block.name}-{block.path.stem}-{block.line}{what}.log"


def run_block(text: str, log: Path, timeout_s: float | None, env: Mapping[str, str] | None = None) -> str:
    """``text`` with ``bash -euo pipefail`` in the repository root; its output (also in ``log``).
    Fails on a nonzero exit, after ``timeout_s``, and when it left processes running (a server
    started with ``&``): those get Ctrl-C (then SIGKILL) first, so nothing outlives the test."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:  # the child keeps its own descriptor
        process = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", text], cwd=REPO_ROOT, env=dict(env or doc_env()),
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        code: int | None = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    left = end_group(process.pid)
    output = log.read_text(errors="replace")
    shown = f"{text}\n--- output ({log}), last lines:\n" + "\n".join(output.splitlines()[-40:])
    assert code is not None, f"still running after {timeout_s:.0f} s:\n{shown}"
    assert code == 0, f"exit code {code}:\n{shown}"
    assert not left, f"left {left} process(es) running (Ctrl-C'ed, then killed):\n{shown}"
    return output


def end_group(pgid: int) -> int:
    """Ctrl-C to what is still running in the process group ``pgid``, SIGKILL after the stop
    timeout; returns how many processes were running."""

    def members() -> list[psutil.Process]:
        found = []
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process)
        return found

    running = members()
    if running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGINT)
        _, alive = psutil.wait_procs(running, timeout=STOP_TIMEOUT_S)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
    return len(running)


def busy(ports: Sequence[int]) -> list[int]:
    taken = []
    for port in ports:
        with socket.socket() as sock:
            # As servers bind (SO_REUSEADDR): a port whose last connections are in TIME_WAIT (the
            # server of the test before) is free to listen on.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                taken.append(port)
    return taken


def require_free(*ports: int) -> None:
    """The block serves on fixed ports it names (or its command's defaults): skipped, with the
    reason, while something else holds one (a user's ``make serve``); a clean CI machine has them."""
    taken = busy(ports)
    if taken:
        pytest.skip(f"the command serves on fixed ports and {taken} are in use")


def require_checkpoint() -> Path:
    folder = os.environ.get(CHECKPOINT_ENV)
    if not folder:
        pytest.skip(f"needs a real Qwen2-VL checkpoint: set {CHECKPOINT_ENV} to its folder")
    return Path(folder)


def answer_one(grpc_url: str, image: bytes | None = None) -> Answer:
    """One epd request with an image, greedy: a real answer with all its tokens."""
    prompt = chat_prompt(SAMPLE_PROMPT, 1)
    answer = stream_generate(grpc_url, "epd", prompt, [image or SAMPLE_IMAGE.read_bytes()], SAMPLING)
    assert answer.error is None, f"epd at {grpc_url} refused the request: {answer.error}"
    assert answer.result.num_output_tokens == SAMPLING["max_tokens"] and answer.result.token_ids, answer
    return answer


def log_problems(path: Path) -> tuple[str, ...]:
    return log_lines_with(path, PROBLEM_MARKERS)


# --------------------------------------------------------------------------- serving lines


@dataclasses.dataclass
class Serving:
    """One serving line, started in the background as a user starts it in a terminal."""

    command: str
    ports: Ports
    group: ProcessGroup
    descendants: list[psutil.Process] = dataclasses.field(default_factory=list)

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.metrics}/metrics"


def _launcher(command: str) -> bool:
    # The launcher prints how tritonserver stopped ("stopped: ..."); `make serve` runs it.
    return "triton-epd-serve" in command or command.startswith("make ")


def _clean_codes(command: str) -> tuple[int, ...]:
    """Exit codes of a clean Ctrl-C: 0, but `make` reports the interrupt itself (its recipe's launcher
    says how Triton stopped), and `docker compose up` exits 130 after stopping its containers."""
    if command.startswith("make "):
        return (0, 2, 130, -signal.SIGINT)
    if command.startswith("docker compose"):
        return (0, 130)
    return (0,)


def _stop(serving: Serving) -> StopReport | None:
    """Ctrl-C to the line's process group (as a terminal sends it), then what it started in other
    sessions (tritonserver, its stubs, the OpenAI API) must be gone too; returns the stop report with
    a clean Ctrl-C's exit code as 0."""
    report = serving.group.stop(STOP_TIMEOUT_S, PROBLEM_MARKERS)
    _, alive = psutil.wait_procs(serving.descendants, timeout=30)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    assert not alive, f"{serving.command}: left behind after its stop: {[p.pid for p in alive]}"
    if report is not None and report.exit_code in _clean_codes(serving.command):
        report = dataclasses.replace(report, exit_code=0)
    return report


def _check_stopped(serving: Serving, report: StopReport | None) -> None:
    log = serving.group.log_path.read_text(errors="replace") if serving.group.log_path else ""
    if _launcher(serving.command):
        assert "stopped: tritonserver exited with code 0 in " in log, (
            f"{serving.command}: no clean stop line; last lines:\n" + "\n".join(log.splitlines()[-30:])
        )
    check_stop(report)  # conftest: SIGKILL, a stub crash or an exit timeout in the log fails


@contextlib.contextmanager
def served(block: Block, lines: Sequence[tuple[str, Ports]], env: Mapping[str, str]) -> Iterator[list[Serving]]:
    """Each (command, its ports) started, one after another, each ready before the next (as a
    user starts them; their first builds then never race); all stopped at the end, last first.
    When the body failed, that failure is the one reported (the servers are stopped all the same)."""
    started: list[Serving] = []
    try:
        for index, (command, ports) in enumerate(lines):
            group = ProcessGroup(
                f"{block.name}-{index}", ["bash", "-c", f"exec {command}"], log_path=log_path(block, f"-{index}"),
                stop_signal=signal.SIGINT,
            ).start(env)  # fmt: skip
            serving = Serving(command, ports, group)
            started.append(serving)
            url = f"http://127.0.0.1:{ports.http}/v2/health/ready"
            wait_until_ready(functools.partial(http_ok, url), [group], START_TIMEOUT_S, command, tail_lines=40)
            if group.pid is not None:
                serving.descendants = psutil.Process(group.pid).children(recursive=True)
        yield started
    except BaseException:
        for serving in reversed(started):
            with contextlib.suppress(Exception):  # stop them all; the body's failure is the one reported
                _stop(serving)
        raise
    failures = []
    for serving in reversed(started):
        try:
            _check_stopped(serving, _stop(serving))
        except (AssertionError, pytest.fail.Exception) as exc:
            failures.append(f"{serving.command}:\n{exc}")
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)


def as_test_server(command: str, node_dir: Path, ports_map: Mapping[int, int]) -> tuple[str, Ports]:
    """A documented ``triton-epd-serve`` line made to run beside other servers: its fixed ports
    replaced by ``ports_map`` (free ones given by the test) or, where it names none (8000-8002),
    given free ones; its ``--model-repository`` folders moved under build/test-slots (one per
    folder name and slot, so that their builds are kept); its ``/dev/shm`` stores moved into the
    slot's tmpfs folder (removed at the session's end); its own KV folder; and the test servers'
    exit timeout (vLLM models take 15-30 s to unload on a busy 2-core machine, Triton's default
    is 30 s)."""
    line = substitute_ports(command, ports_map)
    line = replace_option(line, "--model-repository", lambda value: str(SLOTS_DIR / f"doc-{Path(value).name}-{SLOT}"))
    line = replace_option(line, "--cache-path", lambda value: str(node_dir / f"doc-{Path(value).name}"))
    extra: list[str] = []
    http = option_value(line, "--http-port")
    if http is None:
        ports = Ports.free()
        extra += ["--http-port", str(ports.http), "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics)]
    else:
        grpc, metrics = option_value(line, "--grpc-port"), option_value(line, "--metrics-port")
        assert grpc is not None and metrics is not None, f"a server with an HTTP port names all three: {line}"
        ports = Ports(int(http), int(grpc), int(metrics))
    if option_value(line, "--model-repository") is None:
        extra += ["--model-repository", str(SLOTS_DIR / f"doc-repository-{SLOT}")]
    if option_value(line, "--cache-path") is None:
        extra += ["--cache-path", str(node_dir / f"doc-store-{ports.http}")]
    extra += ["--kv-store-path", str(node_dir / f"doc-kv-{ports.http}"), "--exit-timeout-s", str(TEST_EXIT_TIMEOUT_S)]
    return with_args(line, extra), ports


def encodes(metrics_url: str) -> float:
    """Requests the ``encode`` model answered on one server (Triton's counter)."""
    counters = scrape_required(metrics_url).counters
    return sum(v for (name, labels), v in counters.items() if name == "nv_inference_request_success"
               and ("model", "encode") in labels)  # fmt: skip


def model_requests(server: TritonServer, model: str, counter: str = "nv_inference_request_success") -> float:
    counters = scrape_required(server.metrics_url).counters
    return sum(v for (name, labels), v in counters.items() if name == counter and ("model", model) in labels)


# --------------------------------------------------------------------------- ci-itself


def run_make_targets(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """`make test` is what CI runs (.ci/run); `make demo` runs in test_make_demo; any other target
    is a part of `make test`: every command `make -n` shows for it is one that `make -n test`
    shows, or a pytest run of a folder that one of `make test`'s pytest runs takes in."""
    assert "make test" in (REPO_ROOT / ".ci" / "run").read_text().splitlines()
    in_test = dry_run("test")
    for command in commands(block.text):
        target = re.fullmatch(r"make ([\w-]+)", split_comment(command)[0].strip())
        assert target, f"{block.id}: a ci-itself block holds make targets only, not {command!r}"
        if target.group(1) in ("test", "demo"):
            continue
        missing = [line for line in dry_run(target.group(1)) if not covered(line, in_test)]
        assert not missing, f"`make {target.group(1)}` runs what `make test` does not: {missing}"


def dry_run(target: str) -> list[str]:
    """What ``make TARGET`` would run (``make -n``: nothing is run)."""
    result = subprocess.run(["make", "-n", target], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"make -n {target}: {result.stderr}"
    return [line for line in result.stdout.splitlines() if line.strip()]


def _pytest_run(line: str) -> tuple[Path, list[Path]] | None:
    """(the folder, the --ignore'd folders) of a ``python -m pytest FOLDER ...`` line."""
    words = shlex.split(line)
    if "pytest" not in words:
        return None
    args = words[words.index("pytest") + 1 :]
    folders = [Path(a) for a in args if not a.startswith("-")]
    ignored = [Path(a.split("=", 1)[1]) for a in args if a.startswith("--ignore=")]
    return (folders[0] if folders else Path("tests")), ignored


def covered(line: str, in_test: list[str]) -> bool:
    if line in in_test:
        return True
    run = _pytest_run(line)
    if run is None:
        return False
    for other in filter(None, map(_pytest_run, in_test)):
        folder, ignored = other
        if run[0].is_relative_to(folder) and not any(run[0].is_relative_to(i) for i in ignored):
            return True
    return False


@pytest.mark.timeout(1500)
def test_make_demo() -> None:
    """README's first command, as written: set up, serve the tiny model, answer the sample request
    greedily from llm and epd over gRPC (the same tokens) and then the OpenAI API (port 9000), stop;
    it ends by itself with exit 0."""
    require_free(*dataclasses.astuple(FIXED), 9000)
    started = time.monotonic()
    output = run_block("make demo", LOG_DIR / "doc-make-demo.log", timeout_s=1400)
    assert re.search(r"^>>> \d+ input tokens, [1-9]\d* output tokens", output, re.MULTILINE), output
    assert re.search(r"^>>> usage: \d+ prompt tokens, [1-9]\d* completion tokens", output, re.MULTILINE), output
    # Greedy both times: epd (encoder, store, its path) answers llm's tokens, and so does the OpenAI API.
    assert re.search(r"^>>> epd answered the same [1-9]\d* tokens as llm$", output, re.MULTILINE), output
    assert ">>> the same text as llm's answer" in output, output
    assert "stopped: tritonserver exited with code 0 in " in output, output
    server_log = REPO_ROOT / "build" / "demo-server.log"  # the Makefile's --log-file
    check_stop(StopReport("make demo", 0, False, 0, time.monotonic() - started, log_problems(server_log), server_log))


# --------------------------------------------------------------------------- serves


def run_make_serve(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    # As written: `make serve` takes no port or folder options (ports 8000-8002, model_repository/).
    (command,) = commands(block.text)
    require_free(*dataclasses.astuple(FIXED))
    with served(block, [(command, FIXED)], doc_env()) as (server,):
        answer_one(server.grpc_url)


def answer_audio(grpc_url: str) -> None:
    """One llm request with a clip, greedy: a real answer with all its tokens."""
    client = GrpcClient(grpc_url, "llm")
    try:
        clip = wav(tone(3.0, 440.0, seed=11))
        result = client.generate(chat_prompt("What is it?", 0, num_audios=1), sampling=SAMPLING, audios=[clip])
    finally:
        client.close()
    assert result.num_output_tokens == SAMPLING["max_tokens"] and result.num_input_tokens > 75, result


def run_serve_audio(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    # As written: `make serve-audio` takes no port or folder options (ports 8000-8002, build/repo-audio).
    (command,) = commands(block.text)
    require_free(*dataclasses.astuple(FIXED))
    with served(block, [(command, FIXED)], doc_env()) as (server,):
        answer_audio(server.grpc_url)


def run_tritonserver(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Triton run by hand on the repository the builders wrote (the block before), "with the
    backend dir and env of builders/tritonserver.py": a ``tritonserver`` first on PATH that is the
    binary triton-epd-serve runs with its --backend-directory, in the env it starts it with.
    Filled: model_repository -> the same repository written into the slot's own folder, with the
    slot's store and KV folder; Triton's default ports (8000-8002) -> free ones; the test servers'
    exit timeout."""
    (command,) = commands(block.text)
    model_dir: Path = request.getfixturevalue("model_dir")
    node_dir: Path = request.getfixturevalue("node_dir")
    repository = SLOTS_DIR / f"doc-tritonserver-{SLOT}"
    cache = dataclasses.replace(CACHE_POLICY, path=str(node_dir / "doc-tritonserver-store"))
    prepare("cpu", model_dir, repository, cache=cache, kv_store_path=str(node_dir / "doc-tritonserver-kv"))
    install = find_tritonserver()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "tritonserver"
    shim.write_text(
        f"#!/bin/sh\nexec {shlex.quote(str(install.binary))} "
        f'--backend-directory={shlex.quote(str(install.backend_dir))} "$@"\n'
    )
    shim.chmod(0o755)
    ports = Ports.free()
    line = replace_option(command, "--model-repository", lambda _: str(repository))
    flags = [f"--http-port={ports.http}", f"--grpc-port={ports.grpc}", f"--metrics-port={ports.metrics}"]
    line = with_args(line, [*flags, f"--exit-timeout-secs={TEST_EXIT_TIMEOUT_S}"])
    with served(block, [(line, ports)], doc_env([bin_dir], base=install.env)) as (server,):
        answer_one(server.grpc_url)


def run_scale_out(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """2 encoder servers + 1 PD server from the block's three lines. Filled (as_test_server): the
    encoders' ports 9000-9002 and 9100-9102 -> free ones (in --remote-encoders too), the PD server's
    default 8000-8002 -> free ones, build/repo-* -> build/test-slots/doc-repo-*-SLOT, /dev/shm/epd-a
    and -b -> the slot's tmpfs folder. One epd request with a new image through the PD server: it
    must be encoded on the encoders (their ``encode`` counters), on the disaggregated path."""
    node_dir: Path = request.getfixturevalue("node_dir")
    lines = commands(block.text)
    fixed = {int(port) for line in lines for port in re.findall(r"--(?:http|grpc|metrics)-port[ =](\d+)", line)}
    ports_map: dict[int, int] = {}
    for port in sorted(fixed):
        while (chosen := free_port()) in ports_map.values():
            pass
        ports_map[port] = chosen
    servers = [as_test_server(line, node_dir, ports_map) for line in lines]
    roles = [option_value(line, "--role") for line, _ in servers]
    assert roles == ["encoder", "encoder", "pd"], f"the block should start 2 encoders + 1 PD server: {roles}"
    with served(block, servers, doc_env()) as (*encoders, pd):
        before = sum(encodes(encoder.metrics_url) for encoder in encoders)
        image = with_note(synthetic_image(160, 120, seed=29), secrets.token_bytes(8))  # new to every store
        answer = answer_one(pd.grpc_url, image)
        assert answer.serving_path == "disaggregated", answer.serving_path
        # The PD server has no encoder models: the image was encoded on an encoder server (its admission
        # probes may add encodes of their own, hence at least one).
        assert sum(encodes(encoder.metrics_url) for encoder in encoders) - before >= 1


def run_serve_checkpoint(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Filled: /path/to/Qwen2-VL-2B-Instruct -> $TRITON_EPD_CHECKPOINT; free ports, and a
    repository, store and KV folder of the test's (as_test_server)."""
    checkpoint = require_checkpoint()
    node_dir: Path = request.getfixturevalue("node_dir")
    (command,) = commands(block.text.replace("/path/to/Qwen2-VL-2B-Instruct", str(checkpoint)))
    with served(block, [as_test_server(command, node_dir, {})], doc_env()) as (server,):
        answer_one(server.grpc_url)


# --------------------------------------------------------------------------- client-commands


def run_client_cli(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Filled: a.jpg and b.png -> a JPEG and a PNG written here; the client's default ports (the text
    names none: localhost:8001 for gRPC, localhost:8000 for HTTP) -> ``--url`` with the session
    server's."""
    server: TritonServer = request.getfixturevalue("server")
    (tmp_path / "a.jpg").write_bytes(synthetic_image(320, 240, seed=11))
    (tmp_path / "b.png").write_bytes(synthetic_image(200, 300, seed=12, fmt="PNG"))
    lines = []
    for line in block.text.splitlines():
        if "triton-epd-client" in line and "--url" not in line:
            port = server.options.ports.http if "--protocol http" in line else server.options.ports.grpc
            line = with_args(line, ["--url", f"127.0.0.1:{port}"])
        lines.append(line.replace(" a.jpg", f" {tmp_path / 'a.jpg'}").replace(" b.png", f" {tmp_path / 'b.png'}"))
    output = run_block("\n".join(lines), log_path(block), timeout_s=600)
    counts = re.search(r"^\[(\d+) input tokens, ([1-9]\d*) output tokens, finish_reason=\w+\] token_ids=\[", output,
                       re.MULTILINE)  # fmt: skip
    assert counts, output
    assert output[: counts.start()].strip(), f"no answer text:\n{output}"  # both answers come before the counts


def run_client_audio(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Filled: clip.wav -> a 3 s WAV written here; the client's default port -> ``--url`` with the
    audio server's (test_llm_audio's: the tiny Qwen2-Audio's repository)."""
    server: TritonServer = request.getfixturevalue("audio_server")
    (tmp_path / "clip.wav").write_bytes(wav(tone(3.0, 440.0, seed=11)))
    (line,) = commands(block.text)
    line = with_args(line.replace(" clip.wav", f" {tmp_path / 'clip.wav'}"), ["--url", server.grpc_url])
    output = run_block(line, log_path(block), timeout_s=600)
    assert re.search(r"^\[(\d{2,}) input tokens, [1-9]\d* output tokens", output, re.MULTILINE), output


def run_openai_curl(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Filled: port 9000 -> the OpenAI API's (``api_url``: client.openai_server in front of the session server)."""
    api: str = request.getfixturevalue("api_url")
    output = run_block(substitute_ports(block.text, {9000: int(api.rsplit(":", 1)[1])}), log_path(block), 600)
    answer = json.loads(output)
    assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] > 0, answer


def run_generate_curl(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Filled: port 8000 -> the session server's HTTP port."""
    server: TritonServer = request.getfixturevalue("server")
    output = run_block(substitute_ports(block.text, {8000: server.options.ports.http}), log_path(block), 600)
    answer = json.loads(output)
    assert "error" not in answer and isinstance(answer.get("text_output"), str), answer
    assert answer["model_name"] == "llm" and answer["text_output"], answer


def run_admin_key(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Filled: ~/.config/triton-epd/admin-key -> the key file of an encoder-role triton-epd-serve the
    test starts (ready in seconds; its admin APIs are closed as every role's); port 8000 -> its HTTP port."""
    from tests.server.test_launcher_death import launch

    request.getfixturevalue("model_dir")
    key_file = tmp_path / "admin-key"
    launcher = launch("encoder", Ports.free(), None, request.getfixturevalue("node_dir"), "doc-admin-key",
                      extra=["--admin-key-file", str(key_file)])  # fmt: skip
    try:
        launcher.wait_serving()
        text = block.text.replace("~/.config/triton-epd/admin-key", str(key_file))
        output = run_block(substitute_ports(text, {8000: launcher.ports.http}), log_path(block), 120)
    finally:
        launcher.process.send_signal(signal.SIGINT)
        launcher.process.wait(timeout=120)
    refused, index, logging = output.splitlines()
    assert refused == "403", output
    assert "encoder_0" in {model["name"] for model in json.loads(index)}, output
    assert json.loads(logging)["log_verbose_level"] == 0, output


def run_bench_url(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Filled: localhost:8001 -> the session server's gRPC port; ``--metrics-url`` with its /metrics
    (the text names none: with --url the harness reads HOST:8002, another server's or nothing)."""
    server: TritonServer = request.getfixturevalue("server")
    text = substitute_ports(block.text, {8001: server.options.ports.grpc})
    text = re.sub(r"(--url \S+)", rf"\1 --metrics-url {server.metrics_url}", text)
    output = run_block(text, log_path(block), timeout_s=3500)
    # A table row per point: | mode | load | ok / err | ... (numbers with thousands separators).
    rows = re.findall(r"^\| (\S+) \| (c=\d+|poisson [\d.]+/s) \| ([\d,]+) / ([\d,]+) \|", output, re.MULTILINE)
    measured = {(mode, load) for mode, load, ok, _ in rows if int(ok.replace(",", "")) > 0}
    closed = {(m, f"c={c}") for m in ("llm", "ensemble", "epd", "epd:repeated") for c in (1, 2, 4, 8, 16, 32)}
    assert closed <= measured, f"points not measured: {sorted(closed - measured)}\n{output[-4000:]}"
    assert {load for _, load in measured if load.startswith("poisson")} == {"poisson 2/s", "poisson 4/s", "poisson 8/s"}
    assert all(errors == "0" for *_, errors in rows), output[-4000:]


def run_perf_analyzer(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Filled: localhost:8001 -> the session server's gRPC port; epd-profile.json (the working
    directory's) -> a file of the test's. Skipped where `make tools` could not install perf_analyzer."""
    server: TritonServer = request.getfixturevalue("server")
    tool, reason = locate()
    if tool is None:
        pytest.skip(reason)
    profile = tmp_path / "epd-profile.json"
    text = substitute_ports(block.text, {8001: server.options.ports.grpc}).replace("epd-profile.json", str(profile))
    before = model_requests(server, "epd"), model_requests(server, "epd", "nv_inference_request_failure")
    run_block(text, log_path(block), timeout_s=1700)
    exported = json.loads(profile.read_text())
    per_level = {e["experiment"]["value"]: len(e["requests"]) for e in exported["experiments"]}
    assert sorted(per_level) == [1, 2, 3, 4] and all(per_level.values()), per_level
    # The second run (path:disaggregated) exports nothing: Triton's counters show it ran too.
    assert model_requests(server, "epd") - before[0] > sum(per_level.values())
    assert model_requests(server, "epd", "nv_inference_request_failure") == before[1]


# --------------------------------------------------------------------------- offline


def run_build_repository(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    # As written: the tiny model (reused when intact) and model_repository/ (only changed files rewritten).
    output = run_block(block.text, log_path(block), timeout_s=800)
    assert "tiny-qwen2-vl" in output, output
    for model in ("llm", "epd", "encoder_0", "prefill", "decode"):
        assert (REPO_ROOT / "model_repository" / model / "config.pbtxt").is_file()


def run_sign_tenant(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Filled: /run/secrets/tenant-secret -> a 0600 secret file of the test's."""
    from python_backends.request.tenants import verify_tenant

    secret = tmp_path / "tenant-secret"
    secret.write_text(secrets.token_urlsafe(32))
    secret.chmod(0o600)
    output = run_block(block.text.replace("/run/secrets/tenant-secret", str(secret)), log_path(block), 120)
    assert verify_tenant(secret.read_text().strip().encode(), output.strip()) == "acme", output


def run_advise(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Filled (docs/serving-paths.md): results/<run> -> a run folder of the test's holding a real run's
    summary.json (the peer run's, tests/data/advisor/peers-summary.json)."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(PEER_SUMMARY, run / "summary.json")
    output = run_block(block.text.replace("results/<run>", str(run)), log_path(block), timeout_s=1700)
    advised = [c for c in commands(block.text) if c.startswith("triton-epd-advise")]
    fits = [c for c in commands(block.text) if "bench.advisor.fit" in c]
    assert output.count("\nbest (e2e) ") == len(advised) > 0, output[-3000:]  # each prints its table
    assert output.count("| mode | c | set |") == len(fits) > 0, output[-3000:]  # each fit its validity table
    for fit in fits:
        report = option_value(fit.replace("results/<run>", str(run)), "--report")
        assert report is not None and (REPO_ROOT / report / "validity.json").is_file(), report


def run_bench_compare(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Filled: results/run-a and results/run-b -> two run folders of the test's, each with a real
    run's summary.json (the peer run's)."""
    text = block.text
    for run in ("run-a", "run-b"):
        (tmp_path / run).mkdir()
        shutil.copy(PEER_SUMMARY, tmp_path / run / "summary.json")
        text = text.replace(f"results/{run}", str(tmp_path / run))
    output = run_block(text, log_path(block), timeout_s=300)
    assert re.search(r"^0 regression\(s\) in [1-9]\d* compared values", output, re.MULTILINE), output[-3000:]


def run_audio_parity(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    # As written: every case of the table, lossless 16 kHz rows within 1e-4 of Whisper's features.
    output = run_block(block.text, log_path(block), timeout_s=600)
    lossless = r"^\| WAV 16 kHz mono \| [\d,]+ \| 56000 / 56000 / 56000 \| \d\.\de-0[5-9] /"
    assert re.search(lossless, output, re.MULTILINE), output
    rows = [line for line in output.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 7 and all(float(row.split("|")[-2]) <= 1.5e-4 for row in rows), output  # served: every case


# --------------------------------------------------------------------------- opt-in


def run_benchmark(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """As written (they start their own servers on free ports). Filled: ~/photos -> a folder of
    JPEGs written here; ``--out DIR`` -> a folder of the test's."""
    photos = tmp_path / "photos"
    photos.mkdir()
    for seed in range(4):
        (photos / f"{seed}.jpg").write_bytes(synthetic_image(640, 480, seed=300 + seed))
    text = block.text.replace("~/photos", str(photos)).replace("--out DIR", f"--out {tmp_path / 'out'}")
    run_block(text, log_path(block), timeout_s=None)


def run_sustained_load(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    # As written: the server on 8000-8002, the two runs, its stop (the block waits for it).
    require_free(*dataclasses.astuple(FIXED))
    started = time.monotonic()
    run_block(block.text, log_path(block), timeout_s=None)
    server_log = REPO_ROOT / "build" / "sustained-server.log"  # the block's --log-file
    check_stop(StopReport("sustained", 0, False, 0, time.monotonic() - started, log_problems(server_log), server_log))


def run_docker(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Builds and checks run to their end; a serving line (`docker compose up`, `docker run -p`)
    runs in the background until 8000 is ready, answers one epd request, then gets Ctrl-C. Filled
    (docs/gpu.md): /data/qwen2-vl-2b -> $TRITON_EPD_CHECKPOINT."""
    if shutil.which("docker") is None:
        pytest.skip("docker is not installed")
    if "--gpus" in block.text and shutil.which("nvidia-smi") is None:
        pytest.skip("the gpu image needs an NVIDIA GPU (no nvidia-smi)")
    text = block.text
    if "/data/qwen2-vl-2b" in text:
        text = text.replace("/data/qwen2-vl-2b", str(require_checkpoint()))
    require_free(*dataclasses.astuple(FIXED))
    for index, command in enumerate(commands(text)):
        code = split_comment(command)[0]
        if re.search(r"^docker compose .* up\b", code) or (code.startswith("docker run ") and " -p " in code):
            with served(block, [(command, FIXED)], doc_env()) as (server,):
                answer_one(server.grpc_url)
        else:
            run_block(command, log_path(block, f"-{index}"), timeout_s=None)


Runner = Callable[[Block, pytest.FixtureRequest, Path], None]
RUNNERS: dict[str, Runner] = {
    "make-targets": run_make_targets,
    "make-serve": run_make_serve,
    "tritonserver": run_tritonserver,
    "scale-out": run_scale_out,
    "client-cli": run_client_cli,
    "openai-curl": run_openai_curl,
    "generate-curl": run_generate_curl,
    "admin-key": run_admin_key,
    "bench-url": run_bench_url,
    "perf-analyzer": run_perf_analyzer,
    "build-repository": run_build_repository,
    "sign-tenant": run_sign_tenant,
    "advise": run_advise,
    "bench-compare": run_bench_compare,
    "audio-parity": run_audio_parity,
    "serve-audio": run_serve_audio,
    "client-audio": run_client_audio,
    "serve-checkpoint": run_serve_checkpoint,
    "benchmark": run_benchmark,
    "aiperf": run_benchmark,
    "sustained-load": run_sustained_load,
    "docker": run_docker,
}


def test_every_registered_name_has_a_runner() -> None:
    assert sorted(RUNNERS) == sorted(REGISTRY)


def _params() -> list[object]:
    blocks = command_blocks()
    timeouts = [pytest.mark.timeout(TIMEOUTS.get(block.name or "", 900)) for block in blocks]
    return [pytest.param(b, id=f"{b.id}:{b.name}", marks=t) for b, t in zip(blocks, timeouts, strict=True)]


@pytest.mark.parametrize("block", _params())
def test_documented_commands(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    assert block.name in REGISTRY, f"{block.id}: unmarked or unknown (tests/unit/test_doc_commands.py says which)"
    entry = REGISTRY[block.name]
    if entry.kind == "opt-in" and not OPT_IN:
        pytest.skip(f"opt-in ({entry.what}): run with TRITON_EPD_DOC_COMMANDS=all")
    RUNNERS[block.name](block, request, tmp_path)

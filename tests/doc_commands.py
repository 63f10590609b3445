"""The command blocks of README.md and docs/**/*.md, and how tests run each one (Triton-free).

The project's rule: every command the README or docs show is run by a test, as written. Each
```bash block is preceded (blank lines allowed) by ``<!-- command-test: NAME -->``, invisible on
GitHub; NAME is a key of :data:`REGISTRY`, which says what kind of run the block gets. The runs
themselves are in tests/server/test_doc_commands.py; tests/unit/test_doc_commands.py checks that
every block is marked and every registry entry is used. The text helpers below (what a test fills
into a block before it runs it) are pure, so the unit test covers them too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parents[1]

# An opening or closing fence (tests/unit/test_docs_links.py shares it): indentation, marker, info string.
FENCE = re.compile(r"^(\s*)(```|~~~)\s*(\S*)")
MARKER = re.compile(r"^\s*<!--\s*command-test:\s*([\w-]+)\s*-->\s*$")
# Shell-like tags: a block tagged so would escape the rule, so commands are tagged ``bash``.
SHELL_TAGS = ("sh", "shell", "console", "zsh", "terminal")

Kind = Literal["ci-itself", "client-commands", "serves", "opt-in", "offline"]
KINDS: tuple[Kind, ...] = ("ci-itself", "client-commands", "serves", "opt-in", "offline")


@dataclass(frozen=True)
class Entry:
    kind: Kind
    what: str  # what the test does with the block; for opt-in, why it is not run by default


# NAME -> how its blocks are run (tests/server/test_doc_commands.py has one runner per NAME).
#  ci-itself:       what CI runs (`make test`, .ci/run) or a part of it; `make demo` has its own test.
#  client-commands: calls a running server: run with bash against the test's server, ports filled in.
#  serves:          starts servers: each line in the background, one real request, then Ctrl-C (SIGINT).
#  opt-in:          long or needs what CI lacks: run only with TRITON_EPD_DOC_COMMANDS=all.
#  offline:         needs no server: run as written.
REGISTRY: dict[str, Entry] = {
    "make-targets": Entry(
        "ci-itself", "`make test` is CI (.ci/run), test_make_demo runs `make demo`, the others are in `make test`"
    ),
    "make-serve": Entry("serves", "`make serve` on ports 8000-8002, one epd request, Ctrl-C"),
    "tritonserver": Entry("serves", "`tritonserver` on a repository the builders wrote, one epd request, Ctrl-C"),
    "scale-out": Entry("serves", "2 encoder servers + 1 PD server; one epd request, encoded by the encoders"),
    "client-cli": Entry("client-commands", "triton-epd-client over gRPC and HTTP"),
    "serve-audio": Entry("serves", "`make serve-audio` on ports 8000-8002, one llm request with a clip, Ctrl-C"),
    "client-audio": Entry("client-commands", "triton-epd-client with a WAV clip against an audio checkpoint's server"),
    "openai-curl": Entry("client-commands", "curl on the OpenAI API"),
    "generate-curl": Entry("client-commands", "curl on Triton's HTTP generate endpoint"),
    "admin-key": Entry("client-commands", "curl on a triton-epd-serve's admin APIs, without and with its key"),
    # Load tests against the test's server: 15+ and ~5 minutes, past what CI's time allows (the harness
    # and perf_analyzer have tests of their own in `make test`: test_bench*, test_perf_analyzer).
    "bench-url": Entry("opt-in", "`python -m bench run --url` against the test's server: a 15+ minute sweep"),
    "perf-analyzer": Entry("opt-in", "perf_analyzer (make tools) against the test's server: minutes of 10 s windows"),
    "build-repository": Entry("offline", "the tiny model and the default repository"),
    "sign-tenant": Entry("offline", "triton-epd-client sign-tenant with a secret file of the test's"),
    # Simulations of every layout and load: ~2.5 minutes per block on 2 cores, past CI's time (the
    # advisor's CLI and fit have unit tests: tests/unit/test_advisor.py).
    "advise": Entry("opt-in", "triton-epd-advise and the advisor's fit on tests/data/advisor: ~2.5 minutes a block"),
    "bench-compare": Entry("offline", "`python -m bench compare` on two summaries"),
    "audio-parity": Entry("offline", "`python -m bench.audio_parity`: DALI's audio features against Whisper's, ~20 s"),
    "serve-checkpoint": Entry("opt-in", "serves a real checkpoint: set TRITON_EPD_CHECKPOINT to a Qwen2-VL folder"),
    "benchmark": Entry("opt-in", "a benchmark run: minutes to an hour"),
    # AIPerf installs from PyPI into a venv of its own (make aiperf-tools), which CI does not build.
    "aiperf": Entry("opt-in", "AIPerf, our harness and perf_analyzer on a server the block starts: ~10 minutes"),
    "sustained-load": Entry("opt-in", "10,000 requests per load on a server on ports 8000-8002: over an hour"),
    "docker": Entry("opt-in", "builds and runs the docker images: long, needs docker (and a GPU for the gpu image)"),
}


@dataclass(frozen=True)
class Block:
    path: Path  # relative to the repository
    line: int  # the opening fence's line (1-based)
    name: str | None  # the marker's NAME; None when the block has no marker
    text: str  # the block's lines, without the fence's indentation (a block inside a list item)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def markdown_files(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


@dataclass(frozen=True)
class Fenced:
    line: int
    info: str  # the info string's first word ("bash", "python", "" when untagged)
    marker: str | None  # NAME of a command-test marker right before the fence (blank lines allowed)
    text: str


def fenced_blocks(text: str) -> list[Fenced]:
    """Every fenced block of a markdown text, with its tag and marker."""
    lines = text.splitlines()
    blocks: list[Fenced] = []
    number = 0
    while number < len(lines):
        opening = FENCE.match(lines[number])
        if not opening:
            number += 1
            continue
        indent, info = len(opening.group(1)), opening.group(3)
        end = number + 1
        while end < len(lines) and not FENCE.match(lines[end]):
            end += 1
        body = [_dedent(line, indent) for line in lines[number + 1 : end]]
        blocks.append(Fenced(number + 1, info, _marker_before(lines, number), "\n".join(body) + "\n"))
        number = end + 1
    return blocks


def _dedent(line: str, indent: int) -> str:
    # CommonMark drops up to the fence's indentation from each line of the block.
    spaces = len(line) - len(line.lstrip(" "))
    return line[min(spaces, indent) :]


def _marker_before(lines: list[str], fence: int) -> str | None:
    before = fence - 1
    while before >= 0 and not lines[before].strip():
        before -= 1
    match = MARKER.match(lines[before]) if before >= 0 else None
    return match.group(1) if match else None


def command_blocks(files: Sequence[Path] | None = None, root: Path = REPO) -> list[Block]:
    """Every ```bash block of README.md and docs/**/*.md."""
    return [
        Block(path.relative_to(root), block.line, block.marker, block.text)
        for path in (markdown_files(root) if files is None else files)
        for block in fenced_blocks(path.read_text())
        if block.info == "bash"
    ]


def commands(text: str) -> list[str]:
    """A block's commands, one per entry: continuation lines (``\\`` at the end) joined, comment
    lines and blank lines dropped. Quotes spanning lines are not handled: serving blocks, the only
    ones split this way, have none (the other blocks run whole, with bash)."""
    result: list[str] = []
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1].strip() + " "
            continue
        result.append((pending + line.strip()).strip())
        pending = ""
    if pending:
        result.append(pending.rstrip())
    return result


def split_comment(command: str) -> tuple[str, str]:
    """(the command, its trailing `` # comment`` or ''): arguments go before the comment. A ``#``
    starts a comment, as in bash, after whitespace and outside quotes."""
    quote = ""
    for index, char in enumerate(command):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and index > 0 and command[index - 1].isspace():
            code = command[:index].rstrip()
            return code, command[len(code) :]
    return command, ""


def with_args(command: str, args: Sequence[str]) -> str:
    """The command with ``args`` appended (before a trailing comment)."""
    code, comment = split_comment(command)
    return " ".join([code, *args]) + comment


def substitute_ports(text: str, ports: Mapping[int, int]) -> str:
    """Each port number of ``ports`` in the text (a whole number: 8000 but not 18000 or 80001)
    replaced by its value."""
    return re.sub(r"(?<![\d.])\d{2,5}(?!\d)", lambda m: str(ports.get(int(m.group()), m.group())), text)


def replace_option(command: str, option: str, value: Callable[[str], str]) -> str:
    """Each ``OPTION VALUE`` / ``OPTION=VALUE`` of the command with ``value(VALUE)`` instead."""
    return re.sub(rf"({re.escape(option)}[ =])(\S+)", lambda m: m.group(1) + value(m.group(2)), command)


def option_value(command: str, option: str) -> str | None:
    match = re.search(rf"{re.escape(option)}[ =](\S+)", command)
    return match.group(1) if match else None

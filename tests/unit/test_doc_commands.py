"""Every command block of the docs is marked with how a test runs it (tests/doc_commands.py).

The runs are in tests/server/test_doc_commands.py; here, without a server: each ```bash block of
README.md and docs/**/*.md has a ``<!-- command-test: NAME -->`` marker, each NAME is registered,
each registered NAME is used, no marker is left without its block, no command block escapes the
rule by another tag, and the extraction and the text helpers do what the runs rely on.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.doc_commands import (
    KINDS,
    MARKER,
    REGISTRY,
    REPO,
    SHELL_TAGS,
    command_blocks,
    commands,
    fenced_blocks,
    markdown_files,
    option_value,
    replace_option,
    substitute_ports,
    with_args,
)

BLOCKS = command_blocks()
# Untagged blocks that start like these are commands too: they must be ```bash (and so marked).
COMMAND_STARTS = (".venv/bin/", "make ", "python ", "triton-epd-", "tritonserver ", "curl ", "docker ")


def test_the_docs_have_command_blocks():
    # An extractor that found nothing would make every check below pass.
    assert len(BLOCKS) >= 20


def test_every_bash_block_has_a_marker():
    unmarked = [block.id for block in BLOCKS if block.name is None]
    assert unmarked == [], f"add <!-- command-test: NAME --> before each of these (tests/doc_commands.py): {unmarked}"


def test_every_marker_names_a_registered_runner():
    unknown = [f"{block.id}: {block.name}" for block in BLOCKS if block.name is not None and block.name not in REGISTRY]
    assert unknown == [], f"not in tests/doc_commands.py REGISTRY: {unknown}"


def test_every_registered_runner_is_used():
    used = {block.name for block in BLOCKS}
    assert sorted(set(REGISTRY) - used) == [], "registry entries no block uses"


def test_every_entry_has_a_known_kind():
    assert {entry.kind for entry in REGISTRY.values()} <= set(KINDS)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_marker_stands_before_a_bash_block(path: Path):
    text = path.read_text()
    markers = sum(1 for line in text.splitlines() if MARKER.match(line))
    marked = sum(1 for block in fenced_blocks(text) if block.info == "bash" and block.marker is not None)
    assert markers == marked, f"{path.name}: a command-test marker not right before a ```bash block"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_commands_are_tagged_bash(path: Path):
    blocks = fenced_blocks(path.read_text())
    shell = [block.line for block in blocks if block.info in SHELL_TAGS]
    untagged = [block.line for block in blocks if not block.info and block.text.lstrip().startswith(COMMAND_STARTS)]
    assert shell == [] and untagged == [], f"{path.name}: tag command blocks ```bash (lines {shell + untagged})"


def test_a_block_in_a_list_item_loses_its_indentation_and_keeps_its_marker():
    text = "- **Reproduce**:\n  <!-- command-test: x -->\n  ```bash\n  make a \\\n      --b\n  ```\n"
    (block,) = fenced_blocks(text)
    assert (block.line, block.info, block.marker, block.text) == (3, "bash", "x", "make a \\\n    --b\n")


def test_blank_lines_may_part_a_marker_from_its_block_but_prose_may_not():
    text = "<!-- command-test: x -->\n\n```bash\na\n```\n<!-- command-test: y -->\nprose\n```bash\nb\n```\n"
    assert [(b.marker, b.text) for b in fenced_blocks(text)] == [("x", "a\n"), (None, "b\n")]


def test_only_bash_blocks_are_command_blocks(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("```python\nprint(1)\n```\n```\nplain\n```\n```bash\nls\n```\n")
    (tmp_path / "docs" / "a.md").write_text("~~~bash\npwd\n~~~\n")
    blocks = command_blocks(root=tmp_path)
    assert [(str(b.path), b.line, b.text) for b in blocks] == [("README.md", 7, "ls\n"), ("docs/a.md", 1, "pwd\n")]


def test_commands_join_continuation_lines_and_drop_comment_lines():
    text = textwrap.dedent("""\
        # node-a: an encoder
        serve --role encoder \\
            --port 9000   # trailing comments stay

        # the PD server
        serve --role pd
        """)
    assert commands(text) == ["serve --role encoder --port 9000   # trailing comments stay", "serve --role pd"]


def test_the_scale_out_block_is_three_servers():
    (block,) = [b for b in BLOCKS if b.name == "scale-out"]
    servers = commands(block.text)
    assert [option_value(c, "--role") for c in servers] == ["encoder", "encoder", "pd"]
    assert all(c.startswith("triton-epd-serve ") and "\\" not in c for c in servers)


def test_the_readme_starts_with_make_demo_and_make_test():
    block = next(b for b in BLOCKS if str(b.path) == "README.md")
    assert [c.split("#")[0].strip() for c in commands(block.text)] == ["make demo", "make test"]


def test_ports_are_substituted_as_whole_numbers():
    text = "curl localhost:8000/x -p 8000-8002 --interval 18000 --n 80001 v2.8001 127.0.0.1:9001,h:9101"
    ports = {8000: 21000, 8002: 21002, 9001: 22001, 9101: 23001}
    assert substitute_ports(text, ports) == (
        "curl localhost:21000/x -p 21000-21002 --interval 18000 --n 80001 v2.8001 127.0.0.1:22001,h:23001"
    )


def test_arguments_go_before_a_trailing_comment():
    assert with_args("serve --a 1   # why", ["--b", "2"]) == "serve --a 1 --b 2   # why"
    assert with_args("serve", ["--b"]) == "serve --b"
    assert with_args('client "a # b"', ["--c"]) == 'client "a # b" --c'


def test_option_values_are_read_and_replaced():
    command = "serve --model-repository build/repo-a --cache-path=/dev/shm/a"
    assert option_value(command, "--cache-path") == "/dev/shm/a" and option_value(command, "--x") is None
    replaced = replace_option(command, "--model-repository", lambda value: f"/tmp/{value.rsplit('/', 1)[-1]}")
    assert replaced == "serve --model-repository /tmp/repo-a --cache-path=/dev/shm/a"

"""The documentation's relative links resolve, and the README stays short.

Every relative markdown link in README.md and docs/**/*.md must name a file that exists, and a
``#anchor`` must name a heading of that file (GitHub's slugs). Links inside code spans and fenced
code blocks are not links. README.md has at most 300 lines: details belong in docs/.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.doc_commands import FENCE, REPO, markdown_files

README_MAX_LINES = 300

CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the target ends at whitespace (an optional "title" follows) or ')'.
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with code spans blanked out."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, CODE_SPAN.sub("", line)))
    return lines


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link in the prose."""
    return [(number, match.group(1)) for number, line in prose_lines(text) for match in LINK.finditer(line)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and '_' (unicode aware, like GitHub)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor in a markdown text; repeated headings get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    result = set()
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """What is wrong with each relative link of one markdown file ('file:line: target: why')."""
    problems = []
    text = path.read_text()
    for number, target in links(text):
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not destination.exists():
            problems.append(f"{where}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination.read_text()):
            problems.append(f"{where}: no heading with that anchor in {destination.name}")
    return problems


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


def test_the_docs_have_links_to_check():
    # A link pattern that matched nothing would make the test above pass on anything.
    assert sum(len(links(path.read_text())) for path in markdown_files()) > 50


def test_readme_is_at_most_300_lines():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move details into docs/"


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("Choosing a layout: the advisor", "choosing-a-layout-the-advisor"),
        ("The disaggregated pipeline (`epd`, `encoder_<i>`, `prefill`, `decode`)",
         "the-disaggregated-pipeline-epd-encoder_i-prefill-decode"),
        ("perf_analyzer", "perf_analyzer"),
        ("Video on `llm` and `epd`", "video-on-llm-and-epd"),
        ("OMP threads: one thread cuts CPU 30-50%", "omp-threads-one-thread-cuts-cpu-30-50"),
    ],
)
def test_slugs_are_githubs(heading, expected):
    assert slug(heading) == expected


def test_repeated_headings_get_numbered_anchors():
    assert anchors("# A\n## Notes\n```\n# not a heading\n```\n## Notes\n") == {"a", "notes", "notes-1"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("see [ops](operations.md#bad-input) and ![plot](img/x.png)", ["operations.md#bad-input", "img/x.png"]),
        ('a [titled](facts.md "Facts") link', ["facts.md"]),
        ("`[not a link](nowhere.md)` and [one](a.md)", ["a.md"]),
        ("```\n[in a fence](nowhere.md)\n```\n[after](b.md)", ["b.md"]),
    ],
)
def test_link_extractor(text, expected):
    assert [target for _, target in links(text)] == expected


@pytest.mark.parametrize(
    ("page", "problem"),
    [
        ("[gone](no-such-page.md)", "no such file"),
        ("[bad anchor](target.md#no-such-heading)", "no heading with that anchor"),
        ("[self](#missing-here)", "no heading with that anchor"),
    ],
)
def test_broken_links_are_found(tmp_path, page, problem):
    (tmp_path / "target.md").write_text("# Target\n## A section\n")
    source = tmp_path / "source.md"
    source.write_text(f"# Source\n{page}\n[fine](target.md#a-section)\n")
    found = broken_links(source, root=tmp_path)
    assert len(found) == 1 and problem in found[0], found

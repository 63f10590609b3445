"""``file://`` media URLs under ``--media-dir`` (``client/openai_server/media_files.py``): every
trick to read outside the folder is refused, the API's answer is a 400 in OpenAI's shape, and
nothing blocks or reads without bound.

The folder holds regular files, symlinks pointing inside it (followed) and outside it (file and
directory symlinks, chains, a dangling one, a loop, one to /dev/zero: refused), a FIFO, a Unix
socket, a character device (as root) and directories. The URLs try ``..`` plain and
percent-encoded (``%2e%2e%2f``, ``%2F``, double encoding), absolute paths outside, hosts, ports
and user info, NUL and other control characters, queries, very long URLs and paths. Hypothesis
then builds URLs from those pieces, encoded at random, and checks each answer against what the
URL names: the bytes of a regular file whose real path is inside the folder, else a refusal;
never another exception and never a byte of the files outside.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from client.openai_server.errors import OpenAIError
from client.openai_server.media_files import (
    MAX_PATH_BYTES,
    MAX_URL_CHARS,
    FileRefused,
    FileTooLarge,
    read_media_file,
    requested_path,
    resolve_media_path,
)
from client.openai_server.prompt import MediaPolicy, load_media
from tests.unit.fuzz_settings import FUZZ

SECRET = b"SECRET-OUTSIDE-THE-MEDIA-FOLDER"
INSIDE = {
    "a.jpg": b"inside a",
    "sub/b.jpg": b"inside b",
    "sub/deeper/c.jpg": b"inside c",
    "odd ;name#?%.jpg": b"inside odd",
    "%2e%2e": b"a file literally named %2e%2e",
    "empty.jpg": b"",
}


@dataclass(frozen=True)
class Tree:
    base: Path  # holds media/ and outside/
    media: Path
    outside: Path

    def url(self, relative: str) -> str:
        return f"file://{self.media}/{relative}"


def _build(base: Path) -> Tree:
    media, outside = base / "media", base / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "secret.txt").write_bytes(SECRET)
    (outside / "dir" / "secret.txt").write_bytes(SECRET)
    (base / "media-sibling").mkdir()  # a prefix of the folder's name: /x/media-sibling is not under /x/media
    (base / "media-sibling" / "secret.txt").write_bytes(SECRET)
    for name, data in INSIDE.items():
        (media / name).parent.mkdir(parents=True, exist_ok=True)
        (media / name).write_bytes(data)
    links = {
        "link_out": outside / "secret.txt",  # a file symlink out
        "dirlink_out": outside,  # a directory symlink out
        "rel_link_out": Path("../outside/secret.txt"),  # relative, out
        "link_chain": Path("link_out"),  # inside -> inside -> out
        "link_dev": Path("/dev/zero"),  # out, to a device that never ends
        "link_root": Path("/"),
        "dangling": base / "no-such-file",
        "loop1": Path("loop2"),
        "loop2": Path("loop1"),
        "link_in": Path("sub/b.jpg"),  # inside: followed
        "dirlink_in": Path("sub"),
        "link_abs_in": media / "a.jpg",
        "link_media": Path("."),  # the folder itself
        "sub/link_up": Path("../a.jpg"),  # inside, through ..
        "sub/link_up_out": Path("../../outside/secret.txt"),
    }
    for name, target in links.items():
        (media / name).symlink_to(target)
    os.mkfifo(media / "fifo")
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(media / "sock"))  # closed below; the socket file stays
    unix.close()
    if os.geteuid() == 0:  # a character device inside the folder: /dev/zero's numbers
        os.mknod(media / "zero", 0o600 | stat.S_IFCHR, os.makedev(1, 5))
    return Tree(base, media, outside)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tree]:
    yield _build(tmp_path_factory.mktemp("media-paths"))


def quote(path: str) -> str:
    return urllib.parse.quote(path, safe="/")


def refused(url: str, root: Path, max_bytes: int = 1 << 20) -> FileRefused:
    with pytest.raises(FileRefused) as info:
        read_media_file(url, root, max_bytes)
    return info.value


# -- what is read ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "relative, expected",
    [
        ("a.jpg", "a.jpg"),
        ("sub/b.jpg", "sub/b.jpg"),
        ("sub/deeper/c.jpg", "sub/deeper/c.jpg"),
        ("sub/../a.jpg", "a.jpg"),
        ("./sub//deeper/./c.jpg", "sub/deeper/c.jpg"),
        ("%61.jpg", "a.jpg"),  # any character may be percent-encoded
        ("sub%2Fb.jpg", "sub/b.jpg"),  # an encoded separator is a separator, still inside
        ("odd%20%3Bname%23%3F%25.jpg", "odd ;name#?%.jpg"),
        ("%252e%252e", "%2e%2e"),  # decoded once: the file named %2e%2e, not the parent
        ("link_in", "sub/b.jpg"),
        ("dirlink_in/b.jpg", "sub/b.jpg"),
        ("link_abs_in", "a.jpg"),
        ("link_media/a.jpg", "a.jpg"),
        ("sub/link_up", "a.jpg"),
    ],
)
def test_files_under_the_folder_are_read(tree: Tree, relative: str, expected: str):
    assert read_media_file(tree.url(relative), tree.media, 1 << 20) == INSIDE[expected]


def test_localhost_and_the_folders_real_path_are_accepted(tree: Tree, tmp_path: Path):
    assert read_media_file(f"file://localhost{tree.media}/a.jpg", tree.media, 100) == INSIDE["a.jpg"]
    assert read_media_file(f"FILE://LocalHost{tree.media}/a.jpg", tree.media, 100) == INSIDE["a.jpg"]
    alias = tmp_path / "alias"  # the folder configured through a symlink: both spellings name its files
    alias.symlink_to(tree.media)
    assert read_media_file(f"file://{alias}/a.jpg", alias, 100) == INSIDE["a.jpg"]
    assert read_media_file(f"file://{tree.media}/a.jpg", alias, 100) == INSIDE["a.jpg"]


# -- what is refused ---------------------------------------------------------------------------

ESCAPES = {
    "dot-dot": "{media}/../outside/secret.txt",
    "dot-dot deep": "{media}/sub/deeper/../../../outside/secret.txt",
    "dot-dot past the root": "{media}/" + "../" * 40 + "etc/passwd",
    "encoded dot-dot": "{media}/%2e%2e/outside/secret.txt",
    "encoded dot-dot, upper case": "{media}/%2E%2E/outside/secret.txt",
    "encoded dot-dot-slash": "{media}/%2e%2e%2foutside%2fsecret.txt",
    "encoded separators": "{media}%2F..%2Foutside%2Fsecret.txt",
    "mixed": "{media}/.%2e/outside/secret.txt",
    "double-encoded dot-dot": "{media}/%252e%252e/outside/secret.txt",
    "double-encoded separator": "{media}/..%252foutside%252fsecret.txt",
    "overlong UTF-8 dots": "{media}/%c0%ae%c0%ae/outside/secret.txt",
    "backslashes": "{media}/..\\outside\\secret.txt",
    "absolute outside": "{outside}/secret.txt",
    "etc/passwd": "/etc/passwd",
    "proc environ": "/proc/self/environ",
    "dev zero": "/dev/zero",
    "a sibling sharing the prefix": "{base}/media-sibling/secret.txt",
    "four slashes": "/{media}/../outside/secret.txt",
    "file symlink out": "{media}/link_out",
    "relative symlink out": "{media}/rel_link_out",
    "directory symlink out": "{media}/dirlink_out/secret.txt",
    "directory symlink out, nested": "{media}/dirlink_out/dir/secret.txt",
    "symlink chain out": "{media}/link_chain",
    "symlink to /dev/zero": "{media}/link_dev",
    "symlink to /": "{media}/link_root/etc/passwd",
    "symlink out through ..": "{media}/sub/link_up_out",
    "inside link, then ..": "{media}/dirlink_in/../../outside/secret.txt",
    "dangling symlink": "{media}/dangling",
    "symlink loop": "{media}/loop1",
    "missing": "{media}/missing.jpg",
    "the folder itself": "{media}",
    "the folder, trailing slash": "{media}/",
    "a directory": "{media}/sub",
    "a directory, trailing slash": "{media}/sub/",
    "a symlink to the folder": "{media}/link_media",
    "a FIFO": "{media}/fifo",
    "a Unix socket": "{media}/sock",
    "a file as a directory": "{media}/a.jpg/x",
}
URL_TRICKS = {
    "another host": "file://otherhost{media}/a.jpg",
    "a loopback address": "file://127.0.0.1{media}/a.jpg",
    "localhost with a port": "file://localhost:80{media}/a.jpg",
    "user info": "file://user@localhost{media}/a.jpg",
    "encoded host": "file://%6cocalhost{media}/a.jpg",
    "UNC-like": "file:////otherhost/share{media}/a.jpg",
    "relative path": "file:a.jpg",
    "empty path": "file://",
    "localhost, no path": "file://localhost",
    "query": "file://{media}/a.jpg?x=1",
    "empty query": "file://{media}/a.jpg?",
    "fragment": "file://{media}/a.jpg#x",
    "encoded NUL": "file://{media}/a.jpg%00.png",
    "raw NUL": "file://{media}/a.jpg\x00.png",
    "encoded newline": "file://{media}/a%0a.jpg",
    "raw newline (urlsplit would drop it)": "file://{media}/a\n.jpg",
    "raw tab": "file://{media}/a.j\tpg",
    "DEL": "file://{media}/a.jpg\x7f",
    "leading space": " file://{media}/a.jpg",
    "not a file URL": "http://localhost{media}/a.jpg",
}


def _fill(template: str, tree: Tree) -> str:
    return template.format(media=tree.media, outside=tree.outside, base=tree.base)


@pytest.mark.parametrize("template", list(ESCAPES.values()), ids=list(ESCAPES))
def test_paths_outside_the_folder_or_not_regular_files_are_refused(tree: Tree, template: str):
    error = refused("file://" + _fill(template, tree), tree.media)
    assert SECRET.decode() not in str(error) and str(tree.outside) not in str(error)


@pytest.mark.parametrize("template", list(URL_TRICKS.values()), ids=list(URL_TRICKS))
def test_url_tricks_are_refused_before_the_filesystem(tree: Tree, template: str):
    with pytest.raises(FileRefused):
        requested_path(_fill(template, tree))
    refused(_fill(template, tree), tree.media)


def test_a_path_outside_is_refused_alike_whether_it_exists_or_not(tree: Tree):
    """No oracle: the answer for a path outside the folder does not depend on what is there."""
    exists = str(refused(f"file://{tree.media}/../outside/secret.txt", tree.media))
    missing = str(refused(f"file://{tree.media}/../outside/no-such-file", tree.media))
    assert exists == missing


def test_a_device_node_inside_the_folder_is_refused_without_reading(tree: Tree):
    if not (tree.media / "zero").exists():
        pytest.skip("creating a device node needs root")
    assert "not a regular file" in str(refused(tree.url("zero"), tree.media))


def _finishes(call, timeout_s: float = 30.0) -> object:
    """``call()``'s outcome, failing (rather than hanging the run) if it takes over ``timeout_s``."""
    outcome: list[object] = []
    worker = threading.Thread(target=lambda: outcome.append(_outcome(call)), daemon=True)
    worker.start()
    worker.join(timeout_s)
    assert outcome, f"still running after {timeout_s} s (blocked)"
    return outcome[0]


def _outcome(call) -> object:
    try:
        return call()
    except Exception as exc:
        return exc


def test_a_fifo_never_blocks(tree: Tree):
    fifo = tree.media / "fifo"
    try:
        outcome = _finishes(lambda: read_media_file(tree.url("fifo"), tree.media, 100))
    finally:  # a writer unblocks an open stuck waiting for one, whatever happened
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert isinstance(outcome, FileRefused) and "not a regular file" in str(outcome)


def test_very_long_urls_and_paths_are_refused_quickly(tree: Tree):
    cases = {
        "URL over the limit": tree.url("a/" * 200_000),  # resolving it would take minutes
        "decoded path over PATH_MAX": tree.url("%61" * (MAX_PATH_BYTES // 2)),
        "a name over NAME_MAX": tree.url("n" * 300),
        "many components": tree.url("sub/.." * 600 + "/a.jpg"),
    }
    for name, url in cases.items():
        started = time.monotonic()
        outcome = _finishes(lambda url=url: read_media_file(url, tree.media, 100))
        assert isinstance(outcome, FileRefused), (name, outcome)
        assert time.monotonic() - started < 30, name
    assert len(cases["URL over the limit"]) > MAX_URL_CHARS


def test_the_size_bound_holds_whatever_the_file_claims(tree: Tree, tmp_path: Path):
    media = tmp_path / "sized"
    media.mkdir()
    (media / "big.bin").write_bytes(b"x" * 1001)
    (media / "exact.bin").write_bytes(b"x" * 1000)
    with pytest.raises(FileTooLarge) as info:
        read_media_file(f"file://{media}/big.bin", media, 1000)
    assert (info.value.size, info.value.max_bytes) == (1001, 1000)
    assert read_media_file(f"file://{media}/exact.bin", media, 1000) == b"x" * 1000


def test_a_missing_media_folder_refuses_every_url(tmp_path: Path):
    assert "media folder cannot be read" in str(refused(f"file://{tmp_path}/gone/a.jpg", tmp_path / "gone"))


def test_a_symlink_swapped_in_after_the_check_is_not_followed(tree: Tree, tmp_path: Path, monkeypatch):
    """The race: the path resolves inside, then a component becomes a symlink out before the open."""
    import client.openai_server.media_files as media_files

    media = tmp_path / "racy"
    (media / "d").mkdir(parents=True)
    (media / "d" / "f.jpg").write_bytes(b"inside")
    resolve = media_files.resolve_media_path

    def resolve_then_swap(url: str, root):
        resolved = resolve(url, root)
        (media / "d" / "f.jpg").rename(media / "d-f.jpg")
        (media / "d").rmdir()
        (media / "d").symlink_to(tree.outside / "dir")  # d/f.jpg would now be outside/dir/f.jpg
        (tree.outside / "dir" / "f.jpg").write_bytes(SECRET)
        return resolved

    monkeypatch.setattr(media_files, "resolve_media_path", resolve_then_swap)
    try:
        assert "cannot read" in str(refused(f"file://{media}/d/f.jpg", media))
    finally:
        (tree.outside / "dir" / "f.jpg").unlink()


# -- the API's answer --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["image", "video", "audio"])
def test_the_api_answers_400_in_openais_shape(tree: Tree, kind):
    policy = MediaPolicy(file_root=tree.media, max_image_bytes=9, max_video_bytes=9, max_audio_bytes=9)
    param = f"messages[0].content[0].{kind}_url"
    urls = [*(_fill("file://" + t, tree) for t in ESCAPES.values()), *(_fill(t, tree) for t in URL_TRICKS.values())]
    urls += [tree.url("empty.jpg"), tree.url("odd%20%3Bname%23%3F%25.jpg")]  # empty; over the 9 bytes
    for url in urls:
        if url.split(":", 1)[0].lower() != "file":
            continue  # other schemes have their own answers (test_openai_prompt.py)
        with pytest.raises(OpenAIError) as info:
            load_media(url, param, kind, policy)
        error = info.value
        assert error.status == 400, (url, error.body())
        body = error.body()["error"]
        assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
        assert body["param"] == param and body["code"] in (f"invalid_{kind}_url", f"{kind}_too_large"), (url, body)
        assert SECRET.decode() not in body["message"]
    assert load_media(tree.url("a.jpg"), param, kind, policy) == INSIDE["a.jpg"]


# -- Hypothesis: any URL built from the pieces -------------------------------------------------

SEGMENTS = [
    "", ".", "..", "a.jpg", "sub", "deeper", "b.jpg", "c.jpg", "%2e%2e", "odd ;name#?%.jpg", "empty.jpg",
    "link_out", "dirlink_out", "rel_link_out", "link_chain", "link_dev", "link_root", "dangling", "loop1",
    "link_in", "dirlink_in", "link_abs_in", "link_media", "link_up", "link_up_out", "fifo", "sock", "zero",
    "outside", "secret.txt", "dir", "media", "media-sibling", "etc", "passwd", "dev",
]  # fmt: skip


@st.composite
def file_urls(draw: st.DrawFn, tree: Tree) -> str:
    start = draw(st.sampled_from([str(tree.media), str(tree.base), str(tree.outside), "", str(tree.media) + "/sub"]))
    segments = draw(st.lists(st.sampled_from(SEGMENTS) | st.text("./%2eEfF\\", max_size=6), max_size=8))
    path = "/".join([start, *segments])
    encoded = []
    for char in path:  # each character as it is, percent-encoded, or (rarely) double-encoded
        how = draw(st.sampled_from(["plain"] * 6 + ["encoded", "double"]))
        if how == "plain" or char == "%":
            encoded.append(urllib.parse.quote(char, safe="/.\\") if char in " ;#?" else char)
        elif how == "encoded":
            encoded.append("".join(f"%{byte:02X}" for byte in char.encode()))
        else:
            encoded.append("".join(f"%25{byte:02X}" for byte in char.encode()))
    host = draw(st.sampled_from(["", "", "", "localhost", "otherhost", "localhost:1"]))
    return f"file://{host}{''.join(encoded)}"


def expected_outcome(url: str, tree: Tree) -> bytes | None:
    """What the URL names, worked out independently: the bytes of a regular file whose real path
    is inside the folder, when the URL is a plain local one naming a path inside it; else None."""
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment or url.endswith(("?", "#")):
        return None
    decoded = urllib.parse.unquote(parts.path, errors="surrogateescape")
    if not decoded.startswith("/") or any(ord(c) < 0x20 or ord(c) == 0x7F for c in decoded):
        return None
    written = Path(os.path.normpath(decoded))
    if not written.is_relative_to(tree.media):
        return None
    try:
        real = written.resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    if real == tree.media or not real.is_relative_to(tree.media.resolve()):
        return None
    if not stat.S_ISREG(real.stat().st_mode):
        return None
    return real.read_bytes()


@pytest.fixture(scope="module")
def fuzz_tree(tmp_path_factory: pytest.TempPathFactory) -> Tree:
    return _build(tmp_path_factory.mktemp("media-fuzz"))


def test_any_built_url_reads_exactly_what_it_names_inside_or_is_refused(fuzz_tree: Tree):
    @FUZZ
    @given(file_urls(fuzz_tree))
    def check(url: str) -> None:
        expected = expected_outcome(url, fuzz_tree)
        try:
            data = read_media_file(url, fuzz_tree.media, 1 << 20)
        except FileRefused as exc:
            assert expected is None, (url, str(exc))
            assert SECRET.decode() not in str(exc)
            return
        assert data != SECRET and data == expected, url

    check()


def test_requested_path_is_always_absolute_normal_and_short(tree: Tree):
    @FUZZ
    @given(st.text(max_size=300))
    def check(tail: str) -> None:
        url = "file://" + tail
        try:
            path = requested_path(url)
        except FileRefused:
            return
        assert path.startswith("/") and path == os.path.normpath(path) and len(os.fsencode(path)) <= MAX_PATH_BYTES
        assert "\0" not in path and "/../" not in path + "/"

    check()


def test_resolved_components_never_climb(tree: Tree):
    root, components = resolve_media_path(tree.url("dirlink_in/../sub/./deeper/c.jpg"), tree.media)
    assert root == os.path.realpath(tree.media) and components == ["sub", "deeper", "c.jpg"]

"""``file://`` media URLs under ``--media-dir``: which file a URL names, and its bytes, never
anything outside the folder.

A URL is refused (:class:`FileRefused`, a 400 for the API) before the filesystem is asked
anything when it is not a plain local ``file://`` URL: a host other than ``localhost``, a query
or fragment, control characters (NUL included, raw or percent-encoded), a relative path, or a
URL or path over :data:`MAX_URL_CHARS` / :data:`MAX_PATH_BYTES`. Its path is percent-decoded
once (``%252e`` is a file named ``%2e``, not ``.``) and must be under the folder as written:
``..`` segments and encoded separators (``%2e%2e%2f``, ``%2F``) are normalised first, so a path
that leaves the folder is refused without telling whether it exists.

The path is then resolved (``realpath``, strict: every component must exist) and must still be
under the folder's own real path: a symlink inside the folder may point elsewhere inside it, never
outside (file or directory symlinks alike). The file is opened along those resolved components
from a descriptor of the folder, ``O_NOFOLLOW`` at each step, so a symlink swapped in after the
check is refused rather than followed. Only a regular file is read (a directory, FIFO, socket or
device node is refused before it is opened, and opened with ``O_NONBLOCK`` in case it was swapped
in since), and at most ``max_bytes + 1`` bytes are read whatever its size claims.

A hard link inside the folder to a file elsewhere is a file of the folder: whoever can write the
folder decides what it serves.
"""

from __future__ import annotations

import os
import stat
import urllib.parse

# Longer URLs are refused before they are parsed; longer decoded paths before the filesystem sees
# them (resolving a path costs time in the square of its components: 320 KB of "a/" took 2 s).
MAX_URL_CHARS = 16 * 1024
MAX_PATH_BYTES = 4096  # Linux's PATH_MAX
_HOSTS = ("", "localhost")
_CONTROL = frozenset(chr(c) for c in (*range(0x20), 0x7F))
_READ_CHUNK = 1 << 20


class FileRefused(ValueError):
    """A ``file://`` URL that is not read; ``str()`` says why (without naming anything outside)."""


class FileTooLarge(FileRefused):
    def __init__(self, size: int, max_bytes: int) -> None:
        super().__init__(f"the file has {size} bytes, over the limit of {max_bytes}")
        self.size = size
        self.max_bytes = max_bytes


def _under(path: str, base: str) -> bool:
    return path == base or path.startswith(base.rstrip("/") + "/")


def requested_path(url: str) -> str:
    """The absolute, percent-decoded and normalised path a ``file://`` URL names (no filesystem
    access); FileRefused for anything but a plain local file URL."""
    if len(url) > MAX_URL_CHARS:
        raise FileRefused(f"the file:// URL is over {MAX_URL_CHARS} characters")
    if any(char in _CONTROL for char in url):
        raise FileRefused("a file:// URL may not hold control characters")
    if url[:5].lower() != "file:":  # urlsplit would drop leading blanks
        raise FileRefused("not a file:// URL")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:  # e.g. an unbalanced '[' in the host: "Invalid IPv6 URL"
        raise FileRefused(f"not a valid file:// URL: {exc}") from None
    if parts.netloc.lower() not in _HOSTS:
        raise FileRefused("a file:// URL must name a local file (no host but localhost)")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise FileRefused("a file:// URL takes no query or fragment (percent-encode '?' and '#' in a file name)")
    raw = urllib.parse.unquote_to_bytes(parts.path)
    if b"\0" in raw or any(byte < 0x20 or byte == 0x7F for byte in raw):
        raise FileRefused("a file:// URL's path may not hold control characters")
    if len(raw) > MAX_PATH_BYTES:
        raise FileRefused(f"the file:// URL's path is over {MAX_PATH_BYTES} bytes")
    path = os.fsdecode(raw)
    if not path.startswith("/"):
        raise FileRefused("a file:// URL must hold an absolute path (file:///folder/name)")
    path = os.path.normpath(path)
    if path.startswith("//"):  # POSIX keeps two leading slashes: a network path on some systems
        raise FileRefused("a file:// URL's path must start with a single '/' (file:///folder/name)")
    return path


def _refused_outside(root: str) -> FileRefused:
    return FileRefused(f"file:// URLs may only read files under {root}")


def resolve_media_path(url: str, root: str | os.PathLike[str]) -> tuple[str, list[str]]:
    """The media folder's real path and the components, under it, of the existing file (or
    directory) that ``url`` names once every symlink is resolved; FileRefused when the URL is not
    a local file URL, names something outside the folder, or cannot be resolved."""
    try:
        real_root = os.path.realpath(root, strict=True)
    except (OSError, ValueError):
        raise FileRefused("the server's media folder cannot be read") from None
    path = requested_path(url)
    if not (_under(path, os.path.abspath(root)) or _under(path, real_root)):
        raise _refused_outside(os.fspath(root))
    try:
        real = os.path.realpath(path, strict=True)
    except OSError as exc:
        raise FileRefused(f"cannot read {path}: {exc.strerror or 'cannot be resolved'}") from None
    if not _under(real, real_root) or real == real_root:
        if real == real_root:
            raise FileRefused(f"{path} is the media folder, not a file")
        raise _refused_outside(os.fspath(root))
    return real_root, os.path.relpath(real, real_root).split(os.sep)


def _open_beneath(real_root: str, components: list[str], shown: str) -> int:
    """A read-only descriptor of ``real_root/components...``, opened one component at a time with
    ``O_NOFOLLOW`` (a symlink swapped in since the path was resolved is refused, not followed);
    only a regular file is opened."""
    base = getattr(os, "O_CLOEXEC", 0)
    directory_fd = os.open(real_root, os.O_RDONLY | os.O_DIRECTORY | base)
    try:
        for name in components[:-1]:
            next_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | base, dir_fd=directory_fd)
            os.close(directory_fd)
            directory_fd = next_fd
        mode = os.stat(components[-1], dir_fd=directory_fd, follow_symlinks=False).st_mode
        if not stat.S_ISREG(mode):
            raise FileRefused(f"{shown} is not a regular file")
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | base
        return os.open(components[-1], flags, dir_fd=directory_fd)
    finally:
        os.close(directory_fd)


def read_media_file(url: str, root: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The bytes of the regular file under ``root`` that ``url`` names: FileRefused (FileTooLarge
    over ``max_bytes``) for anything else. Never blocks on a FIFO or device, never reads more than
    ``max_bytes + 1`` bytes."""
    real_root, components = resolve_media_path(url, root)
    shown = os.path.join(os.fspath(root), *components)
    try:
        fd = _open_beneath(real_root, components, shown)
    except FileRefused:
        raise
    except OSError as exc:
        raise FileRefused(f"cannot read {shown}: {exc.strerror or 'cannot be opened'}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # swapped in between the check and the open
            raise FileRefused(f"{shown} is not a regular file")
        if info.st_size > max_bytes:
            raise FileTooLarge(info.st_size, max_bytes)
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, min(_READ_CHUNK, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:  # it grew since fstat
            raise FileTooLarge(total, max_bytes)
        return b"".join(chunks)
    except OSError as exc:
        raise FileRefused(f"cannot read {shown}: {exc.strerror or 'read failed'}") from None
    finally:
        os.close(fd)

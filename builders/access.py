"""Who may call what on a ``triton-epd-serve`` server: Triton's restricted API categories.

Triton checks a header on every call of a restricted category (``--http-restricted-api`` and
``--grpc-restricted-protocol``, ``CATEGORIES:HEADER=VALUE``): HTTP answers 403, gRPC
UNAVAILABLE, "This API is restricted, expecting header '...'". The launcher closes:

- the admin categories (:data:`ADMIN_CATEGORIES`) behind the admin key, by default, from a key
  file it generates (0600) when there is none: repository control, configs, shared-memory
  registration, log and trace settings; inference, health, metadata and statistics stay open;
- on an encoder-role server given a peer key, ``inference`` (every model) and ``model-config``
  (the PD servers read the encoder model's config when they admit it) behind the peer key, which
  the PD servers send (``python_backends/scaleout/wire.py``).

Triton compares the header with ``==`` and counts no refusal; its key is on tritonserver's
command line, which local users of the machine can read (docs/security.md says so).
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from python_backends.scaleout.wire import PEER_HEADER, PEER_KEY_FILE_ENV

__all__ = [
    "ADMIN_CATEGORIES", "ADMIN_HEADER", "PEER_HEADER", "PEER_KEY_FILE_ENV", "Access", "AdminKeyHeader",
    "KeyFileError", "default_admin_key_file", "grpc_header", "load_or_create_key", "local_admin_key", "read_key",
    "redacted",
]

ADMIN_CATEGORIES = ("model-repository", "model-config", "shared-memory", "logging", "trace")
ADMIN_HEADER = "triton-epd-admin-key"
# Triton parses CATEGORIES:HEADER=VALUE; a key of these characters cannot break that.
_KEY_PATTERN = re.compile(r"[A-Za-z0-9._~-]{16,256}")
# gRPC clients send the header under this prefix (Triton's kRestrictedProtocolHeaderTemplate).
_GRPC_PREFIX = "triton-grpc-protocol-"


class KeyFileError(ValueError):
    """A key file that is missing, readable by others or holds no usable key."""


def grpc_header(header: str) -> str:
    """The gRPC metadata key a client sends for a restricted ``header``."""
    return _GRPC_PREFIX + header


def default_admin_key_file() -> Path:
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "triton-epd" / "admin-key"


def read_key(path: Path) -> str:
    """The key in ``path``: owner-only (no group or other access bits), one token of 16-256 URL-safe
    characters."""
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"key file {path} is readable by others (mode {stat.S_IMODE(mode):o}): chmod 600 it")
    key = text.strip()
    if not _KEY_PATTERN.fullmatch(key):
        raise KeyFileError(f"key file {path} must hold one key of 16-256 characters A-Z a-z 0-9 . _ ~ -")
    return key


def load_or_create_key(path: Path) -> tuple[str, bool]:
    """The key in ``path``, or a new random one written there (0600, created exclusively, in a
    0700 folder); ``(key, created)``."""
    if path.exists():
        return read_key(path), False
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another launcher made it just now: use theirs
        return read_key(path), False
    with os.fdopen(fd, "w") as file:
        file.write(key + "\n")
    return key, True


@dataclass(frozen=True)
class Access:
    """The keys of one server: ``admin_key`` None leaves the admin categories open; ``peer_key``
    closes inference on an encoder-role server."""

    admin_key: str | None = None
    peer_key: str | None = None
    role: str = "all"
    admin_categories: tuple[str, ...] = ADMIN_CATEGORIES  # those the admin key closes

    def restrictions(self) -> dict[str, tuple[str, ...]]:
        """Header -> the categories it opens."""
        closed: dict[str, tuple[str, ...]] = {}
        peer_guarded = self.role == "encoder" and self.peer_key is not None
        if self.admin_key is not None:
            # An encoder's model-config is its peers' (they read it to admit it): never the admin key's.
            skip = ("model-config",) if self.role == "encoder" else ()
            categories = tuple(c for c in self.admin_categories if c not in skip)
            if categories:
                closed[ADMIN_HEADER] = categories
        if peer_guarded:
            closed[PEER_HEADER] = ("inference", "model-config")
        return closed

    def tritonserver_args(self) -> tuple[str, ...]:
        keys = {ADMIN_HEADER: self.admin_key, PEER_HEADER: self.peer_key}
        args: list[str] = []
        for header, categories in self.restrictions().items():
            setting = f"{','.join(categories)}:{header}={keys[header]}"
            args += [f"--http-restricted-api={setting}", f"--grpc-restricted-protocol={setting}"]
        return tuple(args)


class AdminKeyHeader:
    """A tritonclient plugin (gRPC): every call carries the admin key."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, request: object) -> None:
        request.headers[grpc_header(ADMIN_HEADER)] = self.key  # type: ignore[attr-defined]


def local_admin_key(path: Path | None = None) -> str | None:
    """The admin key of a server on this machine, for our own tools (the benchmark reads model
    configs): ``$TRITON_EPD_ADMIN_KEY_FILE``, else the launcher's default file; None if unreadable."""
    path = path or Path(os.environ.get("TRITON_EPD_ADMIN_KEY_FILE") or default_admin_key_file())
    try:
        return read_key(path)
    except KeyFileError:
        return None


def redacted(command: list[str], access: Access) -> list[str]:
    """``command`` with the keys replaced, for printing."""
    keys = [key for key in (access.admin_key, access.peer_key) if key]
    out = []
    for arg in command:
        for key in keys:
            arg = arg.replace(key, "***")
        out.append(arg)
    return out

"""API keys, as ``vllm serve --api-key`` takes them, and a keys file that names each key's tenant.

With no key configured the API is open (the default, on loopback). With keys, every request but
``GET /health`` must carry ``Authorization: Bearer <key>``; any other is answered 401 with
OpenAI's error body (``{"error": {"message", "type": "invalid_request_error", "param": null,
"code": "invalid_api_key"}}``; vLLM answers ``{"error": "Unauthorized"}``, which OpenAI clients
cannot read), including ``/v1/models``, the OpenAPI docs (``/docs``, ``/redoc``,
``/openapi.json``) and unknown paths. The keys:

- ``--api-key KEY`` (repeatable); without it ``TRITON_EPD_API_KEY`` (one key, or several separated
  by commas), else ``VLLM_API_KEY`` (one key, as vLLM reads it). These keys name no tenant: their
  requests go to the untenanted (shared) cache space.
- ``--api-keys-file PATH``: one key per line with its tenant, ``KEY TENANT`` (whitespace between;
  blank lines and lines starting with ``#`` are skipped; a tenant of ``-`` names none: the shared
  space). A key may appear once. The server refuses to start on a file it cannot read or parse,
  or that other users may read or write, or its group may write (``chmod 600 PATH``); a file its
  group may read starts with a warning (a Kubernetes secret mounted with ``fsGroup`` is 0440).
  The file is re-read as soon as it changes (each request compares its inode, size, mtime and
  ctime: one ``stat``; for :data:`RACY_S` after a change, while a second edit could carry the same
  coarse timestamps, every request re-reads it, as git treats racily clean files) and on
  ``SIGHUP``: a removed key is refused from the next request on. A file that turns unreadable,
  invalid or too open at run time is logged and then grants nothing (the ``--api-key`` keys still
  work) until it is fixed. Replace it atomically (write a copy and ``mv`` it over): a half-written
  file is read as what it holds.

With keys configured, a request's tenant is its key's: the ``X-Tenant`` header and the body's
``user`` are ignored (a client cannot name another tenant's cache space); without keys, the
header, else ``user``, names it (``app.request_tenant``).

Keys are compared as SHA-256 digests with :func:`hmac.compare_digest` against every configured
key, with no early exit, so that the time taken says neither which key nor how much of one
matched. A key is printable ASCII with no whitespace or comma.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from client.openai_server.errors import OpenAIError

KEY_ENV = "TRITON_EPD_API_KEY"
VLLM_KEY_ENV = "VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})
NO_TENANT = "-"  # in the keys file: a key without a tenant (the shared space)
MAX_TENANT_CHARS = 256  # Triton's bound on the ``tenant`` parameter
# A file changed this recently may change again within the same timestamp tick: re-read it per request.
RACY_S = 2.0
# Where the middleware leaves the authenticated caller for the routes (the ASGI scope).
CALLER_SCOPE_KEY = "triton_epd.caller"

# uvicorn configures this logger (its format, stderr); our own would print nothing below WARNING.
log = logging.getLogger("uvicorn.error")


class KeysError(ValueError):
    """A key or keys file the server cannot use."""


@dataclass(frozen=True)
class Caller:
    """An authenticated request's caller: its key's tenant (None: the shared space)."""

    tenant: str | None


def check_key(key: str, where: str) -> str:
    if not key or not key.isascii() or not key.isprintable() or any(c.isspace() or c == "," for c in key):
        raise KeysError(f"{where}: an API key is printable ASCII with no whitespace or comma")
    return key


def check_tenant(tenant: str, where: str) -> str:
    if len(tenant) > MAX_TENANT_CHARS or not tenant.isprintable():
        raise KeysError(f"{where}: a tenant is 1-{MAX_TENANT_CHARS} printable characters")
    return tenant


def configured_keys(cli_keys: Sequence[str] | None, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The keys without a tenant: ``--api-key``'s, else ``TRITON_EPD_API_KEY``'s (comma-separated),
    else ``VLLM_API_KEY`` (vLLM's rule: the command line wins over the environment)."""
    if cli_keys:
        return [check_key(key, "--api-key") for key in cli_keys]
    if environ.get(KEY_ENV):
        return [check_key(key.strip(), KEY_ENV) for key in environ[KEY_ENV].split(",") if key.strip()]
    if environ.get(VLLM_KEY_ENV):
        return [check_key(environ[VLLM_KEY_ENV].strip(), VLLM_KEY_ENV)]
    return []


def parse_keys_file(text: str, source: str) -> dict[str, str | None]:
    """``KEY TENANT`` lines -> {key: tenant or None}; :class:`KeysError` names the first bad line."""
    keys: dict[str, str | None] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        where = f"{source}:{number}"
        if len(fields) != 2:
            raise KeysError(f"{where}: expected 'KEY TENANT' (a tenant of '{NO_TENANT}' names none)")
        key, tenant = check_key(fields[0], where), check_tenant(fields[1], where)
        if key in keys:
            raise KeysError(f"{where}: this key is already on an earlier line")
        keys[key] = None if tenant == NO_TENANT else tenant
    return keys


def check_file_mode(mode: int, source: str) -> str | None:
    """:class:`KeysError` for a keys file others may read or write or its group may write; a
    warning (returned) for one its group may read; None when only its owner has access."""
    if mode & (stat.S_IRWXO | stat.S_IWGRP):
        raise KeysError(f"{source}: others may read or write it (mode {stat.S_IMODE(mode):o}); chmod 600 it")
    if mode & stat.S_IRGRP:
        return f"{source}: its group may read it (mode {stat.S_IMODE(mode):o}); chmod 600 it unless that is meant"
    return None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    tenant: str | None


_Signature = tuple[int, int, int, int, int]


def _signature(st: os.stat_result) -> _Signature:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _missing_key() -> OpenAIError:
    return OpenAIError(
        401,
        "You didn't provide an API key. You need to provide your API key in an Authorization header "
        "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
        "invalid_request_error",
        None,
        "invalid_api_key",
    )


def _incorrect_key() -> OpenAIError:
    return OpenAIError(401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key")


class ApiKeys:
    """The keys a request may carry: ``keys`` (no tenant) and those of ``keys_file`` (their
    tenants), the file re-read when it changes. Built with a file it cannot use, it raises
    :class:`KeysError` (the server does not start)."""

    def __init__(self, keys: Iterable[str] = (), keys_file: Path | None = None) -> None:
        self._static = tuple(_Entry(_digest(check_key(key, "--api-key")), None) for key in dict.fromkeys(keys))
        self.keys_file = keys_file
        self._file: tuple[_Entry, ...] = ()
        self._signature: _Signature | None = None
        self._racy = False
        self._problem: str | None = None  # the last problem logged with the file, not to repeat it
        if keys_file is not None:
            self._load(strict=True)

    @property
    def enabled(self) -> bool:
        """Whether requests need a key (a keys file counts even while it holds none)."""
        return bool(self._static) or self.keys_file is not None

    @property
    def counts(self) -> tuple[int, int]:
        """(keys without a file, keys of the file as last read)."""
        return len(self._static), len(self._file)

    def reload(self) -> bool:
        """Re-read the keys file now; False (its keys then grant nothing) if it cannot be used."""
        return self.keys_file is not None and self._load(strict=False)

    def handle_sighup(self, _signum: int | None = None, _frame: Any = None) -> None:
        """The ``SIGHUP`` handler: re-read the keys file."""
        if self.keys_file is not None:
            log.info("SIGHUP: re-reading the API keys file %s", self.keys_file)
            self.reload()

    def _load(self, strict: bool) -> bool:
        """Read the keys file (``strict``: at start, :class:`KeysError` if it cannot be used; else
        an unusable file grants nothing, said once per problem in the log)."""
        assert self.keys_file is not None
        source = str(self.keys_file)
        try:
            with open(self.keys_file, encoding="utf-8") as handle:
                st = os.fstat(handle.fileno())
                self._signature = _signature(st)
                self._racy = time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < RACY_S * 1e9
                warning = check_file_mode(st.st_mode, source)
                keys = parse_keys_file(handle.read(), source)
            static = {entry.digest for entry in self._static}
            if any(_digest(key) in static for key in keys):
                raise KeysError(f"{source}: a key of the file is also an --api-key key (which names no tenant)")
        except (OSError, UnicodeDecodeError, KeysError) as exc:
            if strict:
                raise KeysError(f"API keys file: {exc}") from None
            if isinstance(exc, OSError):  # unreadable: read again once it changes, not on every request
                self._racy = False
                try:
                    self._signature = _signature(os.stat(self.keys_file))
                except OSError:
                    self._signature = None
            self._file = ()
            if str(exc) != self._problem:
                self._problem = str(exc)
                log.error("API keys file unusable, its keys are refused until it is fixed: %s", exc)
            return False
        entries = tuple(_Entry(_digest(key), tenant) for key, tenant in keys.items())
        changed = entries != self._file or self._problem is not None
        self._file, self._problem = entries, None
        if warning and (changed or strict):
            log.warning("API keys file: %s", warning)
        if changed and not strict:
            log.info("API keys file %s read: %d keys, %d tenants", source, len(keys), len(set(keys.values()) - {None}))
        return True

    def refresh(self) -> None:
        """Re-read the keys file if it changed since it was last read (one ``stat``)."""
        if self.keys_file is None:
            return
        try:
            now: _Signature | None = _signature(os.stat(self.keys_file))
        except OSError:
            now = None
        if now != self._signature or (self._racy and now is not None):
            if now is None:  # gone: say it once, not on every request
                self._signature, self._file, self._problem = None, (), "gone"
                log.error("API keys file %s is gone: its keys are refused", self.keys_file)
            else:
                self._load(strict=False)

    def authenticate(self, authorization: str | None) -> Caller | OpenAIError:
        """The caller of a request with this ``Authorization`` header, or the 401 to answer."""
        self.refresh()
        if not authorization:
            return _missing_key()
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return _incorrect_key()
        digest = _digest(token)
        entries = self._static + self._file
        matches = [hmac.compare_digest(digest, entry.digest) for entry in entries]  # every key, no early exit
        for entry, match in zip(entries, matches, strict=True):
            if match:
                return Caller(entry.tenant)
        return _incorrect_key()


class ApiKeyMiddleware:
    """Every request but ``OPEN_PATHS`` needs a key of ``keys``; the caller goes into the ASGI
    scope (``CALLER_SCOPE_KEY``) for the routes."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        caller = self.keys.authenticate(Headers(scope=scope).get("authorization"))
        if isinstance(caller, OpenAIError):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            response = JSONResponse(caller.body(), status_code=caller.status, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        scope[CALLER_SCOPE_KEY] = caller
        await self.app(scope, receive, send)


def caller_of(scope: Scope) -> Caller | None:
    """The authenticated caller of a request (None: the API takes no keys)."""
    caller = scope.get(CALLER_SCOPE_KEY)
    return caller if isinstance(caller, Caller) else None

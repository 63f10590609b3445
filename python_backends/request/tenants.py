"""Tenants: who a request's cache entries belong to, and (with a secret) who vouched for it.

A deployment that serves several customers from one node sets a tenant per request (the
Triton request parameter ``tenant``; the OpenAI endpoint maps ``X-Tenant`` / ``user`` to it).
With the ``isolated`` tenant policy (``CachePolicy.tenants``, the default) the tenant scopes
every store key and every ``mm_hash:`` reference the request makes (``store.keys.tenant_key``):
tenant B asking for tenant A's image is an ordinary miss that encodes, and B's ``mm_hash:``
for A's image is answered exactly like a hash no one sent. ``shared`` checks the tenant and
lets every tenant meet every entry. Requests without a tenant share the untenanted space.

Triton does not authenticate request parameters. Without a tenant secret the ``tenant`` is a
plain name, as the caller declares it: it must be set by something the deployment trusts (a
gateway, the OpenAI front end), not taken from end users unchecked. With a secret (a file
named by ``TRITON_EPD_TENANT_SECRET_FILE``, mode 600, read once per process and checked at
model load) the ``tenant`` must be a token the front end signed, ``TENANT.SIGNATURE``, where
SIGNATURE is base64url without padding of HMAC-SHA256(secret, ``TOKEN_CONTEXT`` + TENANT in
UTF-8) (:func:`sign_tenant`); anything else is INVALID_ARG while the parameters are parsed,
before the store is touched. ``epd`` passes the tenant on to its encoders re-signed
(:func:`tenant_parameter`): every server of a deployment needs the same secret.
The tenant and the token never appear in logs, keys on the wire or error messages.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import os
import stat
import unicodedata
from collections.abc import Mapping
from typing import Any

from python_backends import contract
from python_backends.errors import invalid_arg

MAX_TENANT_CHARS = 256
TENANT_SECRET_FILE_ENV = "TRITON_EPD_TENANT_SECRET_FILE"
# Domain separation: the same secret used for anything else never yields a tenant token.
TOKEN_CONTEXT = b"triton-epd/tenant-token/v1\x00"
MIN_SECRET_BYTES = 16  # a shorter secret could be guessed from one token offline
NOT_SIGNED = f"request parameter '{contract.TENANT}' is not a tenant signed by this deployment"


class TenantSecretError(ValueError):
    """The configured tenant secret file cannot be used (the model refuses to load)."""


def sign_tenant(secret: bytes, tenant: str) -> str:
    """The token that names ``tenant`` to a deployment with ``secret``: ``TENANT.SIGNATURE``."""
    # surrogatepass: a lone surrogate is signed (and then refused by check_tenant), not a crash.
    mac = hmac.new(secret, TOKEN_CONTEXT + tenant.encode("utf-8", "surrogatepass"), hashlib.sha256)
    return f"{tenant}.{base64.urlsafe_b64encode(mac.digest()).rstrip(b'=').decode('ascii')}"


def verify_tenant(secret: bytes, token: str) -> str:
    """The tenant that ``token`` names, if ``secret`` signed it; INVALID_ARG otherwise. The last
    dot separates the signature, so tenant names may contain dots. The signature is compared as
    text with the one canonical encoding: other base64 spellings of it are refused too."""
    tenant, dot, signature = token.rpartition(".")
    if not dot:
        raise invalid_arg(NOT_SIGNED)
    expected = sign_tenant(secret, tenant).rpartition(".")[2]
    if not hmac.compare_digest(expected.encode("ascii"), signature.encode("utf-8", "surrogatepass")):
        raise invalid_arg(NOT_SIGNED)
    return tenant


def read_tenant_secret(path: str | os.PathLike[str]) -> bytes:
    """The secret in the file at ``path`` (surrounding whitespace stripped); TenantSecretError if
    it cannot be read, its group or others may access it, or it holds under MIN_SECRET_BYTES."""
    where = f"tenant secret file {os.fspath(path)!r}"
    try:
        with open(path, "rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            secret = handle.read().strip()
    except OSError as exc:
        raise TenantSecretError(f"{where} cannot be read: {exc.strerror or type(exc).__name__}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        mode_text = f"mode {stat.S_IMODE(mode):o}"
        raise TenantSecretError(f"{where}: its group or others may access it ({mode_text}); chmod 600 it")
    if not secret:
        raise TenantSecretError(f"{where} is empty")
    if len(secret) < MIN_SECRET_BYTES:
        raise TenantSecretError(f"{where} holds {len(secret)} bytes, needs at least {MIN_SECRET_BYTES}")
    return secret


@functools.cache
def _secret_at(path: str) -> bytes:
    return read_tenant_secret(path)


def tenant_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The deployment's tenant secret (None: no ``TRITON_EPD_TENANT_SECRET_FILE``, plain tenant
    names); the file is read once per process. Models call it at load so a bad file fails there."""
    path = (os.environ if environ is None else environ).get(TENANT_SECRET_FILE_ENV)
    if path is None:
        return None
    if not path:  # set but empty: refuse rather than silently accept unsigned tenants
        raise TenantSecretError(f"{TENANT_SECRET_FILE_ENV} is set but names no file")
    try:
        return _secret_at(path)
    except TenantSecretError as exc:
        raise TenantSecretError(f"{TENANT_SECRET_FILE_ENV}: {exc}") from None


def check_tenant(value: Any) -> str:
    """The tenant a request names: a string of 1-256 characters without control characters,
    given as is, or (with a tenant secret) given as a token this deployment signed."""
    if not isinstance(value, str):
        raise invalid_arg(
            f"request parameter '{contract.TENANT}' must be a string, got {type(value).__name__}"
        )
    secret = tenant_secret()
    if secret is not None:
        value = verify_tenant(secret, value)
    if not value or len(value) > MAX_TENANT_CHARS:
        raise invalid_arg(
            f"request parameter '{contract.TENANT}' must have 1 to {MAX_TENANT_CHARS} characters, "
            f"got {len(value)}"
        )
    if any(unicodedata.category(char) in ("Cc", "Cs") for char in value):
        raise invalid_arg(f"request parameter '{contract.TENANT}' must not contain control characters")
    return value


def tenant_parameter(tenant: str) -> str:
    """The ``tenant`` parameter that passes a checked tenant on to another model or server of the
    deployment (the encoders): re-signed when there is a secret, which they check in turn."""
    secret = tenant_secret()
    return tenant if secret is None else sign_tenant(secret, tenant)


def key_space(tenant: str | None, policy: str) -> str | None:
    """The tenant whose key space a request uses: its own (``isolated``) or none (``shared``)."""
    if policy == "shared":
        return None
    if policy == "isolated":
        return tenant
    raise ValueError(f"tenant policy must be 'isolated' or 'shared', got {policy!r}")

"""Tenants: who a request's cache entries belong to.

A deployment that serves several customers from one node sets a tenant per request (the
Triton request parameter ``tenant``; the OpenAI endpoint maps ``X-Tenant`` / ``user`` to it).
With the ``isolated`` tenant policy (``CachePolicy.tenants``, the default) the tenant scopes
every store key and every ``mm_hash:`` reference the request makes (``store.keys.tenant_key``):
tenant B asking for tenant A's image is an ordinary miss that encodes, and B's ``mm_hash:``
for A's image is answered exactly like a hash no one sent. ``shared`` checks the tenant and
lets every tenant meet every entry. Requests without a tenant share the untenanted space.

Triton does not authenticate request parameters: the tenant must be set by something the
deployment trusts (a gateway, the OpenAI front end), not taken from end users unchecked.
The tenant never appears in logs, keys on the wire or error messages.
"""

from __future__ import annotations

import unicodedata
from typing import Any

from python_backends import contract
from python_backends.errors import invalid_arg

MAX_TENANT_CHARS = 256


def check_tenant(value: Any) -> str:
    """A tenant name as given: a string of 1-256 characters without control characters."""
    if not isinstance(value, str):
        raise invalid_arg(
            f"request parameter '{contract.TENANT}' must be a string, got {type(value).__name__}"
        )
    if not value or len(value) > MAX_TENANT_CHARS:
        raise invalid_arg(
            f"request parameter '{contract.TENANT}' must have 1 to {MAX_TENANT_CHARS} characters, "
            f"got {len(value)}"
        )
    if any(unicodedata.category(char) in ("Cc", "Cs") for char in value):
        raise invalid_arg(f"request parameter '{contract.TENANT}' must not contain control characters")
    return value


def key_space(tenant: str | None, policy: str) -> str | None:
    """The tenant whose key space a request uses: its own (``isolated``) or none (``shared``)."""
    if policy == "shared":
        return None
    if policy == "isolated":
        return tenant
    raise ValueError(f"tenant policy must be 'isolated' or 'shared', got {policy!r}")

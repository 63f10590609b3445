"""A request's Triton parameters (``request.parameters()``: a JSON object), read once.

Every model that takes request parameters (``epd`` and the ``encoder_<i>`` models) parses
them here, once per request, into one :class:`RequestParameters`:

- ``tenant``: whose cache entries the request meets (``tenants.py``);
- ``path``: the serving path of ``epd`` the request forces (``adaptive`` means the deployment's
  rule, as no parameter does);
- ``encoder``: the encoder model ``epd`` sends the request's misses to;
- ``by_value``: an encoder also answers the stored embedding (a PD server on another node asks);
- ``decode_reads``: ``stream`` makes ``epd`` read ``decode`` as one BLS stream (measurement only:
  ``EpdServer`` refuses it unless its server allows it);
- ``forward_media``: ``raw`` makes ``epd`` send each audio clip on to ``prefill`` too, which
  decodes and re-extracts it (measurement only, the same rule).

Unknown parameters are ignored, as Triton's own backends ignore them; a known one with a wrong
type or value is INVALID_ARG naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from python_backends import contract
from python_backends.errors import invalid_arg
from python_backends.request.tenants import check_tenant


def _as_mapping(raw: str | None) -> Mapping[str, Any]:
    if not raw:
        return {}
    try:
        parameters = json.loads(raw)
    except ValueError:
        return {}  # Triton always gives JSON; anything else carries no parameter
    return parameters if isinstance(parameters, dict) else {}


def _path(value: Any) -> str | None:
    if value is None:
        return None
    if value not in contract.PATH_POLICIES:
        raise invalid_arg(
            f"request parameter '{contract.PATH_REQUEST_PARAMETER}' must be one of "
            f"{', '.join(contract.PATH_POLICIES)}, got {value!r}"
        )
    return None if value == contract.ADAPTIVE_POLICY else str(value)


def _encoder(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise invalid_arg(
            f"request parameter '{contract.ENCODER_REQUEST_PARAMETER}' must be the name of an encoder model"
        )
    return value


def _is(values: Mapping[str, Any], key: str, choices: tuple[str, ...], chosen: str) -> bool:
    """Whether parameter ``key``, one of ``choices`` or absent, is ``chosen``."""
    value = values.get(key)
    if value is not None and value not in choices:
        raise invalid_arg(f"request parameter '{key}' must be one of {', '.join(choices)}, got {value!r}")
    return value == chosen


@dataclass(frozen=True)
class RequestParameters:
    tenant: str | None = None
    path: str | None = None
    encoder: str | None = None
    by_value: bool = False
    streamed_decode: bool = False
    raw_forwarding: bool = False

    @classmethod
    def parse(cls, raw: str | None) -> RequestParameters:
        """``raw``: ``request.parameters()`` as Triton gives it (JSON text, or None)."""
        values = _as_mapping(raw)
        tenant = values.get(contract.TENANT)
        return cls(
            tenant=None if tenant is None else check_tenant(tenant),
            path=_path(values.get(contract.PATH_REQUEST_PARAMETER)),
            encoder=_encoder(values.get(contract.ENCODER_REQUEST_PARAMETER)),
            by_value=values.get(contract.BY_VALUE) is True,
            streamed_decode=_is(values, contract.DECODE_READS_REQUEST_PARAMETER, contract.DECODE_READS, "stream"),
            raw_forwarding=_is(values, contract.FORWARD_MEDIA_REQUEST_PARAMETER, contract.FORWARD_MEDIA, "raw"),
        )

"""KV transfer parameters: what travels from prefill to decode (pure Python, no vLLM).

A transfer is what the prefill engine leaves behind for the decode engine: the KV cache of every
prompt token, and a record of it in the node's folder (:mod:`python_backends.pd.manifest`: the
on-disk layout, the manifest that commits it, the first token). This module holds the
parameters that name one transfer (:class:`TransferParams`), the ids and digests that bind it to
its prompt, and the keys each connector reads from a request's ``kv_transfer_params``.

Transfer parameters (small, JSON-able, versioned; the same object for every connector, the
connector's own ``kv_transfer_params`` inside)::

    {"version": 2, "transfer_id": "<32 hex>", "num_prompt_tokens": 300,
     "first_token_id": 17, "digest": "<64 hex>", "connector": "TransferIdConnector",
     "kv_transfer_params": {...}}

Who calls what: the prefill side (``pd/kv_transfer.py``) builds :class:`TransferParams`; the
decode wrapper (``pd/engines.py``) parses and validates them (:meth:`TransferParams.parse`, any
defect is INVALID_ARG) before checking them against the manifest; ``TransferIdConnector``
(``pd/connector.py``) reads the ``epd_*`` keys. Nothing here imports vLLM, torch or Triton.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from python_backends.errors import invalid_arg

PARAMS_VERSION = 2
_TRANSFER_ID = re.compile(r"^[0-9a-f]{32}$")
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
# Keys the connector reads from a request's ``kv_transfer_params``. They are our own names
# on purpose: vLLM's output processor treats ``do_remote_prefill`` (Nixl's key) specially
# and would overwrite ``num_cached_tokens``, which the decode side uses as its proof.
KEY_TRANSFER_ID = "epd_transfer_id"
KEY_DIGEST = "epd_digest"
KEY_NUM_TOKENS = "epd_num_prompt_tokens"
# The connectors whose ``kv_transfer_params`` the transfer parameters carry. TransferIdConnector
# (ours, the cpu default) keeps KV in the node's folder; NixlConnector (vLLM's, GPU to GPU) keeps
# it in the prefill engine's blocks until decode reads them.
TRANSFER_ID_CONNECTOR = "TransferIdConnector"
NIXL_CONNECTOR = "NixlConnector"
CONNECTORS = (TRANSFER_ID_CONNECTOR, NIXL_CONNECTOR)
# What Nixl's decode side needs from its prefill side's kv_transfer_params (vLLM 0.32,
# nixl/pull_scheduler.py: get_num_new_matched_tokens / update_state_after_alloc).
NIXL_REQUIRED_KEYS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")
# vLLM reports this P-side count as decode's ``num_cached_tokens`` (output_processor.py), which
# would hide whether decode loaded the KV: prefill drops it before the parameters leave.
NIXL_REPORTED_CACHE_KEY = "remote_prefill_cached_tokens"
# Nixl's remote_block_ids grow with the prompt (one id per KV block: ~2 KB for 8k tokens of 16).
MAX_PARAMS_BYTES = 64 * 1024


def new_transfer_id() -> str:
    return uuid.uuid4().hex


def is_transfer_id(value: object) -> bool:
    return isinstance(value, str) and bool(_TRANSFER_ID.match(value))

def is_digest(value: object) -> bool:
    """Whether ``value`` is a SHA-256 hex digest as the digests here write them."""
    return isinstance(value, str) and bool(_DIGEST.match(value))


def prompt_digest(token_ids: Sequence[int], mm_hashes: Sequence[str]) -> str:
    """SHA-256 over the prompt token ids and multimodal hashes (binds KV to its input)."""
    h = hashlib.sha256()
    h.update(b"epd-kv-v1\0")
    h.update(json.dumps([list(map(int, token_ids)), list(mm_hashes)], separators=(",", ":")).encode())
    return h.hexdigest()

def _int_field(data: Mapping[str, Any], key: str, minimum: int) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_arg(f"KV transfer parameter {key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise invalid_arg(f"KV transfer parameter {key!r} must be >= {minimum}, got {value}")
    return value


def kv_params_digest(kv_transfer_params: Mapping[str, Any]) -> str:
    """SHA-256 of a connector's ``kv_transfer_params`` in canonical JSON (recorded by prefill,
    compared by decode: altered block ids would read whatever lives in those blocks now)."""
    text = json.dumps(kv_transfer_params, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(b"epd-kv-params-v1\0" + text.encode()).hexdigest()


@dataclass(frozen=True)
class TransferParams:
    """What decode needs from prefill: one contract for every connector. Built by the prefill
    wrapper, carried by ``epd`` as the ``transfer_params`` tensor, validated by decode.

    ``kv_transfer_params`` are the connector's own (handed to the decode engine's request as
    they are): for TransferIdConnector our ``epd_*`` keys (derived from the other fields, and
    checked to be exactly those), for NixlConnector what vLLM's prefill request returned.
    ``transfer_id`` names the node's record of the transfer (manifest, first token) for every
    connector, so decode checks the same things whichever moves the KV.
    """

    transfer_id: str
    num_prompt_tokens: int
    first_token_id: int
    digest: str
    connector: str = TRANSFER_ID_CONNECTOR
    kv_transfer_params: Mapping[str, Any] | None = None
    version: int = PARAMS_VERSION

    def __post_init__(self) -> None:
        if self.kv_transfer_params is None and self.connector == TRANSFER_ID_CONNECTOR:
            derived: dict[str, Any] = {KEY_TRANSFER_ID: self.transfer_id, KEY_DIGEST: self.digest}
            derived[KEY_NUM_TOKENS] = self.num_prompt_tokens
            object.__setattr__(self, "kv_transfer_params", derived)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def parse(cls, raw: str | bytes | Mapping[str, Any]) -> TransferParams:
        """Parse and validate; any defect is an INVALID_ARG :class:`EpdError`."""
        if isinstance(raw, (str, bytes)):
            if len(raw) > MAX_PARAMS_BYTES:
                raise invalid_arg(f"KV transfer parameters are over {MAX_PARAMS_BYTES} bytes")
            try:
                data = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                raise invalid_arg("KV transfer parameters are not valid JSON") from None
        else:
            data = raw
        if not isinstance(data, Mapping):
            raise invalid_arg("KV transfer parameters must be a JSON object")
        known = {"version", "transfer_id", "num_prompt_tokens", "first_token_id", "digest", "connector",
                 "kv_transfer_params"}
        unknown = set(data) - known
        if unknown:
            raise invalid_arg(f"unknown KV transfer parameter(s): {sorted(unknown)}")
        version = data.get("version")
        if version != PARAMS_VERSION:
            raise invalid_arg(
                f"KV transfer parameters version {version!r} is not supported (expected {PARAMS_VERSION})"
            )
        transfer_id = data.get("transfer_id")
        if not isinstance(transfer_id, str) or not is_transfer_id(transfer_id):
            raise invalid_arg("KV transfer parameter 'transfer_id' must be 32 lowercase hex characters")
        digest = data.get("digest")
        if not isinstance(digest, str) or not is_digest(digest):
            raise invalid_arg("KV transfer parameter 'digest' must be 64 lowercase hex characters")
        connector = data.get("connector")
        if connector not in CONNECTORS:
            raise invalid_arg(f"KV transfer parameter 'connector' must be one of {list(CONNECTORS)}, got {connector!r}")
        kv = data.get("kv_transfer_params")
        if not isinstance(kv, Mapping):
            raise invalid_arg("KV transfer parameter 'kv_transfer_params' must be a JSON object")
        params = cls(
            transfer_id=transfer_id,
            num_prompt_tokens=_int_field(data, "num_prompt_tokens", 1),
            first_token_id=_int_field(data, "first_token_id", 0),
            digest=digest,
            connector=connector,
            kv_transfer_params=dict(kv),
        )
        params._check_connector_params()
        return params

    def _check_connector_params(self) -> None:
        kv = self.connector_params()
        if self.connector == TRANSFER_ID_CONNECTOR:
            expected = TransferParams(self.transfer_id, self.num_prompt_tokens, self.first_token_id, self.digest)
            if kv != expected.connector_params():
                raise invalid_arg("TransferIdConnector's kv_transfer_params must name this transfer, digest and length")
            return
        missing = [key for key in NIXL_REQUIRED_KEYS if key not in kv]
        if kv.get("do_remote_prefill") is not True or missing:
            raise invalid_arg(
                f"kv_transfer_params of {self.connector} must come from its prefill request "
                f"(do_remote_prefill true; missing {missing})"
            )

    def connector_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` the decode engine's request carries (a copy: vLLM's
        connectors update the dict they are given)."""
        return copy.deepcopy(dict(self.kv_transfer_params or {}))

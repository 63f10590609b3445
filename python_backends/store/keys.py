"""Content keys of the embedding store.

A key covers everything that decides the embeddings: the media bytes, the preprocessing
config and the encoder version. Changing any of them gives another key, so a rebuilt
encoder or a new resize setting can never be served old embeddings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import blake3

from python_backends.errors import invalid_arg

# Bumped if the framing below ever changes, so old and new keys never collide.
_KEY_DOMAIN = b"triton-epd/content-key/v1"


def content_key(media: bytes, preprocess_config: Mapping[str, Any], encoder_version: str) -> str:
    """BLAKE3 (256-bit, hex) of media bytes + canonical preprocessing config + encoder version.

    Each part is length-prefixed so that no two different inputs frame to the same bytes.
    The config is canonical JSON (sorted keys), so dict order does not change the key.
    """
    if not isinstance(media, (bytes, bytearray, memoryview)) or len(media) == 0:
        raise invalid_arg("content_key needs the media as non-empty bytes")
    if not isinstance(encoder_version, str) or not encoder_version:
        raise invalid_arg("content_key needs a non-empty encoder version string")
    hasher = blake3.blake3(_KEY_DOMAIN)
    for part in (bytes(media), _canonical_config(preprocess_config), encoder_version.encode("utf-8")):
        hasher.update(len(part).to_bytes(8, "little"))
        hasher.update(part)
    return hasher.hexdigest()


def _canonical_config(config: Mapping[str, Any]) -> bytes:
    if not isinstance(config, Mapping):
        raise invalid_arg(f"preprocessing config must be a mapping, got {type(config).__name__}")
    try:
        return json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise invalid_arg(f"preprocessing config must be plain JSON data to be part of a key: {exc}") from None

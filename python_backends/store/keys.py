"""Content keys of the embedding store.

A key covers everything that decides the embeddings: the media bytes, the preprocessing
config and the encoder version. Changing any of them gives another key, so a rebuilt
encoder or a new resize setting can never be served old embeddings.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

from python_backends.errors import invalid_arg

# Bumped if the framing below ever changes, so old and new keys never collide.
_KEY_DOMAIN = b"triton-epd/content-key/v1"
_TENANT_DOMAIN = b"triton-epd/tenant-key/v1"


def content_key(
    media: bytes, preprocess_config: Mapping[str, Any], encoder_version: str, namespace: str = ""
) -> str:
    """BLAKE3 (256-bit, hex) of media bytes + canonical preprocessing config + encoder version.

    Each part is length-prefixed so that no two different inputs frame to the same bytes.
    The config is canonical JSON (sorted keys), so dict order does not change the key.
    ``namespace`` (empty for the node-wide cache) separates key spaces that must not share
    entries, e.g. per-encoder-instance caches.
    """
    if not isinstance(media, (bytes, bytearray, memoryview)) or len(media) == 0:
        raise invalid_arg("content_key needs the media as non-empty bytes")
    if not isinstance(encoder_version, str) or not encoder_version:
        raise invalid_arg("content_key needs a non-empty encoder version string")
    hasher = blake3.blake3(_KEY_DOMAIN)
    parts = [bytes(media), _canonical_config(preprocess_config), encoder_version.encode("utf-8")]
    if namespace:  # absent for the node-wide space, so its keys stay what they were
        parts.append(namespace.encode("utf-8"))
    for part in parts:
        hasher.update(len(part).to_bytes(8, "little"))
        hasher.update(part)
    return hasher.hexdigest()


def tenant_key(key: str, tenant: str | None) -> str:
    """The store key of ``key`` (a content key, or the ``mm_hash`` a client sent) in ``tenant``'s
    key space; ``key`` itself when there is no tenant (or tenants share entries).

    A client only ever sees unscoped keys (``mm_hash``); the store only ever sees scoped ones.
    So ``mm_hash:<hex>`` is read in the sender's space: another tenant's image, or a hash
    learnt from another tenant, is the same miss as a hash no one ever sent.
    """
    if tenant is None:
        return key
    if not isinstance(key, str) or not key:
        raise invalid_arg("tenant_key needs a non-empty key")
    hasher = blake3.blake3(_TENANT_DOMAIN)
    for part in (tenant.encode("utf-8"), key.encode("ascii")):
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


MODALITIES = ("image", "video", "audio")


@dataclass(frozen=True)
class KeyConfig:
    """What a content key covers besides the media bytes: the preprocessing config and the
    encoder version (the digest of the served encoder file). Every model that computes keys
    (``epd``, the ``encoder_<i>`` models) builds it from the same files and parameters.

    A video's key also covers the video processor's config (``video_preprocessor_config.json``
    beside the image one, when there is one) and the frame sampling (``video_sampling``: fps,
    frame bounds, as :class:`python_backends.request.videos.VideoSamplingConfig` gives them): other
    frames or another frame size are other embeddings. An audio clip's key covers the feature
    extractor's config (an audio checkpoint's ``preprocessor_config.json``). An image's key also
    covers the preprocessing kernels (``image_backend``): torchvision and DALI pixels differ."""

    preprocess_config: Mapping[str, Any]
    encoder_version: str
    video_config: Mapping[str, Any] = field(default_factory=dict)
    video_sampling: Mapping[str, Any] = field(default_factory=dict)
    # The kernels that made an image's pixels ("torchvision", "dali"); they differ in the last bits.
    image_backend: str = "torchvision"
    # The vision encoder's precision ("fp32", "bf16"): one file, other embeddings.
    vit_precision: str = "fp32"

    @classmethod
    def from_files(
        cls,
        preprocessor_config: Path,
        encoder_file: Path,
        video_sampling: Mapping[str, Any] | None = None,
        image_backend: str = "torchvision",
        vit_precision: str = "fp32",
    ) -> KeyConfig:
        if not encoder_file.is_file():
            raise ValueError(f"encoder file {encoder_file} does not exist; regenerate the repository")
        digest = hashlib.sha256()
        with encoder_file.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        video_file = preprocessor_config.parent / "video_preprocessor_config.json"
        video_config = json.loads(video_file.read_text()) if video_file.is_file() else {}
        image_config = json.loads(preprocessor_config.read_text())
        version = digest.hexdigest() if vit_precision == "fp32" else f"{digest.hexdigest()}:{vit_precision}"
        return cls(image_config, version, video_config, dict(video_sampling or {}), image_backend, vit_precision)

    def _config_of(self, modality: str) -> Mapping[str, Any]:
        if modality == "image":
            return {"image": self.preprocess_config, "backend": self.image_backend}
        if modality == "video":
            return {
                "modality": "video",
                "image": self.preprocess_config,
                "video": self.video_config,
                "sampling": self.video_sampling,
            }
        if modality == "audio":  # an audio checkpoint's preprocessor_config.json: its feature extractor's
            return {"modality": "audio", "features": self.preprocess_config}
        raise invalid_arg(f"no content key for modality {modality!r}; one of {', '.join(MODALITIES)}")

    def key(self, media: bytes, namespace: str = "", modality: str = "image") -> str:
        return content_key(media, self._config_of(modality), self.encoder_version, namespace)

    def scoped(
        self, media: bytes, tenant: str | None, namespace: str = "", modality: str = "image"
    ) -> tuple[str, str]:
        """(the client's ``mm_hash``, the store key in ``tenant``'s space) of ``media``."""
        public = self.key(media, namespace, modality)
        return public, tenant_key(public, tenant)

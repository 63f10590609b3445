"""The on-disk record of one KV transfer: its folder, manifest and first token (pure Python).

Written under ``<store>/<transfer_id>/`` (``store`` is ``kv_connector_extra_config["store_path"]``,
on tmpfs) by :class:`python_backends.pd.connector.TransferIdConnector` inside the prefill engine
(or by the prefill wrapper for NixlConnector), read back by the decode wrapper and by the same
connector class inside the decode engine. Layout of one transfer folder::

    <store>/<transfer_id>/chunk-<start>-<end>.safetensors   # TransferIdConnector only: one per
                                                            # scheduled prefill chunk; keys =
                                                            # attention layer names, values =
                                                            # the KV pages those tokens touch
    <store>/<transfer_id>/manifest.json                     # written last: the commit marker
    <store>/<transfer_id>/first_token.json                  # the token prefill sampled

A transfer is complete only when ``manifest.json`` exists; the manifest lists the chunks, the
prompt token ids (with image placeholders expanded), the multimodal hashes, and a digest over
both. With NixlConnector (the gpu target's choice) the KV stays in the prefill engine's GPU
blocks: the folder then holds only the manifest (no chunks, plus the digest of Nixl's
``kv_transfer_params``) and the first token. The decode side trusts nothing it is handed: the
manifest is validated against the transfer parameters (:func:`check_manifest`), and the
connector checks the decode request's own token ids and multimodal hashes against the manifest
before it loads a byte. Also here: the expiry sweep and the listing (leak checks, metrics).
Nothing here imports vLLM, torch or Triton.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from python_backends.errors import EpdError, ErrorCode, invalid_arg
from python_backends.pd.transfer import (
    CONNECTORS,
    TRANSFER_ID_CONNECTOR,
    TransferParams,
    is_digest,
    is_transfer_id,
    kv_params_digest,
    prompt_digest,
)

MANIFEST_VERSION = 1
MANIFEST_NAME = "manifest.json"
FIRST_TOKEN_NAME = "first_token.json"
_CHUNK = re.compile(r"^chunk-(\d{8})-(\d{8})\.safetensors$")


def transfer_dir(store: Path, transfer_id: str) -> Path:
    """The folder of one transfer; refuses anything that is not a transfer id (no traversal)."""
    if not is_transfer_id(transfer_id):
        raise invalid_arg(f"transfer_id must be 32 lowercase hex characters, got {transfer_id!r}")
    return store / transfer_id


def chunk_name(start: int, end: int) -> str:
    return f"chunk-{start:08d}-{end:08d}.safetensors"


def parse_chunk_name(name: str) -> tuple[int, int] | None:
    match = _CHUNK.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


@dataclass(frozen=True)
class Manifest:
    """The commit record of one transfer. TransferIdConnector: written by the connector's
    producer side, with the chunks and layers of the KV files beside it. Any other connector
    (the KV stays in the prefill engine): written by the prefill wrapper, no chunks or layers,
    with the digest of the connector's ``kv_transfer_params`` that decode must be given."""

    transfer_id: str
    token_ids: list[int]
    mm_hashes: list[str]
    chunks: list[tuple[int, int]]
    layers: list[str]
    block_size: int
    created: float
    # (offset, length) of each multimodal item's placeholder run in token_ids
    mm_placeholders: list[tuple[int, int]] = field(default_factory=list)
    connector: str = TRANSFER_ID_CONNECTOR
    kv_params_digest: str = ""  # connectors other than TransferIdConnector: kv_params_digest(...)
    version: int = MANIFEST_VERSION

    @property
    def holds_kv(self) -> bool:
        """Whether the KV itself is in the transfer's folder (TransferIdConnector)."""
        return self.connector == TRANSFER_ID_CONNECTOR

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def digest(self) -> str:
        return prompt_digest(self.token_ids, self.mm_hashes)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["chunks"] = [list(c) for c in self.chunks]
        data["mm_placeholders"] = [list(p) for p in self.mm_placeholders]
        data["digest"] = self.digest
        return data

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        """Validate a manifest read from disk; a defect raises ValueError."""
        if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION:
            raise ValueError("not a version-1 manifest")
        token_ids = data.get("token_ids")
        if not isinstance(token_ids, list) or not token_ids or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids
        ):
            raise ValueError("token_ids must be a non-empty list of token ids")
        mm_hashes = data.get("mm_hashes")
        if not isinstance(mm_hashes, list) or not all(isinstance(h, str) for h in mm_hashes):
            raise ValueError("mm_hashes must be a list of strings")
        connector = data.get("connector", TRANSFER_ID_CONNECTOR)
        if connector not in CONNECTORS:
            raise ValueError(f"unknown connector {connector!r}")
        holds_kv = connector == TRANSFER_ID_CONNECTOR
        layers = data.get("layers")
        if not isinstance(layers, list) or (holds_kv and not layers) or not all(isinstance(x, str) for x in layers):
            raise ValueError("layers must be a non-empty list of layer names")
        chunks = [tuple(c) for c in data.get("chunks", [])]
        kv_digest = data.get("kv_params_digest", "")
        if holds_kv:
            check_chunks_cover(chunks, len(token_ids))
        elif chunks or not is_digest(kv_digest):
            raise ValueError(f"a {connector} transfer has no chunks and needs the digest of its kv_transfer_params")
        placeholders = [tuple(p) for p in data.get("mm_placeholders", [])]
        check_placeholders(placeholders, len(token_ids))
        if len(placeholders) != len(mm_hashes):
            raise ValueError("one placeholder range per multimodal item is required")
        manifest = cls(
            transfer_id=str(data.get("transfer_id")),
            token_ids=token_ids,
            mm_hashes=mm_hashes,
            chunks=chunks,  # type: ignore[arg-type]
            layers=layers,
            block_size=int(data.get("block_size", 0)),
            created=float(data.get("created", 0.0)),
            mm_placeholders=placeholders,  # type: ignore[arg-type]
            connector=connector,
            kv_params_digest=kv_digest if not holds_kv else "",
        )
        if not is_transfer_id(manifest.transfer_id):
            raise ValueError("bad transfer_id")
        if data.get("digest") != manifest.digest:
            raise ValueError("digest does not match token_ids and mm_hashes")
        return manifest


def check_chunks_cover(chunks: Sequence[Sequence[int]], num_tokens: int) -> None:
    """Chunks must tile ``[0, num_tokens)`` in order without gaps or overlaps."""
    position = 0
    for chunk in chunks:
        if len(chunk) != 2:
            raise ValueError(f"chunk {chunk!r} is not a (start, end) pair")
        start, end = chunk
        if not (isinstance(start, int) and isinstance(end, int)) or start != position or end <= start:
            raise ValueError(f"chunks do not tile the prompt: {list(chunks)!r}")
        position = end
    if position != num_tokens:
        raise ValueError(f"chunks cover {position} of {num_tokens} prompt tokens")


def check_placeholders(placeholders: Sequence[Sequence[int]], num_tokens: int) -> None:
    """Placeholder runs must be in order, non-overlapping, non-empty and inside the prompt."""
    position = 0
    for item in placeholders:
        if len(item) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in item):
            raise ValueError(f"placeholder {item!r} is not an (offset, length) pair")
        offset, length = item
        if offset < position or length < 1 or offset + length > num_tokens:
            raise ValueError(f"placeholder ranges are out of order or out of bounds: {list(placeholders)!r}")
        position = offset + length


def collapse_placeholders(token_ids: Sequence[int], placeholders: Sequence[Sequence[int]]) -> list[int]:
    """The prompt as the model's processor wants it: each expanded run back to one token.

    vLLM expands an image placeholder token into one token per embedding row when it
    processes a prompt; given an already expanded prompt it would expand again. The decode
    side therefore submits the collapsed form, which vLLM expands to exactly the prefilled
    token ids (the connector checks that before loading).
    """
    check_placeholders(placeholders, len(token_ids))
    out: list[int] = []
    position = 0
    for offset, length in placeholders:
        out.extend(token_ids[position:offset])
        out.append(token_ids[offset])
        position = offset + length
    out.extend(token_ids[position:])
    return out


def placeholder_runs(token_ids: Sequence[int], placeholder_id: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(offset, length) of each image's expanded placeholder run in a prompt vLLM processed:
    the maximal runs of ``placeholder_id``, which must be one per image with the image's number
    of embedding rows (``sizes``). Used where no connector reports the placeholders (Nixl)."""
    runs: list[tuple[int, int]] = []
    index = 0
    while index < len(token_ids):
        if token_ids[index] != placeholder_id:
            index += 1
            continue
        start = index
        while index < len(token_ids) and token_ids[index] == placeholder_id:
            index += 1
        runs.append((start, index - start))
    if [length for _, length in runs] != list(sizes):
        raise ValueError(
            f"image placeholder runs {[length for _, length in runs]} differ from the images' sizes {list(sizes)}"
        )
    return runs


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_manifest(store: Path, manifest: Manifest) -> Path:
    """Commit a transfer: the manifest appears atomically, after every chunk."""
    folder = transfer_dir(store, manifest.transfer_id)
    if not manifest.holds_kv:
        folder.mkdir(parents=True, exist_ok=True)
    for start, end in manifest.chunks:
        if not (folder / chunk_name(start, end)).is_file():
            raise FileNotFoundError(f"chunk {start}-{end} of transfer {manifest.transfer_id} is missing")
    path = folder / MANIFEST_NAME
    _atomic_write(path, json.dumps(manifest.to_dict(), separators=(",", ":")))
    return path


def read_manifest(store: Path, transfer_id: str) -> Manifest:
    """The committed manifest of a transfer, or NOT_FOUND / INTERNAL :class:`EpdError`."""
    path = transfer_dir(store, transfer_id) / MANIFEST_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise EpdError(
            f"KV transfer {transfer_id} not found: unknown, already consumed, or expired",
            ErrorCode.NOT_FOUND,
        ) from None
    try:
        manifest = Manifest.from_dict(json.loads(text))
    except ValueError as exc:
        raise EpdError(f"KV transfer {transfer_id} is damaged: {exc}", ErrorCode.INTERNAL) from None
    if manifest.transfer_id != transfer_id:
        raise EpdError(f"KV transfer {transfer_id} is damaged: manifest names another transfer", ErrorCode.INTERNAL)
    return manifest


def write_first_token(store: Path, transfer_id: str, token_id: int) -> None:
    """Record the token prefill sampled, so decode can refuse an altered ``first_token_id``."""
    _atomic_write(transfer_dir(store, transfer_id) / FIRST_TOKEN_NAME, json.dumps({"first_token_id": int(token_id)}))


def read_first_token(store: Path, transfer_id: str) -> int | None:
    try:
        data = json.loads((transfer_dir(store, transfer_id) / FIRST_TOKEN_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return None
    value = data.get("first_token_id") if isinstance(data, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_manifest(params: TransferParams, manifest: Manifest, first_token_id: int | None = None) -> None:
    """The parameters a client sent must describe exactly the committed transfer.

    ``first_token_id`` is the one prefill recorded (:func:`read_first_token`); ``None``
    means none was recorded, which is itself a mismatch.
    """
    if manifest.digest != params.digest or manifest.num_tokens != params.num_prompt_tokens:
        raise invalid_arg(
            f"KV transfer parameters do not match transfer {params.transfer_id} "
            "(digest or token count differ): they were altered or belong to another prompt"
        )
    if first_token_id != params.first_token_id:
        raise invalid_arg(
            f"KV transfer parameters do not match transfer {params.transfer_id}: "
            "first_token_id differs from the token prefill produced"
        )
    if manifest.connector != params.connector or (
        not manifest.holds_kv and manifest.kv_params_digest != kv_params_digest(params.connector_params())
    ):
        raise invalid_arg(
            f"KV transfer parameters do not match transfer {params.transfer_id}: "
            f"the {params.connector} kv_transfer_params differ from the ones prefill recorded"
        )


def remove_transfer(store: Path, transfer_id: str) -> bool:
    """Delete one transfer's folder; True when something was removed."""
    folder = transfer_dir(store, transfer_id)
    if not folder.exists():
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return True


def sweep_expired(store: Path, max_age_s: float, now: float | None = None) -> list[str]:
    """Remove transfers (committed or not) whose folder is older than ``max_age_s``.

    Called by the producer now and then, so that a prefill whose decode never came (client
    gone, BLS crashed) does not leak memory in ``/dev/shm``. Returns the removed ids.
    """
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        entries = list(os.scandir(store))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if not is_transfer_id(entry.name):
            continue
        try:
            age = now - entry.stat().st_mtime
        except FileNotFoundError:
            continue
        if age > max_age_s:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
    return removed


def list_transfers(store: Path) -> list[str]:
    """Ids of the transfer folders present (committed or not); for leak checks and metrics."""
    try:
        return sorted(e.name for e in os.scandir(store) if is_transfer_id(e.name))
    except FileNotFoundError:
        return []

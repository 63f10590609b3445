"""The embedding reference: what travels through Triton instead of embeddings.

A reference names one entry of a node's embedding store and carries the structure that
the LLM side needs to rebuild the input layout (placeholder count, grid) without seeing
the media. It is small (``MAX_REFERENCE_BYTES``), versioned, signed by the store and
validated on every read. It holds no address or offset: the store looks the entry up by
key, so a reference can never make a reader touch memory outside its own entry.

Wire format (version 1): one UTF-8 JSON object, compact (no spaces), keys sorted, every
field required, no other field allowed:

========  ===========================  ====================================================
key       type                          meaning
========  ===========================  ====================================================
``v``     int                           Format version; this module reads ``1`` only.
``mod``   str                           Modality: ``image``, ``video`` or ``audio``.
``mm``    str, 1-128 of [A-Za-z0-9_.:-] mm_hash: the identifier the LLM engine uses for this
                                        item (e.g. for vLLM's multimodal prefix caching).
``sid``   str, 32 lowercase hex         Id of the store that issued the reference; another
                                        store answers NOT_FOUND.
``loc``   str, 1-128 printable ASCII    Where that store lives, e.g. ``shm://<hostname>``
                                        (for a fetch from another node; informative here).
``key``   str, 16-128 lowercase hex     Content key of the entry (``content_key``: media
                                        bytes + preprocessing config + encoder version).
``gen``   int, 1 .. 2**63-1             Generation of the entry. Every insert gets a new
                                        one, so a reference to an evicted entry never
                                        matches an entry re-inserted under the same key.
``lease`` str, "" or 16-32 lowercase    The lease that keeps the entry from eviction while
          hex                           the request that holds the reference runs; "" when
                                        the issuer took none. The holder releases it.
``dt``    str                           Element type: ``float16``, ``float32`` or
                                        ``bfloat16`` (read as ``uint16`` bit patterns; view
                                        as bfloat16 in torch).
``sh``    list of 1-4 ints, 1 .. 2**31-1 Shape, ``[tokens, hidden]`` for vision embeddings.
``nb``    int, 1 .. 2**40               Byte length: must equal prod(shape) * itemsize.
``n``     int >= 1                      Placeholder tokens this item fills in the prompt;
                                        must equal ``sh[0]``.
``grid``  [t, h, w] ints 1..65535       Patch grid before the spatial merge (Qwen2-VL's
          or null                       ``image_grid_thw`` row); with the merge size
                                        known, t*h*w / merge**2 must equal ``n``.
``tag``   str, 64 lowercase hex         HMAC-SHA256, keyed by the store's secret, over the
                                        canonical JSON of all other fields. A reference
                                        edited after signing fails verification.
========  ===========================  ====================================================

``parse_reference`` checks everything that needs no store (size, JSON, types, ranges,
dtype, byte length, placeholders, grid) and the tag when given the secret; failures are
:class:`EpdError` ``INVALID_ARG`` with a message naming the field. Whether the entry still
exists (unknown, evicted, other store) is the store's check and answers ``NOT_FOUND``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from python_backends.errors import invalid_arg

FORMAT_VERSION = 1
MAX_REFERENCE_BYTES = 1024
MODALITIES = frozenset({"image", "video", "audio"})
# Name on the wire -> numpy type the bytes are read as (little-endian, as stored).
DTYPES: Mapping[str, str] = {"float16": "<f2", "float32": "<f4", "bfloat16": "<u2"}

MAX_NDIM = 4
MAX_DIM = 2**31 - 1
MAX_NBYTES = 2**40
MAX_GENERATION = 2**63 - 1
MAX_GRID_SIDE = 65535

_MM_HASH = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
_STORE_ID = re.compile(r"[0-9a-f]{32}")
_LOCATION = re.compile(r"[\x21-\x7e]{1,128}")
_KEY = re.compile(r"[0-9a-f]{16,128}")
_LEASE_ID = re.compile(r"(?:[0-9a-f]{16,32})?")
_TAG = re.compile(r"[0-9a-f]{64}")

# JSON key -> attribute, in one place so the wire names and the dataclass cannot drift.
_WIRE_NAMES: Mapping[str, str] = {
    "v": "version",
    "mod": "modality",
    "mm": "mm_hash",
    "sid": "store_id",
    "loc": "location",
    "key": "key",
    "gen": "generation",
    "lease": "lease_id",
    "dt": "dtype",
    "sh": "shape",
    "nb": "nbytes",
    "n": "num_placeholders",
    "grid": "grid_thw",
    "tag": "tag",
}


@dataclass(frozen=True)
class Reference:
    """One signed reference. Build with :func:`make_reference`, read with :func:`parse_reference`."""

    modality: str
    mm_hash: str
    store_id: str
    location: str
    key: str
    generation: int
    lease_id: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    num_placeholders: int
    grid_thw: tuple[int, int, int] | None
    tag: str
    version: int = FORMAT_VERSION

    def to_bytes(self) -> bytes:
        """The wire form (canonical JSON, <= ``MAX_REFERENCE_BYTES``)."""
        return _canonical_json(_wire_fields(self, with_tag=True))

    def numpy_dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype])


def make_reference(
    *,
    modality: str,
    mm_hash: str,
    store_id: str,
    location: str,
    key: str,
    generation: int,
    lease_id: str,
    dtype: str,
    shape: tuple[int, ...],
    num_placeholders: int,
    grid_thw: tuple[int, int, int] | None,
    secret: bytes,
    merge_size: int | None = None,
) -> Reference:
    """A validated reference signed with ``secret``. Called by the store, which owns the secret."""
    unsigned = Reference(
        modality=modality,
        mm_hash=mm_hash,
        store_id=store_id,
        location=location,
        key=key,
        generation=generation,
        lease_id=lease_id,
        dtype=dtype,
        shape=tuple(int(d) for d in shape),
        nbytes=_expected_nbytes(dtype, shape) if dtype in DTYPES else 0,
        num_placeholders=num_placeholders,
        grid_thw=None if grid_thw is None else tuple(int(x) for x in grid_thw),  # type: ignore[arg-type]
        tag="0" * 64,
    )
    check_reference(unsigned, merge_size=merge_size)
    signed = _replace_tag(unsigned, compute_tag(unsigned, secret))
    _check_wire_size(len(signed.to_bytes()))
    return signed


def parse_reference(data: bytes, *, merge_size: int | None = None, secret: bytes | None = None) -> Reference:
    """Read and validate a reference from its wire form.

    Called by any stage that receives a reference (prefill, decode, the BLS). Checks size,
    JSON, field types and ranges, layout and, when ``secret`` is given, the tag. Raises
    :class:`EpdError` ``INVALID_ARG``; never returns a partly checked reference.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise invalid_arg(f"embedding reference must be bytes, got {type(data).__name__}")
    _check_wire_size(len(data))
    fields = _decode_json_object(bytes(data))
    reference = _reference_from_fields(fields)
    check_reference(reference, merge_size=merge_size)
    if secret is not None:
        verify_tag(reference, secret)
    return reference


def check_reference(reference: Reference, *, merge_size: int | None = None) -> None:
    """Semantic checks shared by signing and parsing (types are already right here)."""
    _check_version(reference.version)
    check_item(reference.modality, reference.mm_hash)
    _check_pattern("sid", reference.store_id, _STORE_ID)
    check_location(reference.location)
    _check_pattern("key", reference.key, _KEY)
    _check_range("gen", reference.generation, 1, MAX_GENERATION)
    _check_pattern("lease", reference.lease_id, _LEASE_ID)
    _check_pattern("tag", reference.tag, _TAG)
    check_layout(
        dtype=reference.dtype,
        shape=reference.shape,
        nbytes=reference.nbytes,
        num_placeholders=reference.num_placeholders,
        grid_thw=reference.grid_thw,
        merge_size=merge_size,
    )


def check_location(location: str) -> None:
    _check_pattern("loc", location, _LOCATION)


def check_item(modality: str, mm_hash: str) -> None:
    """The item's identity fields; the store applies them to ``put`` as well."""
    _check_pattern("mod", modality, None, allowed=MODALITIES)
    _check_pattern("mm", mm_hash, _MM_HASH)


def check_layout(
    *,
    dtype: str,
    shape: tuple[int, ...],
    nbytes: int,
    num_placeholders: int,
    grid_thw: tuple[int, int, int] | None,
    merge_size: int | None = None,
) -> None:
    """The embedding layout rules; the store applies them to ``put`` as well."""
    if dtype not in DTYPES:
        raise invalid_arg(f"embedding reference field 'dt' must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not 1 <= len(shape) <= MAX_NDIM:
        raise invalid_arg(f"embedding reference field 'sh' must have 1 to {MAX_NDIM} dimensions, got {len(shape)}")
    for dim in shape:
        _check_range("sh", dim, 1, MAX_DIM)
    _check_range("nb", nbytes, 1, MAX_NBYTES)
    expected = _expected_nbytes(dtype, shape)
    if nbytes != expected:
        raise invalid_arg(
            f"embedding reference byte length {nbytes} does not match shape {list(shape)} of {dtype} "
            f"({expected} bytes)"
        )
    if num_placeholders != shape[0]:
        raise invalid_arg(
            f"embedding reference placeholder count {num_placeholders} must equal the embedding rows {shape[0]}"
        )
    if grid_thw is not None:
        _check_grid(grid_thw, num_placeholders, merge_size)


def compute_tag(reference: Reference, secret: bytes) -> str:
    """HMAC-SHA256 over every field but the tag, in canonical JSON."""
    message = _canonical_json(_wire_fields(reference, with_tag=False))
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def verify_tag(reference: Reference, secret: bytes) -> None:
    if not hmac.compare_digest(reference.tag, compute_tag(reference, secret)):
        raise invalid_arg(
            "embedding reference failed its integrity check (it was modified or signed by another store)"
        )


# --- helpers ---------------------------------------------------------------------------------


def _canonical_json(fields: Mapping[str, Any]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _wire_fields(reference: Reference, *, with_tag: bool) -> dict[str, Any]:
    values = asdict(reference)
    fields = {wire: values[attr] for wire, attr in _WIRE_NAMES.items() if with_tag or wire != "tag"}
    fields["sh"] = list(reference.shape)
    fields["grid"] = None if reference.grid_thw is None else list(reference.grid_thw)
    return fields


def _replace_tag(reference: Reference, tag: str) -> Reference:
    values = asdict(reference)
    values["tag"] = tag
    values["shape"] = reference.shape
    values["grid_thw"] = reference.grid_thw
    return Reference(**values)


def _check_wire_size(size: int) -> None:
    if size > MAX_REFERENCE_BYTES:
        raise invalid_arg(f"embedding reference is {size} bytes; at most {MAX_REFERENCE_BYTES} are allowed")
    if size == 0:
        raise invalid_arg("embedding reference is empty")


def _decode_json_object(data: bytes) -> dict[str, Any]:
    try:
        fields = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid_arg(f"embedding reference is not valid JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise invalid_arg(f"embedding reference must be a JSON object, got {type(fields).__name__}")
    missing = sorted(set(_WIRE_NAMES) - set(fields))
    unknown = sorted(set(fields) - set(_WIRE_NAMES))
    if missing or unknown:
        raise invalid_arg(f"embedding reference fields are wrong: missing {missing}, unknown {unknown}")
    return fields


def _reference_from_fields(fields: Mapping[str, Any]) -> Reference:
    version = _typed_int(fields, "v")
    _check_version(version)  # "version X is not supported" before any error about the fields it has
    grid = None if fields["grid"] is None else _typed_int_list(fields, "grid", min_len=3, max_len=3)
    return Reference(
        version=version,
        modality=_typed_str(fields, "mod"),
        mm_hash=_typed_str(fields, "mm"),
        store_id=_typed_str(fields, "sid"),
        location=_typed_str(fields, "loc"),
        key=_typed_str(fields, "key"),
        generation=_typed_int(fields, "gen"),
        lease_id=_typed_str(fields, "lease"),
        dtype=_typed_str(fields, "dt"),
        shape=_typed_int_list(fields, "sh", min_len=1, max_len=MAX_NDIM),
        nbytes=_typed_int(fields, "nb"),
        num_placeholders=_typed_int(fields, "n"),
        grid_thw=grid,  # type: ignore[arg-type]  # length checked above
        tag=_typed_str(fields, "tag"),
    )


def _typed_int(fields: Mapping[str, Any], name: str) -> int:
    value = fields[name]
    # bool is an int subclass in Python; JSON true is not a number.
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid_arg(f"embedding reference field '{name}' must be an integer, got {type(value).__name__}")
    return value


def _typed_str(fields: Mapping[str, Any], name: str) -> str:
    value = fields[name]
    if not isinstance(value, str):
        raise invalid_arg(f"embedding reference field '{name}' must be a string, got {type(value).__name__}")
    return value


def _typed_int_list(fields: Mapping[str, Any], name: str, *, min_len: int, max_len: int) -> tuple[int, ...]:
    value = fields[name]
    if not isinstance(value, list) or not min_len <= len(value) <= max_len:
        raise invalid_arg(f"embedding reference field '{name}' must be a list of {min_len} to {max_len} integers")
    return tuple(_typed_int({name: item}, name) for item in value)


def _check_version(version: int) -> None:
    if version != FORMAT_VERSION:
        raise invalid_arg(
            f"embedding reference version {version} is not supported (this server reads version {FORMAT_VERSION})"
        )


def _check_pattern(
    name: str, value: str, pattern: re.Pattern[str] | None, *, allowed: frozenset[str] = frozenset()
) -> None:
    ok = value in allowed if pattern is None else pattern.fullmatch(value) is not None
    if not ok:
        expected = f"one of {sorted(allowed)}" if pattern is None else f"to match {pattern.pattern}"
        raise invalid_arg(f"embedding reference field '{name}' must be {expected}, got {value[:40]!r}")


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise invalid_arg(f"embedding reference field '{name}' must be in [{low}, {high}], got {value}")


def _expected_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(int(d) for d in shape) * np.dtype(DTYPES[dtype]).itemsize


def _check_grid(grid_thw: tuple[int, ...], num_placeholders: int, merge_size: int | None) -> None:
    if len(grid_thw) != 3:
        raise invalid_arg(f"embedding reference field 'grid' must be [t, h, w], got {list(grid_thw)}")
    for side in grid_thw:
        _check_range("grid", side, 1, MAX_GRID_SIDE)
    if merge_size is None:
        return
    patches = math.prod(grid_thw)
    merged, remainder = divmod(patches, merge_size * merge_size)
    if remainder or merged != num_placeholders:
        raise invalid_arg(
            f"embedding reference grid {list(grid_thw)} with merge size {merge_size} gives "
            f"{patches / (merge_size * merge_size):g} placeholder tokens, but the reference says {num_placeholders}"
        )

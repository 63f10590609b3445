"""The records the embedding store keeps in LMDB, and their byte encodings.

One LMDB environment holds these named databases (all keys are bytes):

``data``      content key -> the embedding's raw bytes (C order, little-endian); host stores only.
``extents``   8-byte big-endian offset -> 8-byte length: free byte ranges of a GPU store's arena.
``entries``   content key -> :class:`EntryRecord` (layout, generation, LRU tick, lease count).
``lru``       8-byte big-endian tick -> content key; iteration order is least recently used first.
``leases``    lease id -> :class:`LeaseRecord` (which entry, which process).
``pending``   content key -> :class:`PendingRecord`: someone is producing this key now.
``failures``  claim token -> :class:`FailureRecord`: that producer failed; its waiters read why.
``counters``  name -> signed 64-bit little-endian integer (metrics, the clock, generations).
``config``    name -> bytes: the store id, its HMAC secret, capacity, schema version and, for a
              GPU store, the live :class:`ArenaRecord` (``arena``).

Records are compact JSON: small, readable with ``mdb_dump`` when debugging, and versioned
through the ``schema`` value in ``config``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from typing import Any

SCHEMA_VERSION = b"1"
DATABASE_NAMES = ("data", "extents", "entries", "lru", "leases", "pending", "failures", "counters", "config")

# Counters shown by EmbeddingStore.metrics(); cumulative ones never go down, gauges follow state.
CUMULATIVE_COUNTERS = (
    "hits",
    "misses",
    "joins",
    "evictions",
    "expirations",
    "puts",
    "encodes",
    "producer_failures",
    "leases_reaped",
    "claims_reaped",
    "entries_lost",  # GPU entries whose arena went with the process that allocated it
)
GAUGE_COUNTERS = ("bytes_used", "entries", "active_leases")
# Rows of the ``config`` table that every store has (a GPU store adds ``arena``).
CONFIG_SCHEMA = b"schema"
CONFIG_STORE_ID = b"store_id"
CONFIG_SECRET = b"secret"
CONFIG_CAPACITY = b"capacity"
# Internal sequences, not metrics.
CLOCK = "clock"
GENERATION = "generation"
ARENA = "arena"

# What LMDB hands back: bytes, or a memoryview into its map inside a ``buffers=True`` read.
RawRecord = bytes | memoryview

_COUNTER = struct.Struct("<q")
_TICK = struct.Struct(">Q")


def _to_json(record: Any) -> bytes:
    return json.dumps(asdict(record), separators=(",", ":")).encode("utf-8")


@dataclass(frozen=True)
class EntryRecord:
    generation: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    modality: str
    mm_hash: str
    num_placeholders: int
    grid_thw: tuple[int, int, int] | None
    tick: int
    leases: int
    created: float = 0.0  # time.time() at insert; TTL expiry counts from here
    arena: int = 0  # GPU stores: the arena holding the bytes (0: host store, bytes in ``data``)
    offset: int = -1  # GPU stores: byte offset of the entry in that arena

    def to_bytes(self) -> bytes:
        return _to_json(self)

    @classmethod
    def from_bytes(cls, raw: RawRecord) -> EntryRecord:
        values = json.loads(bytes(raw))
        values["shape"] = tuple(values["shape"])
        values["grid_thw"] = None if values["grid_thw"] is None else tuple(values["grid_thw"])
        return cls(**values)


@dataclass(frozen=True)
class ArenaRecord:
    """A GPU store's block of device memory, exported by the process that allocated it."""

    arena_id: int
    size: int
    pid: int  # the owner: the block is freed when this process exits
    start_time: str
    handle: str  # hex of the CUDA IPC handle

    def to_bytes(self) -> bytes:
        return _to_json(self)

    @classmethod
    def from_bytes(cls, raw: RawRecord) -> ArenaRecord:
        return cls(**json.loads(bytes(raw)))


@dataclass(frozen=True)
class LeaseRecord:
    key: str
    generation: int
    pid: int
    start_time: str  # the owner's /proc start time, to tell a reused pid apart
    created: float  # wall clock, for operators

    def to_bytes(self) -> bytes:
        return _to_json(self)

    @classmethod
    def from_bytes(cls, raw: RawRecord) -> LeaseRecord:
        return cls(**json.loads(bytes(raw)))


@dataclass(frozen=True)
class PendingRecord:
    token: str
    pid: int
    start_time: str
    started: float  # wall clock: claims older than the producer timeout are taken over

    def to_bytes(self) -> bytes:
        return _to_json(self)

    @classmethod
    def from_bytes(cls, raw: RawRecord) -> PendingRecord:
        return cls(**json.loads(bytes(raw)))


@dataclass(frozen=True)
class FailureRecord:
    code: str  # an ErrorCode value
    message: str
    failed: float  # wall clock, for expiry

    def to_bytes(self) -> bytes:
        return _to_json(self)

    @classmethod
    def from_bytes(cls, raw: RawRecord) -> FailureRecord:
        return cls(**json.loads(bytes(raw)))


def encode_counter(value: int) -> bytes:
    return _COUNTER.pack(value)


def decode_counter(raw: RawRecord | None) -> int:
    return 0 if raw is None else _COUNTER.unpack(bytes(raw))[0]


def encode_tick(tick: int) -> bytes:
    return _TICK.pack(tick)

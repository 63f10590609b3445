"""The node-level embedding store: content-addressed, shared by processes, zero-copy reads.

Every model-instance process of a node (Triton runs each python model instance as its own
process) opens the same LMDB environment, by default a directory under ``/dev/shm``, so an
embedding written by one encoder instance is a hit for all. LMDB gives the multi-process
part: one writer at a time through its own lock file, readers that never block and see a
consistent snapshot (MVCC), and a read-only memory map for reads. All state, metrics
included, lives in the environment; this module holds no module-level state and the
:class:`EmbeddingStore` object holds only handles. The layout is in ``records.py``.

Keys are content keys (``keys.content_key``: media bytes + preprocessing config + encoder
version). ``put`` and ``claim`` give back signed :class:`Reference` objects, the only thing
that travels between stages; ``open_view`` and ``resolve`` check a reference against the
entry before any byte is read.

Zero-copy lifetime
    ``with store.open_view(ref) as array:`` yields a read-only ``numpy`` array over LMDB's
    memory map, without a copy. It is valid inside the ``with`` block and only there:
    LMDB keeps the pages of an open read transaction's snapshot intact even if the entry
    is evicted, replaced or the store cleared meanwhile. After the block the pages may be
    reused by later writes: the array then shows unspecified bytes (and touching it after
    ``close()`` may crash the process). Copy what must outlive the block, or call
    ``resolve``, which returns an owned, writeable copy. Keep views short: while a view is
    open, pages freed by later evictions cannot be reused, so a long view under heavy
    eviction grows the map file until ``put`` answers UNAVAILABLE. Entries larger than
    about half an LMDB page (2 KB) start 16-byte aligned; tiny ones may be unaligned
    (numpy reads them either way).

Leases
    A lease keeps one generation of an entry from eviction while a request uses it. It
    does not pin memory addresses (a view does that); it guarantees that a later view or
    resolve of the reference finds the entry. ``put``/``claim``/``lookup`` take one by
    default and put its id in the reference; the request's owner calls ``release`` when
    the request ends (finished, failed or cancelled). A lease records the owner's pid and
    process start time; ``reap_dead_processes`` releases the leases, single-flight claims
    and LMDB reader slots (views) of processes that died, so a crashed model instance
    leaks nothing. ``put`` reaps by itself before it gives up for lack of room. Liveness
    is judged by pid, so every process of one store must share a pid namespace (one
    container, or a pod with a shared process namespace). ``max_lease_age_s`` optionally
    ends leases that a live process forgot.

LRU eviction
    Every insert and hit moves the entry to the end of the ``lru`` table (a global clock
    tick). Inserting beyond ``capacity_bytes`` evicts from the front, skipping leased
    entries, inside the same write transaction: the bytes counted never exceed the
    capacity, and a put that cannot make room fails cleanly (UNAVAILABLE) instead of
    evicting a leased entry. Reads through views do not count as use (they are
    read-only); callers hold leases instead.

Expiry (optional)
    With ``ttl_s`` set, an entry older than that is a miss for ``lookup``/``claim`` and is
    dropped then (counted as an expiration), unless a lease holds it: an entry in use stays.

Single-flight
    ``claim`` atomically answers HIT (entry there), PRODUCE (caller must produce it; a
    pending record with a token marks the key) or JOIN (another process or thread is
    producing it). The producer calls ``fulfil`` (stores the entry, clears the mark) or
    ``abandon`` (clears the mark, leaves the error under the token for every joined
    waiter); waiters call ``wait_for``. A later call after a failure starts afresh. A mark
    whose owner died, or older than ``producer_timeout_s``, is taken over. ``get_or_create``
    puts the pieces together for one key; a batching caller can use them directly.

GPU stores
    With ``device="cuda:N"`` the bytes live in device memory shared by CUDA IPC instead of
    in LMDB (``arena.py``: one block per node, ranges placed through LMDB); everything else
    above holds unchanged. ``put``/``fulfil`` take a numpy array or a CUDA array (torch
    tensor, CuPy array: one device-to-device copy); ``open_view`` yields a ``DeviceView``
    (``torch.as_tensor(view, device="cuda")`` wraps it without a copy) and holds a lease
    for the block's duration (the reference's own, which must still be held, or a temporary
    one), because freed device ranges are reused at once: no snapshot protects them.
    Kernels that read a view must finish inside the block. ``resolve`` copies to the host.

Metrics
    Counters (hits, misses, joins, evictions, puts, encodes, producer failures, reaped
    leases and claims) and gauges (bytes used, entries, active leases, capacity) are
    updated in the same write transactions as the state they describe, so every process
    sees one consistent set through ``metrics()``. ``map_used_bytes`` (the LMDB file's
    high-water mark: payload, B-tree pages and pages pinned by views) comes from LMDB.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any

import lmdb
import numpy as np

from python_backends.errors import EpdError, ErrorCode, invalid_arg
from python_backends.store.arena import Arena
from python_backends.store.device_memory import (
    CudaIpcMemory,
    DeviceArray,
    DeviceMemory,
    DeviceView,
    cuda_device_index,
)
from python_backends.store.processes import process_is_alive, process_start_time
from python_backends.store.records import (
    ARENA,
    CLOCK,
    CUMULATIVE_COUNTERS,
    DATABASE_NAMES,
    GAUGE_COUNTERS,
    GENERATION,
    SCHEMA_VERSION,
    ArenaRecord,
    EntryRecord,
    FailureRecord,
    LeaseRecord,
    PendingRecord,
    decode_counter,
    encode_counter,
    encode_tick,
)
from python_backends.store.reference import (
    DTYPES,
    Reference,
    check_item,
    check_layout,
    check_location,
    check_reference,
    make_reference,
    parse_reference,
    verify_tag,
)

DEFAULT_STORE_PATH = "/dev/shm/triton-epd-embeddings"


class StoreFullError(EpdError):
    """UNAVAILABLE because leases of running requests hold every byte: waiting can help."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ErrorCode.UNAVAILABLE)
_MIB = 1 << 20


@dataclass(frozen=True)
class StoreConfig:
    """Settings of one store. Every process of a node must use the same ``path``.

    ``capacity_bytes`` bounds the embedding bytes held; the last process to open the store
    sets it for all. ``map_size_bytes`` bounds the LMDB file (0: twice the capacity plus
    64 MiB, room for copy-on-write pages and open views; 256 MiB of records on a GPU store).
    ``device``: "cpu" (bytes in shared memory) or "cuda[:N]" (bytes in that GPU's memory,
    shared by CUDA IPC; the arena is ``capacity_bytes`` of it, allocated at the first write).
    """

    path: str = DEFAULT_STORE_PATH
    capacity_bytes: int = 2 << 30
    map_size_bytes: int = 0
    max_readers: int = 1024
    location: str = ""  # "" -> shm://<hostname>
    wait_timeout_s: float = 120.0
    producer_timeout_s: float = 600.0
    max_lease_age_s: float | None = None  # reaping also ends leases older than this (a safety net)
    max_poll_interval_s: float = 0.02
    merge_size: int | None = None  # when set, reference grids are checked against placeholder counts
    eviction: str = "lru"  # the only policy so far; named so that a config says what it gets
    ttl_s: float | None = None  # entries older than this are misses (and dropped) unless leased
    device: str = "cpu"

    def validate(self) -> None:
        if not self.path:
            raise invalid_arg("embedding store path must not be empty")
        if self.capacity_bytes < 1:
            raise invalid_arg(f"embedding store capacity_bytes must be positive, got {self.capacity_bytes}")
        if self.map_size_bytes and self.map_size_bytes < self.capacity_bytes:
            raise invalid_arg("embedding store map_size_bytes must be 0 (automatic) or at least capacity_bytes")
        if self.max_readers < 1:
            raise invalid_arg("embedding store max_readers must be positive")
        for name in ("wait_timeout_s", "producer_timeout_s", "max_poll_interval_s"):
            if getattr(self, name) <= 0:
                raise invalid_arg(f"embedding store {name} must be positive")
        if self.merge_size is not None and self.merge_size < 1:
            raise invalid_arg(f"embedding store merge_size must be positive, got {self.merge_size}")
        if self.eviction != "lru":
            raise invalid_arg(f"embedding store eviction must be 'lru', got {self.eviction!r}")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise invalid_arg("embedding store ttl_s must be positive or None (no expiry)")
        if self.max_lease_age_s is not None and self.max_lease_age_s <= 0:
            raise invalid_arg("embedding store max_lease_age_s must be positive or None")
        cuda_device_index(self.device)
        check_location(self.effective_location())

    def effective_map_size(self) -> int:
        if self.map_size_bytes:
            return self.map_size_bytes
        return 256 * _MIB if self.device_index is not None else 2 * self.capacity_bytes + 64 * _MIB

    def effective_location(self) -> str:
        if self.location:
            return self.location
        host = socket.gethostname()
        return f"shm://{host}" if self.device_index is None else f"cuda://{host}/gpu{self.device_index}"

    @property
    def device_index(self) -> int | None:
        return cuda_device_index(self.device)


@dataclass(frozen=True)
class EntryMeta:
    """What the producer knows about an embedding besides its bytes."""

    modality: str = "image"
    mm_hash: str = ""  # "" -> the content key
    num_placeholders: int | None = None  # None -> the array's rows
    grid_thw: tuple[int, int, int] | None = None
    dtype: str | None = None  # None -> from the array; "bfloat16" for uint16 bit patterns


class ClaimKind(str, Enum):
    HIT = "hit"
    PRODUCE = "produce"
    JOIN = "join"


@dataclass(frozen=True)
class Claim:
    """The answer of :meth:`EmbeddingStore.claim` for one key."""

    key: str
    kind: ClaimKind
    token: str = ""  # identifies the production run (PRODUCE and JOIN)
    reference: Reference | None = None  # HIT only


@dataclass(frozen=True)
class ReapReport:
    leases: int  # leases of dead processes (or older than max_lease_age_s) released
    claims: int  # single-flight claims of dead processes dropped
    readers: int = 0  # LMDB reader slots (open views) of dead processes freed


Producer = Callable[[], "tuple[np.ndarray, EntryMeta]"]


@dataclass(frozen=True)
class _Payload:
    """An array made ready for storing, checked before any write transaction starts."""

    data: np.ndarray | DeviceArray  # C-contiguous, little-endian; a DeviceArray for GPU stores only
    dtype: str
    meta: EntryMeta

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.data.shape)

    @property
    def pointer(self) -> int:
        return self.data.pointer if isinstance(self.data, DeviceArray) else int(self.data.ctypes.data)


class EmbeddingStore:
    """One process's handle on the node's store. Safe to share between threads; open one
    per process (an LMDB environment must not cross ``fork``)."""

    def __init__(self, config: StoreConfig | None = None, device_memory: DeviceMemory | None = None) -> None:
        """``device_memory``: how a GPU store reaches its device (default: CUDA IPC on
        ``config.device``); ignored by host stores."""
        self._config = config or StoreConfig()
        self._config.validate()
        self._pid = os.getpid()
        self._env = _open_environment(self._config)
        self._db = {name: self._env.open_db(name.encode()) for name in DATABASE_NAMES}
        self._store_id, self._secret = self._open_identity()
        device = self._config.device_index
        self._arena: Arena | None = None
        if device is not None:
            memory = device_memory or CudaIpcMemory(device)
            self._arena = Arena(memory, self._db["config"], self._db["extents"])

    # --- lifecycle and identity ---------------------------------------------------------------

    def close(self) -> None:
        """Close the environment. Arrays from views must not be touched afterwards. A GPU
        store's process that allocated the arena frees it here: its entries are lost."""
        if self._arena is not None:
            self._arena.close()
        self._env.close()

    def __enter__(self) -> EmbeddingStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def store_id(self) -> str:
        return self._store_id

    @property
    def location(self) -> str:
        return self._config.effective_location()

    @property
    def secret(self) -> bytes:
        """The HMAC key of references, created with the store and shared by its processes."""
        return self._secret

    def _open_identity(self) -> tuple[str, bytes]:
        with self._write() as txn:
            config = self._db["config"]
            schema = txn.get(b"schema", db=config)
            if schema is None:
                txn.put(b"schema", SCHEMA_VERSION, db=config)
                txn.put(b"store_id", uuid.uuid4().hex.encode(), db=config)
                txn.put(b"secret", secrets.token_bytes(32), db=config)
            elif bytes(schema) != SCHEMA_VERSION:
                raise EpdError(
                    f"embedding store at {self._config.path} has schema {bytes(schema)!r}, this code reads "
                    f"{SCHEMA_VERSION!r}: remove the directory (it is a cache) or use another path",
                    ErrorCode.UNAVAILABLE,
                )
            txn.put(b"capacity", encode_counter(self._config.capacity_bytes), db=config)
            return bytes(txn.get(b"store_id", db=config)).decode(), bytes(txn.get(b"secret", db=config))

    # --- writing ------------------------------------------------------------------------------

    def put(
        self,
        key: str,
        array: np.ndarray | Any,
        meta: EntryMeta | None = None,
        *,
        lease: bool = True,
        owner_pid: int | None = None,
    ) -> Reference:
        """Store ``array`` under ``key`` and return a reference (leased unless ``lease=False``).
        ``array``: numpy, or on a GPU store also a CUDA array (``__cuda_array_interface__``).

        Content-addressed: if ``key`` is already stored, the existing entry is kept and its
        reference returned. Evicts least recently used unleased entries to make room;
        raises UNAVAILABLE when leased entries leave no room, INVALID_ARG on a bad layout.
        """
        payload = self._payload(key, array, meta or EntryMeta())
        self._ensure_arena()
        with self._write() as txn:
            return self._store_payload(txn, key, payload, lease, owner_pid)

    def _payload(self, key: str, array: np.ndarray | Any, meta: EntryMeta) -> _Payload:
        _check_key(key)
        data: np.ndarray | DeviceArray
        if isinstance(array, np.ndarray):
            dtype = _wire_dtype(array.dtype, meta.dtype)
            data = np.ascontiguousarray(array, dtype=np.dtype(DTYPES[dtype]))
        elif self._arena is None:
            raise invalid_arg(f"embedding must be a numpy array, got {type(array).__name__}")
        else:
            data = DeviceArray.of(array)
            dtype = _wire_dtype(data.dtype, meta.dtype)
            if data.dtype != np.dtype(DTYPES[dtype]):
                raise invalid_arg(f"a CUDA embedding must be little-endian {dtype}, got {data.dtype.str}")
        rows = int(data.shape[0]) if data.shape else 0
        meta = EntryMeta(
            modality=meta.modality,
            mm_hash=meta.mm_hash or key,
            num_placeholders=rows if meta.num_placeholders is None else meta.num_placeholders,
            grid_thw=_grid_tuple(meta.grid_thw),
            dtype=dtype,
        )
        shape = tuple(int(d) for d in data.shape)
        check_item(meta.modality, meta.mm_hash)
        check_layout(
            dtype=dtype,
            shape=shape,
            nbytes=int(data.nbytes),
            num_placeholders=meta.num_placeholders or 0,
            grid_thw=meta.grid_thw,
            merge_size=self._config.merge_size,
        )
        return _Payload(data=data, dtype=dtype, meta=meta)

    def _store_payload(
        self, txn: lmdb.Transaction, key: str, payload: _Payload, lease: bool, owner_pid: int | None
    ) -> Reference:
        existing = self._live_entry(txn, key)
        if existing is not None:
            return self._serve(txn, key, existing, lease, owner_pid)
        nbytes = int(payload.data.nbytes)
        arena = self._live_arena(txn)
        offset = self._make_room(txn, nbytes, arena)
        entry = EntryRecord(
            generation=self._add(txn, GENERATION, 1),
            dtype=payload.dtype,
            shape=payload.shape,
            nbytes=nbytes,
            modality=payload.meta.modality,
            mm_hash=payload.meta.mm_hash,
            num_placeholders=int(payload.meta.num_placeholders or 0),
            grid_thw=payload.meta.grid_thw,
            tick=self._add(txn, CLOCK, 1),
            leases=0,
            created=time.time(),
            arena=0 if arena is None else arena.arena_id,
            offset=offset,
        )
        if arena is None:
            txn.put(key.encode(), memoryview(payload.data).cast("B"), db=self._db["data"])  # type: ignore[arg-type]
        else:
            self._arena.write(arena, offset, payload.pointer, nbytes)  # type: ignore[union-attr]
        self._write_entry(txn, key, entry)
        txn.put(encode_tick(entry.tick), key.encode(), db=self._db["lru"])
        self._add(txn, "puts", 1)
        self._add(txn, "bytes_used", nbytes)
        self._add(txn, "entries", 1)
        lease_id = self._lease(txn, key, entry, owner_pid) if lease else ""
        return self._reference(key, entry, lease_id)

    def _make_room(self, txn: lmdb.Transaction, nbytes: int, arena: ArenaRecord | None) -> int:
        """Evict until ``nbytes`` fit; on a GPU store also take a range of ``arena`` for them
        and return its offset (-1 on a host store)."""
        capacity = self._capacity(txn)
        if arena is not None:  # a block keeps the size it was made with; a new capacity applies to the next
            capacity = min(capacity, arena.size)
        if nbytes > capacity:
            raise invalid_arg(
                f"embedding of {nbytes} bytes is larger than the store capacity ({capacity} bytes); "
                "raise capacity_bytes"
            )
        needed = self._counter(txn, "bytes_used") + nbytes - capacity
        if needed > 0 and not self._evict(txn, needed):
            raise self._full(txn, capacity)
        if self._arena is None or arena is None:
            return -1
        offset = self._arena.take(txn, nbytes)
        while offset is None:  # enough bytes free, but not in one range: evict more, LRU first
            if not self._evict(txn, 1):
                raise self._full(txn, capacity)
            offset = self._arena.take(txn, nbytes)
        return offset

    def _evict(self, txn: lmdb.Transaction, needed: int) -> bool:
        freed = self._evict_lru(txn, needed)
        if freed < needed:
            # Dead processes may still hold leases; free them before giving up.
            self._reap(txn)
            freed += self._evict_lru(txn, needed - freed)
        return freed >= needed

    def _full(self, txn: lmdb.Transaction, capacity: int) -> StoreFullError:
        return StoreFullError(
            f"embedding store is full: {self._counter(txn, 'bytes_used')} of {capacity} bytes are held by "
            f"{self._counter(txn, 'active_leases')} leases of running requests; "
            "retry later or raise capacity_bytes"
        )

    def _capacity(self, txn: lmdb.Transaction) -> int:
        return decode_counter(txn.get(b"capacity", db=self._db["config"]))

    def _evict_lru(self, txn: lmdb.Transaction, needed: int) -> int:
        """Evict unleased entries, least recently used first, until ``needed`` bytes are free."""
        victims: list[tuple[str, EntryRecord]] = []
        freed = 0
        for _tick, raw_key in txn.cursor(db=self._db["lru"]):
            if freed >= needed:
                break
            key = bytes(raw_key).decode()
            entry = self._entry(txn, key)
            if entry is not None and entry.leases == 0:
                victims.append((key, entry))
                freed += entry.nbytes
        for key, entry in victims:
            self._delete_entry(txn, key, entry)
            self._add(txn, "evictions", 1)
        return freed

    def _delete_entry(self, txn: lmdb.Transaction, key: str, entry: EntryRecord) -> None:
        if entry.offset < 0:
            txn.delete(key.encode(), db=self._db["data"])
        elif self._arena is not None:
            arena = self._arena.live(txn)
            if arena is not None and arena.arena_id == entry.arena:
                self._arena.give_back(txn, entry.offset, entry.nbytes)
        txn.delete(key.encode(), db=self._db["entries"])
        txn.delete(encode_tick(entry.tick), db=self._db["lru"])
        self._add(txn, "bytes_used", -entry.nbytes)
        self._add(txn, "entries", -1)

    # --- finding ------------------------------------------------------------------------------

    def lookup(
        self, key: str, *, lease: bool = True, owner_pid: int | None = None, count_miss: bool = True
    ) -> Reference | None:
        """The reference of a stored key (a hit, leased unless ``lease=False``) or None (a miss).

        ``count_miss=False``: a fast-path probe whose miss goes on to a ``claim`` (which counts it),
        so that one request's miss is not counted twice."""
        _check_key(key)
        with self._write() as txn:
            entry = self._live_entry(txn, key)
            if entry is not None or count_miss:
                self._add(txn, "misses" if entry is None else "hits", 1)
            return None if entry is None else self._serve(txn, key, entry, lease, owner_pid)

    def _live_entry(self, txn: lmdb.Transaction, key: str) -> EntryRecord | None:
        """The entry of ``key`` unless it outlived ``ttl_s`` with no lease on it (then it is
        dropped here and counted as an expiration). A leased entry is in use: it stays."""
        entry = self._entry(txn, key)
        ttl = self._config.ttl_s
        if entry is None or ttl is None or entry.leases or time.time() - entry.created < ttl:
            return entry
        self._delete_entry(txn, key, entry)
        self._add(txn, "expirations", 1)
        return None

    def contains(self, key: str) -> bool:
        """Whether ``key`` is stored now. Counts nothing and touches nothing."""
        _check_key(key)
        with self._read() as txn:
            return txn.get(key.encode(), db=self._db["entries"]) is not None

    def _serve(
        self, txn: lmdb.Transaction, key: str, entry: EntryRecord, lease: bool, owner_pid: int | None
    ) -> Reference:
        """Mark ``entry`` as just used, lease it if asked, and sign a reference to it."""
        entry = self._touch(txn, key, entry)
        lease_id = self._lease(txn, key, entry, owner_pid) if lease else ""
        return self._reference(key, entry, lease_id)

    def _touch(self, txn: lmdb.Transaction, key: str, entry: EntryRecord) -> EntryRecord:
        txn.delete(encode_tick(entry.tick), db=self._db["lru"])
        touched = dataclasses.replace(entry, tick=self._add(txn, CLOCK, 1))
        txn.put(encode_tick(touched.tick), key.encode(), db=self._db["lru"])
        self._write_entry(txn, key, touched)
        return touched

    def _reference(self, key: str, entry: EntryRecord, lease_id: str) -> Reference:
        return make_reference(
            modality=entry.modality,
            mm_hash=entry.mm_hash,
            store_id=self._store_id,
            location=self.location,
            key=key,
            generation=entry.generation,
            lease_id=lease_id,
            dtype=entry.dtype,
            shape=entry.shape,
            num_placeholders=entry.num_placeholders,
            grid_thw=entry.grid_thw,
            secret=self._secret,
            merge_size=self._config.merge_size,
        )

    # --- leases -------------------------------------------------------------------------------

    def acquire_lease(self, reference: Reference | bytes, *, owner_pid: int | None = None) -> Reference:
        """A new lease on the entry ``reference`` names; returns the reference carrying it.

        Called by a stage that keeps using an entry beyond the lease it was handed (or that
        got a reference without one). NOT_FOUND when that generation is gone.
        """
        ref = self._checked_reference(reference)
        with self._write() as txn:
            entry = self._entry_for(txn, ref)
            return self._serve(txn, ref.key, entry, True, owner_pid)

    def release(self, lease: Reference | str) -> bool:
        """Release a lease (by id or by the reference carrying it). False when it was not
        held: already released, reaped or cleared. Called once per lease by its owner."""
        lease_id = lease.lease_id if isinstance(lease, Reference) else lease
        if not lease_id:
            return False
        if not isinstance(lease_id, str) or len(lease_id) != 32 or not _is_lowercase_hex(lease_id):
            raise invalid_arg("a lease id is 32 lowercase hex characters")
        with self._write() as txn:
            return self._release_lease(txn, lease_id)

    def _lease(self, txn: lmdb.Transaction, key: str, entry: EntryRecord, owner_pid: int | None) -> str:
        pid = os.getpid() if owner_pid is None else owner_pid
        lease_id = secrets.token_hex(16)
        record = LeaseRecord(
            key=key, generation=entry.generation, pid=pid, start_time=process_start_time(pid), created=time.time()
        )
        txn.put(lease_id.encode(), record.to_bytes(), db=self._db["leases"])
        self._write_entry(txn, key, dataclasses.replace(entry, leases=entry.leases + 1))
        self._add(txn, "active_leases", 1)
        return lease_id

    def _release_lease(self, txn: lmdb.Transaction, lease_id: str) -> bool:
        raw = txn.get(lease_id.encode(), db=self._db["leases"])
        if raw is None:
            return False
        record = LeaseRecord.from_bytes(raw)
        txn.delete(lease_id.encode(), db=self._db["leases"])
        entry = self._entry(txn, record.key)
        if entry is not None and entry.generation == record.generation:
            self._write_entry(txn, record.key, dataclasses.replace(entry, leases=max(0, entry.leases - 1)))
        self._add(txn, "active_leases", -1)
        return True

    def reap_dead_processes(self) -> ReapReport:
        """Release leases, drop single-flight claims and free LMDB reader slots whose owner
        process is gone.

        Call it periodically (and at model start-up): a process that crashed mid-request
        leaves its leases behind, and this is what returns them.
        """
        # A dead process's open view would pin freed pages forever; LMDB frees its reader slot.
        readers = self._env.reader_check()
        with self._write() as txn:
            return dataclasses.replace(self._reap(txn), readers=readers)

    def _reap(self, txn: lmdb.Transaction) -> ReapReport:
        dead_leases = [
            bytes(lease_id).decode()
            for lease_id, raw in txn.cursor(db=self._db["leases"])
            if self._lease_is_dead(LeaseRecord.from_bytes(raw))
        ]
        for lease_id in dead_leases:
            self._release_lease(txn, lease_id)
        dead_claims = [
            bytes(key)
            for key, raw in txn.cursor(db=self._db["pending"])
            if not _owner_alive(PendingRecord.from_bytes(raw))
        ]
        for key in dead_claims:
            txn.delete(key, db=self._db["pending"])
        self._add(txn, "leases_reaped", len(dead_leases))
        self._add(txn, "claims_reaped", len(dead_claims))
        return ReapReport(leases=len(dead_leases), claims=len(dead_claims))

    def _lease_is_dead(self, record: LeaseRecord) -> bool:
        max_age = self._config.max_lease_age_s
        too_old = max_age is not None and time.time() - record.created > max_age
        return too_old or not _owner_alive(record)

    # --- single-flight ------------------------------------------------------------------------

    def get_or_create(
        self,
        key: str,
        producer: Producer,
        *,
        lease: bool = True,
        owner_pid: int | None = None,
        timeout_s: float | None = None,
    ) -> Reference:
        """The reference for ``key``, running ``producer`` only if no process has it or is
        producing it. Concurrent callers for one missing key (threads or processes) run the
        producer once; the others wait up to ``timeout_s`` (default ``wait_timeout_s``) and
        get the same entry, or the producer's error as :class:`EpdError`.
        """
        deadline = time.monotonic() + (timeout_s or self._config.wait_timeout_s)
        while True:
            claim = self.claim(key, lease=lease, owner_pid=owner_pid)
            if claim.kind is ClaimKind.HIT:
                return _claimed_reference(claim)
            if claim.kind is ClaimKind.PRODUCE:
                return self._produce(claim, producer, lease, owner_pid)
            remaining = max(deadline - time.monotonic(), 0.001)
            found = self.wait_for(claim, lease=lease, owner_pid=owner_pid, timeout_s=remaining)
            if found is not None:
                return found

    def _produce(self, claim: Claim, producer: Producer, lease: bool, owner_pid: int | None) -> Reference:
        try:
            array, meta = producer()
            return self.fulfil(claim, array, meta, lease=lease, owner_pid=owner_pid)
        except BaseException as exc:  # the mark must go whatever happened, or waiters hang
            self.abandon(claim, exc)
            raise

    def claim(self, key: str, *, lease: bool = True, owner_pid: int | None = None) -> Claim:
        """HIT (with a reference), PRODUCE (the caller must ``fulfil`` or ``abandon``) or JOIN
        (call ``wait_for``). Counts a hit, a miss or a join."""
        _check_key(key)
        with self._write() as txn:
            entry = self._live_entry(txn, key)
            if entry is not None:
                self._add(txn, "hits", 1)
                return Claim(key, ClaimKind.HIT, reference=self._serve(txn, key, entry, lease, owner_pid))
            pending = self._pending(txn, key)
            if pending is not None and self._claim_is_live(pending):
                self._add(txn, "joins", 1)
                return Claim(key, ClaimKind.JOIN, token=pending.token)
            if pending is not None:
                self._add(txn, "claims_reaped", 1)
            self._add(txn, "misses", 1)
            token = secrets.token_hex(16)
            pid = os.getpid()
            record = PendingRecord(token=token, pid=pid, start_time=process_start_time(pid), started=time.time())
            txn.put(key.encode(), record.to_bytes(), db=self._db["pending"])
            return Claim(key, ClaimKind.PRODUCE, token=token)

    def fulfil(
        self,
        claim: Claim,
        array: np.ndarray | Any,
        meta: EntryMeta | None = None,
        *,
        lease: bool = True,
        owner_pid: int | None = None,
    ) -> Reference:
        """Store the produced embedding and clear the claim; waiters then find the entry."""
        _check_producing(claim)
        payload = self._payload(claim.key, array, meta or EntryMeta())
        self._ensure_arena()
        with self._write() as txn:
            reference = self._store_payload(txn, claim.key, payload, lease, owner_pid)
            self._clear_pending(txn, claim)
            self._add(txn, "encodes", 1)
            return reference

    def abandon(self, claim: Claim, error: BaseException | str) -> None:
        """Clear the claim after the producer failed and leave the error for its waiters.
        A later ``claim`` of the key starts a new production."""
        _check_producing(claim)
        code, message = _failure_of(error)
        with self._write() as txn:
            self._clear_pending(txn, claim)
            self._drop_old_failures(txn)
            failure = FailureRecord(code=code.value, message=message, failed=time.time())
            txn.put(claim.token.encode(), failure.to_bytes(), db=self._db["failures"])
            self._add(txn, "producer_failures", 1)

    def wait_for(
        self, claim: Claim, *, lease: bool = True, owner_pid: int | None = None, timeout_s: float | None = None
    ) -> Reference | None:
        """Wait for the production ``claim`` joined. Returns the reference once stored; None
        when that production vanished (its owner died or was taken over: claim again);
        raises the producer's error, or UNAVAILABLE after ``timeout_s``."""
        if claim.kind is not ClaimKind.JOIN:
            raise invalid_arg(f"wait_for needs a JOIN claim, got {claim.kind.value}")
        deadline = time.monotonic() + (timeout_s or self._config.wait_timeout_s)
        pause = 0.001
        while True:
            state = self._production_state(claim)
            if state == "stored":
                found = self._serve_if_present(claim.key, lease, owner_pid)
                if found is not None:
                    return found
                return None  # evicted between the two transactions: claim again
            if state == "gone":
                return None
            if time.monotonic() >= deadline:
                raise EpdError(
                    f"timed out after {timeout_s or self._config.wait_timeout_s:g} s waiting for another request "
                    f"to produce embedding {claim.key[:16]}",
                    ErrorCode.UNAVAILABLE,
                )
            time.sleep(pause)
            pause = min(pause * 2, self._config.max_poll_interval_s)

    def _production_state(self, claim: Claim) -> str:
        """'stored', 'running' or 'gone'; raises the producer's error if it failed."""
        with self._read() as txn:
            if txn.get(claim.key.encode(), db=self._db["entries"]) is not None:
                return "stored"
            raw_failure = txn.get(claim.token.encode(), db=self._db["failures"])
            if raw_failure is not None:
                failure = FailureRecord.from_bytes(raw_failure)
                raise EpdError(failure.message, ErrorCode(failure.code))
            pending = self._pending(txn, claim.key)
        if pending is None or pending.token != claim.token or not self._claim_is_live(pending):
            return "gone"
        return "running"

    def _serve_if_present(self, key: str, lease: bool, owner_pid: int | None) -> Reference | None:
        with self._write() as txn:
            entry = self._live_entry(txn, key)
            return None if entry is None else self._serve(txn, key, entry, lease, owner_pid)

    def _claim_is_live(self, pending: PendingRecord) -> bool:
        fresh = time.time() - pending.started < self._config.producer_timeout_s
        return fresh and _owner_alive(pending)

    def _clear_pending(self, txn: lmdb.Transaction, claim: Claim) -> None:
        pending = self._pending(txn, claim.key)
        if pending is not None and pending.token == claim.token:
            txn.delete(claim.key.encode(), db=self._db["pending"])

    def _drop_old_failures(self, txn: lmdb.Transaction) -> None:
        # A failure is read by waiters that joined before it; none waits longer than this.
        oldest_useful = time.time() - 2 * self._config.wait_timeout_s
        expired = [
            bytes(token)
            for token, raw in txn.cursor(db=self._db["failures"])
            if FailureRecord.from_bytes(raw).failed < oldest_useful
        ]
        for token in expired:
            txn.delete(token, db=self._db["failures"])

    def _pending(self, txn: lmdb.Transaction, key: str) -> PendingRecord | None:
        raw = txn.get(key.encode(), db=self._db["pending"])
        return None if raw is None else PendingRecord.from_bytes(raw)

    # --- reading ------------------------------------------------------------------------------

    def open_view(self, reference: Reference | bytes) -> AbstractContextManager[np.ndarray | DeviceView]:
        """Zero-copy, read-only array of the entry ``reference`` names, valid only inside
        the ``with`` block (see the module docstring): a numpy array on a host store, a
        ``DeviceView`` on a GPU store. Checks store id, tag, presence, generation and layout
        first: NOT_FOUND if the entry is gone, INVALID_ARG if the reference is bad."""
        ref = self._checked_reference(reference)
        return self._host_view(ref) if self._arena is None else self._device_view(ref)

    @contextmanager
    def _host_view(self, ref: Reference) -> Iterator[np.ndarray]:
        with self._read() as txn:
            self._entry_for(txn, ref)
            data = txn.get(ref.key.encode(), db=self._db["data"])
            if data is None or len(data) != ref.nbytes:
                raise EpdError(f"embedding store entry {ref.key[:16]} is inconsistent", ErrorCode.INTERNAL)
            yield np.frombuffer(data, dtype=ref.numpy_dtype()).reshape(ref.shape)

    @contextmanager
    def _device_view(self, ref: Reference) -> Iterator[DeviceView]:
        # A freed device range is reused by the next insert: only a lease keeps it intact.
        temporary = None if ref.lease_id else self.acquire_lease(ref)
        try:
            with self._read() as txn:
                entry = self._entry_for(txn, temporary or ref)
                self._check_lease_held(txn, temporary or ref)
                arena = self._live_arena(txn)
            pointer = self._arena.base(arena) + entry.offset  # type: ignore[union-attr, operator]
            yield DeviceView(pointer=pointer, shape=tuple(ref.shape), dtype=np.dtype(ref.numpy_dtype()))
        finally:
            if temporary is not None:
                self.release(temporary)

    def _check_lease_held(self, txn: lmdb.Transaction, ref: Reference) -> None:
        raw = txn.get(ref.lease_id.encode(), db=self._db["leases"])
        record = None if raw is None else LeaseRecord.from_bytes(raw)
        if record is None or record.key != ref.key or record.generation != ref.generation:
            raise EpdError(
                f"lease {ref.lease_id} of embedding {ref.key[:16]} is no longer held (released or reaped); "
                "look the embedding up again",
                ErrorCode.NOT_FOUND,
            )

    def resolve(self, reference: Reference | bytes) -> np.ndarray:
        """An owned, writeable host copy of the entry ``reference`` names (valid forever)."""
        with self.open_view(reference) as view:
            if isinstance(view, DeviceView):
                return self._arena.to_host(view)  # type: ignore[union-attr]
            return view.copy()

    def parse(self, data: bytes) -> Reference:
        """``parse_reference`` with this store's secret and merge size."""
        return self._checked_reference(data)

    def _checked_reference(self, reference: Reference | bytes) -> Reference:
        if isinstance(reference, Reference):
            check_reference(reference, merge_size=self._config.merge_size)
            ref = reference
        else:
            ref = parse_reference(reference, merge_size=self._config.merge_size)
        if ref.store_id != self._store_id:
            raise EpdError(
                f"embedding reference belongs to store {ref.store_id} at {ref.location}, not to this node's store "
                f"{self._store_id}; send the media again",
                ErrorCode.NOT_FOUND,
            )
        verify_tag(ref, self._secret)
        return ref

    def _entry_for(self, txn: lmdb.Transaction, ref: Reference) -> EntryRecord:
        """The entry ``ref`` names, checked against it."""
        entry = self._entry(txn, ref.key)
        if entry is None:
            raise EpdError(
                f"embedding {ref.key[:16]} ({ref.modality} {ref.mm_hash[:32]}) is not in the store: it was evicted "
                "or never stored here; send the media again",
                ErrorCode.NOT_FOUND,
            )
        if entry.generation != ref.generation:
            raise EpdError(
                f"embedding {ref.key[:16]} generation {ref.generation} was evicted (the store now holds generation "
                f"{entry.generation}); look it up again or send the media again",
                ErrorCode.NOT_FOUND,
            )
        mismatched = _layout_mismatches(ref, entry)
        if mismatched:
            raise invalid_arg(f"embedding reference does not match the stored entry: {', '.join(mismatched)} differ")
        if self._arena is not None:
            arena = self._arena.live(txn)
            if arena is None or arena.arena_id != entry.arena:
                raise EpdError(
                    f"embedding {ref.key[:16]} was lost: its GPU memory went with the process that allocated it; "
                    "send the media again",
                    ErrorCode.NOT_FOUND,
                )
        return entry

    # --- GPU arena ----------------------------------------------------------------------------

    def _ensure_arena(self) -> None:
        """Before a GPU store's write: make the node's arena if none is live. The block is
        allocated outside the transaction (it is slow) and freed again if another process
        installed one first."""
        if self._arena is None:
            return
        with self._read() as txn:
            if self._arena.live(txn) is not None:
                return
            size = self._capacity(txn)
        pointer, handle = self._arena.allocate_block(size)
        installed: ArenaRecord | None = None
        try:
            with self._write() as txn:
                if self._arena.live(txn) is None:
                    arena_id = self._add(txn, ARENA, 1)
                    self._drop_lost_entries(txn, arena_id)
                    installed = self._arena.install(txn, arena_id, size, pointer, handle)
                    # Before the commit, so that no thread here ever tries to map its own block.
                    self._arena.adopt(installed, pointer)
        except BaseException:
            if installed is not None:
                self._arena.forget(installed.arena_id)
            self._arena.discard_block(pointer)
            raise
        if installed is None:  # another process or thread installed one first
            self._arena.discard_block(pointer)

    def _drop_lost_entries(self, txn: lmdb.Transaction, live_arena: int) -> None:
        lost = [
            (bytes(key).decode(), entry)
            for key, raw in txn.cursor(db=self._db["entries"])
            if (entry := EntryRecord.from_bytes(raw)).offset >= 0 and entry.arena != live_arena
        ]
        for key, entry in lost:
            self._delete_entry(txn, key, entry)
        self._add(txn, "entries_lost", len(lost))

    def _live_arena(self, txn: lmdb.Transaction) -> ArenaRecord | None:
        """The arena a GPU store writes to (None on a host store)."""
        if self._arena is None:
            return None
        arena = self._arena.live(txn)
        if arena is None:
            raise EpdError(
                "the GPU embedding store's memory went with the process that allocated it; retry the request",
                ErrorCode.UNAVAILABLE,
            )
        return arena

    # --- metrics and maintenance --------------------------------------------------------------

    def metrics(self) -> dict[str, int]:
        """One consistent snapshot of the store's counters and gauges (all processes)."""
        with self._read() as txn:
            snapshot = {name: self._counter(txn, name) for name in CUMULATIVE_COUNTERS + GAUGE_COUNTERS}
            snapshot["capacity_bytes"] = decode_counter(txn.get(b"capacity", db=self._db["config"]))
        # High-water mark of the LMDB file: payload plus B-tree pages plus pages pinned by views.
        snapshot["map_used_bytes"] = (self._env.info()["last_pgno"] + 1) * self._env.stat()["psize"]
        snapshot["map_size_bytes"] = self._env.info()["map_size"]
        return snapshot

    def clear(self) -> None:
        """Drop every entry, lease, claim and failure. Cumulative counters, generations and
        the store identity stay, so old references answer NOT_FOUND rather than match new
        entries. Views open elsewhere keep reading their snapshot."""
        with self._write() as txn:
            for name in ("data", "entries", "lru", "leases", "pending", "failures"):
                txn.drop(self._db[name], delete=False)
            for gauge in GAUGE_COUNTERS:
                txn.put(gauge.encode(), encode_counter(0), db=self._db["counters"])
            arena = None if self._arena is None else self._arena.live(txn)
            if arena is not None:
                self._arena.reset(txn, arena.size)  # type: ignore[union-attr]

    # --- transactions and records -------------------------------------------------------------

    @contextmanager
    def _write(self) -> Iterator[lmdb.Transaction]:
        self._check_process()
        try:
            with self._env.begin(write=True) as txn:
                yield txn
        except lmdb.MapFullError:
            raise EpdError(
                f"embedding store file at {self._config.path} is full: long-open views keep freed pages in use; "
                "shorten views or raise map_size_bytes",
                ErrorCode.UNAVAILABLE,
            ) from None
        except lmdb.Error as exc:  # e.g. /dev/shm itself is full (a container's --shm-size)
            raise EpdError(f"embedding store at {self._config.path} failed: {exc}", ErrorCode.UNAVAILABLE) from None

    @contextmanager
    def _read(self) -> Iterator[lmdb.Transaction]:
        self._check_process()
        txn = self._env.begin(buffers=True)
        try:
            yield txn
        finally:
            txn.abort()

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise EpdError(
                f"embedding store opened in process {self._pid} used in process {os.getpid()} after fork; "
                "open a new EmbeddingStore in each process",
                ErrorCode.INTERNAL,
            )

    def _entry(self, txn: lmdb.Transaction, key: str) -> EntryRecord | None:
        raw = txn.get(key.encode(), db=self._db["entries"])
        return None if raw is None else EntryRecord.from_bytes(raw)

    def _write_entry(self, txn: lmdb.Transaction, key: str, entry: EntryRecord) -> None:
        txn.put(key.encode(), entry.to_bytes(), db=self._db["entries"])

    def _counter(self, txn: lmdb.Transaction, name: str) -> int:
        return decode_counter(txn.get(name.encode(), db=self._db["counters"]))

    def _add(self, txn: lmdb.Transaction, name: str, delta: int) -> int:
        value = self._counter(txn, name) + delta
        txn.put(name.encode(), encode_counter(value), db=self._db["counters"])
        return value


# --- module helpers (pure functions) ------------------------------------------------------------


def _open_environment(config: StoreConfig) -> lmdb.Environment:
    os.makedirs(config.path, mode=0o700, exist_ok=True)
    try:
        return lmdb.open(
            config.path,
            map_size=config.effective_map_size(),
            max_dbs=len(DATABASE_NAMES),
            max_readers=config.max_readers,
            # A cache in shared memory: a process crash loses nothing (the pages live in the
            # kernel), a machine crash loses /dev/shm anyway, so no fsync.
            sync=False,
            metasync=False,
            readahead=False,
        )
    except lmdb.Error as exc:
        if "already open" in str(exc):
            raise EpdError(
                f"embedding store at {config.path} is already open in this process; share that EmbeddingStore",
                ErrorCode.INTERNAL,
            ) from None
        raise EpdError(f"cannot open the embedding store at {config.path}: {exc}", ErrorCode.UNAVAILABLE) from None


def _is_lowercase_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not 16 <= len(key) <= 128 or not _is_lowercase_hex(key):
        raise invalid_arg("embedding store key must be 16-128 lowercase hex characters (use content_key)")


def _wire_dtype(dtype: np.dtype, declared: str | None) -> str:
    if declared == "bfloat16":
        if dtype != np.uint16:
            raise invalid_arg("bfloat16 embeddings are stored as their uint16 bit patterns; pass a uint16 view")
        return "bfloat16"
    name = dtype.name
    if declared not in (None, name) or name not in DTYPES or name == "bfloat16":
        raise invalid_arg(f"embedding dtype {name} is not storable; use one of {sorted(DTYPES)}")
    return name


def _grid_tuple(grid_thw: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
    # Accept lists and numpy integers from callers; records and references hold plain ints.
    return None if grid_thw is None else tuple(int(side) for side in grid_thw)  # type: ignore[return-value]


def _owner_alive(record: LeaseRecord | PendingRecord) -> bool:
    return process_is_alive(record.pid, record.start_time)


def _layout_mismatches(ref: Reference, entry: EntryRecord) -> list[str]:
    pairs = {
        "dtype": (ref.dtype, entry.dtype),
        "shape": (tuple(ref.shape), tuple(entry.shape)),
        "nbytes": (ref.nbytes, entry.nbytes),
        "placeholders": (ref.num_placeholders, entry.num_placeholders),
        "grid": (ref.grid_thw, entry.grid_thw),
        "modality": (ref.modality, entry.modality),
        "mm_hash": (ref.mm_hash, entry.mm_hash),
    }
    return [name for name, (left, right) in pairs.items() if left != right]


def _check_producing(claim: Claim) -> None:
    if claim.kind is not ClaimKind.PRODUCE:
        raise invalid_arg(f"only a PRODUCE claim can be fulfilled or abandoned, got {claim.kind.value}")


def _claimed_reference(claim: Claim) -> Reference:
    if claim.reference is None:
        raise EpdError(f"HIT claim for {claim.key[:16]} carries no reference", ErrorCode.INTERNAL)
    return claim.reference


def _failure_of(error: BaseException | str) -> tuple[ErrorCode, str]:
    """What waiters are told when the producer failed: its message if it was ours, else the kind."""
    if isinstance(error, EpdError):
        return error.code, error.message
    if isinstance(error, str):
        return ErrorCode.INTERNAL, error[:500]
    detail = str(error)[:300]
    message = f"producing the embedding failed: {type(error).__name__}"
    return ErrorCode.INTERNAL, f"{message}: {detail}" if detail else message

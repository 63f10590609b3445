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

References
    ``parse_reference`` parses and verifies reference bytes once per process (a bounded
    cache keyed by the exact bytes, ``verified.py``); every method that takes bytes goes
    through it. Presence, generation, lease and layout are still checked on every read.

Parts
    ``tables`` (the LMDB environment, counters, entry records and LRU order), ``placement``
    (host or device bytes), ``entries`` (insert, evict, expire, serve, check against a
    reference), ``leases``, ``single_flight``, ``verified`` (the reference cache).
    :class:`EmbeddingStore` is the contract above: it only composes those parts.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import AbstractContextManager
from typing import Any

import lmdb
import numpy as np

from python_backends.store.config import DEFAULT_CAPACITY_BYTES, DEFAULT_STORE_PATH, StoreConfig
from python_backends.store.device_memory import CudaIpcMemory, DeviceMemory, DeviceView
from python_backends.store.entries import Entries, StoreFullError
from python_backends.store.leases import Leases, ReapReport, check_lease_id
from python_backends.store.payload import EntryMeta, Payload, check_key
from python_backends.store.placement import DevicePlacement, HostPlacement, Placement
from python_backends.store.reference import Reference
from python_backends.store.single_flight import Claim, ClaimKind, Producer, SingleFlight
from python_backends.store.tables import Tables
from python_backends.store.verified import VerifiedReferences

__all__ = [
    "DEFAULT_CAPACITY_BYTES",
    "DEFAULT_STORE_PATH",
    "Claim",
    "ClaimKind",
    "EmbeddingStore",
    "EntryMeta",
    "Producer",
    "ReapReport",
    "StoreConfig",
    "StoreFullError",
]


class EmbeddingStore:
    """One process's handle on the node's store. Safe to share between threads; open one
    per process (an LMDB environment must not cross ``fork``)."""

    def __init__(self, config: StoreConfig | None = None, device_memory: DeviceMemory | None = None) -> None:
        """``device_memory``: how a GPU store reaches its device (default: CUDA IPC on
        ``config.device``); ignored by host stores."""
        self._config = config or StoreConfig()
        self._config.validate()
        self._tables = Tables(self._config)
        self._store_id, self._secret = self._tables.open_identity(self._config.capacity_bytes)
        self._placement: Placement = self._placement_for(device_memory)
        self._leases = Leases(self._tables, self._config.max_lease_age_s)
        self._flights = SingleFlight(self._tables, self._config)
        identity = (self._store_id, self._secret)
        self._entries = Entries(self._tables, self._placement, self._leases, self._config, identity, self._reap)
        self._references = VerifiedReferences(self._store_id, self._secret, self._config.merge_size)

    def _placement_for(self, device_memory: DeviceMemory | None) -> Placement:
        device = self._config.device_index
        if device is None:
            return HostPlacement(self._tables)
        return DevicePlacement(self._tables, device_memory or CudaIpcMemory(device))

    # --- lifecycle and identity ---------------------------------------------------------------

    def close(self) -> None:
        """Close the environment. Arrays from views must not be touched afterwards. A GPU
        store's process that allocated the arena frees it here: its entries are lost."""
        self._placement.close()
        self._tables.close()

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
        self._placement.prepare()
        with self._tables.write() as txn:
            return self._entries.insert(txn, key, payload, lease, owner_pid)

    def _payload(self, key: str, array: np.ndarray | Any, meta: EntryMeta) -> Payload:
        check_key(key)
        data, dtype = self._placement.accept(array, meta.dtype)
        return Payload.of(key, data, dtype, meta, self._config.merge_size)

    # --- finding ------------------------------------------------------------------------------

    def lookup(
        self, key: str, *, lease: bool = True, owner_pid: int | None = None, count_miss: bool = True
    ) -> Reference | None:
        """The reference of a stored key (a hit, leased unless ``lease=False``) or None (a miss).

        ``count_miss=False``: a fast-path probe whose miss goes on to a ``claim`` (which counts it),
        so that one request's miss is not counted twice."""
        check_key(key)
        with self._tables.write() as txn:
            entry = self._entries.live_entry(txn, key)
            if entry is not None or count_miss:
                self._tables.add(txn, "misses" if entry is None else "hits", 1)
            return None if entry is None else self._entries.serve(txn, key, entry, lease, owner_pid)

    def contains(self, key: str) -> bool:
        """Whether ``key`` is stored now. Counts nothing and touches nothing."""
        check_key(key)
        with self._tables.read() as txn:
            return self._tables.has_entry(txn, key)

    # --- leases -------------------------------------------------------------------------------

    def acquire_lease(self, reference: Reference | bytes, *, owner_pid: int | None = None) -> Reference:
        """A new lease on the entry ``reference`` names; returns the reference carrying it.

        Called by a stage that keeps using an entry beyond the lease it was handed (or that
        got a reference without one). NOT_FOUND when that generation is gone.
        """
        return self._entries.acquire_lease(self._verified(reference), owner_pid)

    def release(self, lease: Reference | str) -> bool:
        """Release a lease (by id or by the reference carrying it). False when it was not
        held: already released, reaped or cleared. Called once per lease by its owner."""
        lease_id = lease.lease_id if isinstance(lease, Reference) else lease
        if not lease_id:
            return False
        check_lease_id(lease_id)
        return self._entries.release(lease_id)

    def reap_dead_processes(self) -> ReapReport:
        """Release leases, drop single-flight claims and free LMDB reader slots whose owner
        process is gone.

        Call it periodically (and at model start-up): a process that crashed mid-request
        leaves its leases behind, and this is what returns them.
        """
        # A dead process's open view would pin freed pages forever; LMDB frees its reader slot.
        readers = self._tables.free_dead_readers()
        with self._tables.write() as txn:
            return dataclasses.replace(self._reap(txn), readers=readers)

    def _reap(self, txn: lmdb.Transaction) -> ReapReport:
        return ReapReport(leases=self._leases.reap(txn), claims=self._flights.reap(txn))

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
                return claim.hit_reference()
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
        check_key(key)
        with self._tables.write() as txn:
            entry = self._entries.live_entry(txn, key)
            if entry is None:
                return self._flights.join_or_produce(txn, key)
            self._tables.add(txn, "hits", 1)
            return Claim(key, ClaimKind.HIT, reference=self._entries.serve(txn, key, entry, lease, owner_pid))

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
        claim.check_producing()
        payload = self._payload(claim.key, array, meta or EntryMeta())
        self._placement.prepare()
        with self._tables.write() as txn:
            reference = self._entries.insert(txn, claim.key, payload, lease, owner_pid)
            self._flights.finish(txn, claim)
            self._tables.add(txn, "encodes", 1)
            return reference

    def abandon(self, claim: Claim, error: BaseException | str) -> None:
        """Clear the claim after the producer failed and leave the error for its waiters.
        A later ``claim`` of the key starts a new production."""
        claim.check_producing()
        with self._tables.write() as txn:
            self._flights.fail(txn, claim, error)

    def wait_for(
        self, claim: Claim, *, lease: bool = True, owner_pid: int | None = None, timeout_s: float | None = None
    ) -> Reference | None:
        """Wait for the production ``claim`` joined. Returns the reference once stored; None
        when that production vanished (its owner died or was taken over: claim again);
        raises the producer's error, or UNAVAILABLE after ``timeout_s``."""
        return self._flights.wait(claim, timeout_s, lambda: self._entries.serve_if_present(claim.key, lease, owner_pid))

    # --- reading ------------------------------------------------------------------------------

    def open_view(self, reference: Reference | bytes) -> AbstractContextManager[np.ndarray | DeviceView]:
        """Zero-copy, read-only array of the entry ``reference`` names, valid only inside
        the ``with`` block (see the module docstring): a numpy array on a host store, a
        ``DeviceView`` on a GPU store. Checks store id, tag, presence, generation and layout
        first: NOT_FOUND if the entry is gone, INVALID_ARG if the reference is bad."""
        return self._placement.view(self._verified(reference), self._entries)

    def resolve(self, reference: Reference | bytes) -> np.ndarray:
        """An owned, writeable host copy of the entry ``reference`` names (valid forever)."""
        with self.open_view(reference) as view:
            return self._placement.to_host(view)

    def parse_reference(self, raw: bytes) -> Reference:
        """The verified :class:`Reference` of ``raw`` (its wire bytes), parsed and verified
        once per process.

        Called by every stage that receives reference bytes (the ``epd`` BLS, prefill,
        decode) and by this store's own methods that take bytes (``open_view``, ``resolve``,
        ``acquire_lease``). Checks what ``reference.parse_reference`` checks, with this
        store's merge size, plus the store id (NOT_FOUND: another store's) and the HMAC tag
        (INVALID_ARG); a verified result is cached by the exact bytes (bounded LRU), so the
        same bytes are not parsed or verified twice in a process.

        It may not answer whether the entry still exists: it reads no table, takes no lease
        and counts nothing. A reference it returns may name an entry that was evicted the
        moment before; ``open_view``, ``resolve`` and ``acquire_lease`` check presence,
        generation, layout and lease on every call.
        """
        return self._references.parse(raw)

    def parse(self, data: bytes) -> Reference:
        """``parse_reference`` under its first name, for callers written before it."""
        return self.parse_reference(data)

    def _verified(self, reference: Reference | bytes) -> Reference:
        if isinstance(reference, Reference):
            return self._references.check(reference)
        return self._references.parse(reference)

    # --- metrics and maintenance --------------------------------------------------------------

    def metrics(self) -> dict[str, int]:
        """One consistent snapshot of the store's counters and gauges (all processes)."""
        return self._tables.metrics()

    def clear(self) -> None:
        """Drop every entry, lease, claim and failure. Cumulative counters, generations and
        the store identity stay, so old references answer NOT_FOUND rather than match new
        entries. Views open elsewhere keep reading their snapshot."""
        with self._tables.write() as txn:
            self._tables.clear(txn)
            self._placement.clear(txn)

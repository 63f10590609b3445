"""The entries of the store: insert with LRU eviction, find with expiry, serve with a lease,
and check a reference against the entry it names.

An entry is a record (``tables``) plus bytes (``placement``); every change to either
happens in one write transaction, so the bytes counted never exceed the capacity and no
process ever sees a record without its bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import lmdb

from python_backends.errors import EpdError, ErrorCode, invalid_arg
from python_backends.store.config import StoreConfig
from python_backends.store.leases import Leases
from python_backends.store.payload import Payload
from python_backends.store.placement import Placement
from python_backends.store.records import CLOCK, GENERATION, EntryRecord
from python_backends.store.reference import Reference, make_reference
from python_backends.store.tables import Tables


class StoreFullError(EpdError):
    """UNAVAILABLE because leases of running requests hold every byte: waiting can help."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ErrorCode.UNAVAILABLE)


class Entries:
    """One process's access to the entries, for ``EmbeddingStore``; ``txn`` is always the
    caller's write transaction unless a method opens its own."""

    def __init__(
        self,
        tables: Tables,
        placement: Placement,
        leases: Leases,
        config: StoreConfig,
        identity: tuple[str, bytes],
        reap: Callable[[lmdb.Transaction], object],
    ) -> None:
        """``reap``: release what dead processes hold (eviction tries it before giving up)."""
        self._tables = tables
        self._placement = placement
        self._leases = leases
        self._reap = reap
        self._config = config
        self._store_id, self._secret = identity
        self._location = config.effective_location()

    # --- inserting and evicting ---------------------------------------------------------------

    def insert(
        self, txn: lmdb.Transaction, key: str, payload: Payload, lease: bool, owner_pid: int | None
    ) -> Reference:
        """Store ``payload`` under ``key`` unless it is there already (then serve that entry)."""
        existing = self.live_entry(txn, key)
        if existing is not None:
            return self.serve(txn, key, existing, lease, owner_pid)
        arena, offset = self._make_room(txn, payload.nbytes)
        entry = EntryRecord(
            generation=self._tables.add(txn, GENERATION, 1),
            dtype=payload.dtype,
            shape=payload.shape,
            nbytes=payload.nbytes,
            modality=payload.meta.modality,
            mm_hash=payload.meta.mm_hash,
            num_placeholders=int(payload.meta.num_placeholders or 0),
            grid_thw=payload.meta.grid_thw,
            tick=self._tables.add(txn, CLOCK, 1),
            leases=0,
            created=time.time(),
            arena=arena,
            offset=offset,
        )
        self._placement.write(txn, key, entry, payload)
        self._tables.insert_entry(txn, key, entry)
        self._tables.add(txn, "puts", 1)
        lease_id = self._leases.take(txn, key, entry, owner_pid) if lease else ""
        return self.reference(key, entry, lease_id)

    def _make_room(self, txn: lmdb.Transaction, nbytes: int) -> tuple[int, int]:
        """Evict until ``nbytes`` fit and take a place for them: (arena, offset)."""
        capacity = self._placement.capacity(txn, self._tables.capacity(txn))
        if nbytes > capacity:
            raise invalid_arg(
                f"embedding of {nbytes} bytes is larger than the store capacity ({capacity} bytes); "
                "raise capacity_bytes"
            )
        needed = self._tables.counter(txn, "bytes_used") + nbytes - capacity
        if needed > 0 and not self._evict(txn, needed):
            raise self._full(txn, capacity)
        place = self._placement.take(txn, nbytes)
        while place is None:  # enough bytes free, but not in one range: evict more, LRU first
            if not self._evict(txn, 1):
                raise self._full(txn, capacity)
            place = self._placement.take(txn, nbytes)
        return place

    def _evict(self, txn: lmdb.Transaction, needed: int) -> bool:
        freed = self._evict_lru(txn, needed)
        if freed < needed:
            # Dead processes may still hold leases; free them before giving up.
            self._reap(txn)
            freed += self._evict_lru(txn, needed - freed)
        return freed >= needed

    def _evict_lru(self, txn: lmdb.Transaction, needed: int) -> int:
        """Evict unleased entries, least recently used first, until ``needed`` bytes are free."""
        victims: list[tuple[str, EntryRecord]] = []
        freed = 0
        for key, entry in self._tables.least_recently_used(txn):
            if freed >= needed:
                break
            if entry.leases == 0:
                victims.append((key, entry))
                freed += entry.nbytes
        for key, entry in victims:
            self.delete(txn, key, entry)
            self._tables.add(txn, "evictions", 1)
        return freed

    def _full(self, txn: lmdb.Transaction, capacity: int) -> StoreFullError:
        return StoreFullError(
            f"embedding store is full: {self._tables.counter(txn, 'bytes_used')} of {capacity} bytes are held by "
            f"{self._tables.counter(txn, 'active_leases')} leases of running requests; "
            "retry later or raise capacity_bytes"
        )

    def delete(self, txn: lmdb.Transaction, key: str, entry: EntryRecord) -> None:
        self._placement.free(txn, key, entry)
        self._tables.drop_entry(txn, key, entry)

    # --- finding and serving ------------------------------------------------------------------

    def live_entry(self, txn: lmdb.Transaction, key: str) -> EntryRecord | None:
        """The entry of ``key`` unless it outlived ``ttl_s`` with no lease on it (then it is
        dropped here and counted as an expiration). A leased entry is in use: it stays."""
        entry = self._tables.entry(txn, key)
        ttl = self._config.ttl_s
        if entry is None or ttl is None or entry.leases or time.time() - entry.created < ttl:
            return entry
        self.delete(txn, key, entry)
        self._tables.add(txn, "expirations", 1)
        return None

    def serve(
        self, txn: lmdb.Transaction, key: str, entry: EntryRecord, lease: bool, owner_pid: int | None
    ) -> Reference:
        """Mark ``entry`` as just used, lease it if asked, and sign a reference to it."""
        entry = self._tables.touch(txn, key, entry)
        lease_id = self._leases.take(txn, key, entry, owner_pid) if lease else ""
        return self.reference(key, entry, lease_id)

    def serve_if_present(self, key: str, lease: bool, owner_pid: int | None) -> Reference | None:
        with self._tables.write() as txn:
            entry = self.live_entry(txn, key)
            return None if entry is None else self.serve(txn, key, entry, lease, owner_pid)

    def reference(self, key: str, entry: EntryRecord, lease_id: str) -> Reference:
        return make_reference(
            modality=entry.modality,
            mm_hash=entry.mm_hash,
            store_id=self._store_id,
            location=self._location,
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

    # --- what a view asks (placement.EntryAccess) ---------------------------------------------

    def entry_for(self, txn: lmdb.Transaction, ref: Reference) -> EntryRecord:
        """The entry a verified ``ref`` names, checked against it on every read: NOT_FOUND when
        it is gone or another generation, INVALID_ARG when its layout differs."""
        entry = self._tables.entry(txn, ref.key)
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
        self._placement.check_live(txn, ref, entry)
        return entry

    def check_lease_held(self, txn: lmdb.Transaction, ref: Reference) -> None:
        self._leases.check_held(txn, ref)

    def acquire_lease(self, ref: Reference, owner_pid: int | None = None) -> Reference:
        """A new lease on the entry a verified ``ref`` names; the reference carrying it."""
        with self._tables.write() as txn:
            entry = self.entry_for(txn, ref)
            return self.serve(txn, ref.key, entry, True, owner_pid)

    def release(self, lease_id: str) -> bool:
        with self._tables.write() as txn:
            return self._leases.release(txn, lease_id)


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

"""Where an entry's bytes live: in LMDB's shared-memory map, or in one block of GPU memory.

Everything else about an entry (its record, LRU order, leases, single-flight) is the same
for both and lives in LMDB; a :class:`Placement` answers only the questions whose answer
depends on where the bytes are: which arrays it takes, how much room there is and where
a new entry goes, how bytes are written, viewed, copied out and freed, and what keeps a
view's bytes intact (a host view: LMDB's read snapshot; a device view: a lease).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import lmdb
import numpy as np

from python_backends.errors import EpdError, ErrorCode, invalid_arg
from python_backends.store.arena import Arena
from python_backends.store.device_memory import DeviceArray, DeviceMemory, DeviceView
from python_backends.store.payload import Payload, host_array, wire_dtype
from python_backends.store.records import ARENA, ArenaRecord, EntryRecord
from python_backends.store.reference import DTYPES, Reference
from python_backends.store.tables import Tables

HOST_SLOT = (0, -1)  # (arena, offset) of an entry whose bytes are in the ``data`` table


class EntryAccess(Protocol):
    """What a view asks of the store's entries before it hands out any byte."""

    def entry_for(self, txn: lmdb.Transaction, ref: Reference) -> EntryRecord: ...

    def check_lease_held(self, txn: lmdb.Transaction, ref: Reference) -> None: ...

    def acquire_lease(self, ref: Reference) -> Reference: ...

    def release(self, lease_id: str) -> bool: ...


class Placement(Protocol):
    """Called by the store only, inside its transactions where a ``txn`` is passed."""

    def accept(self, array: np.ndarray | Any, declared_dtype: str | None) -> tuple[np.ndarray | DeviceArray, str]:
        """The array to store, in its stored dtype, and that dtype's name; INVALID_ARG otherwise."""
        ...

    def prepare(self) -> None:
        """Before a write transaction that may insert (slow set-up belongs here, outside it)."""
        ...

    def capacity(self, txn: lmdb.Transaction, configured: int) -> int:
        """The bytes entries may use now."""
        ...

    def take(self, txn: lmdb.Transaction, nbytes: int) -> tuple[int, int] | None:
        """(arena, offset) of room for ``nbytes`` now taken, None when no free range fits."""
        ...

    def write(self, txn: lmdb.Transaction, key: str, entry: EntryRecord, payload: Payload) -> None: ...

    def free(self, txn: lmdb.Transaction, key: str, entry: EntryRecord) -> None: ...

    def check_live(self, txn: lmdb.Transaction, ref: Reference, entry: EntryRecord) -> None:
        """NOT_FOUND when the entry's record is there but its bytes are gone."""
        ...

    def view(self, ref: Reference, access: EntryAccess) -> AbstractContextManager[np.ndarray | DeviceView]: ...

    def to_host(self, view: np.ndarray | DeviceView) -> np.ndarray:
        """An owned, writeable host copy of a view's bytes."""
        ...

    def clear(self, txn: lmdb.Transaction) -> None: ...

    def close(self) -> None: ...


class HostPlacement:
    """Bytes in the ``data`` table, inside LMDB's memory map (``/dev/shm``). A view is a numpy
    array over the map, kept intact by its read transaction's snapshot."""

    def __init__(self, tables: Tables) -> None:
        self._tables = tables
        self._data = tables.db["data"]

    def accept(self, array: np.ndarray | Any, declared_dtype: str | None) -> tuple[np.ndarray | DeviceArray, str]:
        if not isinstance(array, np.ndarray):
            raise invalid_arg(f"embedding must be a numpy array, got {type(array).__name__}")
        return host_array(array, declared_dtype)

    def prepare(self) -> None:
        pass

    def capacity(self, txn: lmdb.Transaction, configured: int) -> int:
        return configured

    def take(self, txn: lmdb.Transaction, nbytes: int) -> tuple[int, int] | None:
        return HOST_SLOT  # LMDB places the bytes

    def write(self, txn: lmdb.Transaction, key: str, entry: EntryRecord, payload: Payload) -> None:
        txn.put(key.encode(), memoryview(payload.data).cast("B"), db=self._data)  # type: ignore[arg-type]

    def free(self, txn: lmdb.Transaction, key: str, entry: EntryRecord) -> None:
        txn.delete(key.encode(), db=self._data)

    def check_live(self, txn: lmdb.Transaction, ref: Reference, entry: EntryRecord) -> None:
        pass  # bytes and record live and die in the same transactions

    @contextmanager
    def view(self, ref: Reference, access: EntryAccess) -> Iterator[np.ndarray]:
        with self._tables.read() as txn:
            access.entry_for(txn, ref)
            data = txn.get(ref.key.encode(), db=self._data)
            if data is None or len(data) != ref.nbytes:
                raise EpdError(f"embedding store entry {ref.key[:16]} is inconsistent", ErrorCode.INTERNAL)
            yield np.frombuffer(data, dtype=ref.numpy_dtype()).reshape(ref.shape)

    def to_host(self, view: np.ndarray | DeviceView) -> np.ndarray:
        return view.copy()  # type: ignore[union-attr]

    def clear(self, txn: lmdb.Transaction) -> None:
        txn.drop(self._data, delete=False)

    def close(self) -> None:
        pass


class DevicePlacement:
    """Bytes in the node's arena: one block of device memory shared by CUDA IPC, cut into
    ranges (``arena.py``). A freed range is reused by the next insert at once (no snapshot
    protects it), so a view holds a lease for the block's duration."""

    def __init__(self, tables: Tables, memory: DeviceMemory) -> None:
        self._tables = tables
        self._arena = Arena(memory, tables.db["config"], tables.db["extents"])

    def accept(self, array: np.ndarray | Any, declared_dtype: str | None) -> tuple[np.ndarray | DeviceArray, str]:
        if isinstance(array, np.ndarray):
            return host_array(array, declared_dtype)
        data = DeviceArray.of(array)
        dtype = wire_dtype(data.dtype, declared_dtype)
        if data.dtype != np.dtype(DTYPES[dtype]):
            raise invalid_arg(f"a CUDA embedding must be little-endian {dtype}, got {data.dtype.str}")
        return data, dtype

    def prepare(self) -> None:
        """Make the node's arena if none is live. The block is allocated outside the
        transaction (it is slow) and freed again if another process installed one first."""
        with self._tables.read() as txn:
            if self._arena.live(txn) is not None:
                return
            size = self._tables.capacity(txn)
        pointer, handle = self._arena.allocate_block(size)
        installed: ArenaRecord | None = None
        try:
            with self._tables.write() as txn:
                if self._arena.live(txn) is None:
                    arena_id = self._tables.add(txn, ARENA, 1)
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
        # Their bytes went with the old block: only the records are left to forget.
        lost = [
            (key, entry) for key, entry in self._tables.entries(txn) if entry.offset >= 0 and entry.arena != live_arena
        ]
        for key, entry in lost:
            self._tables.drop_entry(txn, key, entry)
        self._tables.add(txn, "entries_lost", len(lost))

    def capacity(self, txn: lmdb.Transaction, configured: int) -> int:
        # A block keeps the size it was made with; a new capacity applies to the next.
        return min(configured, self._live(txn).size)

    def take(self, txn: lmdb.Transaction, nbytes: int) -> tuple[int, int] | None:
        arena = self._live(txn)
        offset = self._arena.take(txn, nbytes)
        return None if offset is None else (arena.arena_id, offset)

    def write(self, txn: lmdb.Transaction, key: str, entry: EntryRecord, payload: Payload) -> None:
        self._arena.write(self._live(txn), entry.offset, payload.pointer, entry.nbytes)

    def free(self, txn: lmdb.Transaction, key: str, entry: EntryRecord) -> None:
        arena = self._arena.live(txn)
        if arena is not None and arena.arena_id == entry.arena:
            self._arena.give_back(txn, entry.offset, entry.nbytes)

    def check_live(self, txn: lmdb.Transaction, ref: Reference, entry: EntryRecord) -> None:
        arena = self._arena.live(txn)
        if arena is None or arena.arena_id != entry.arena:
            raise EpdError(
                f"embedding {ref.key[:16]} was lost: its GPU memory went with the process that allocated it; "
                "send the media again",
                ErrorCode.NOT_FOUND,
            )

    @contextmanager
    def view(self, ref: Reference, access: EntryAccess) -> Iterator[DeviceView]:
        temporary = None if ref.lease_id else access.acquire_lease(ref)
        held = temporary or ref
        try:
            with self._tables.read() as txn:
                entry = access.entry_for(txn, held)
                access.check_lease_held(txn, held)
                arena = self._live(txn)
            pointer = self._arena.base(arena) + entry.offset
            yield DeviceView(pointer=pointer, shape=tuple(ref.shape), dtype=np.dtype(ref.numpy_dtype()))
        finally:
            if temporary is not None:
                access.release(temporary.lease_id)

    def to_host(self, view: np.ndarray | DeviceView) -> np.ndarray:
        return self._arena.to_host(view)  # type: ignore[arg-type]

    def clear(self, txn: lmdb.Transaction) -> None:
        arena = self._arena.live(txn)
        if arena is not None:
            self._arena.reset(txn, arena.size)

    def close(self) -> None:
        """Unmap the arena; the process that allocated it frees it (its entries are lost)."""
        self._arena.close()

    def free_ranges(self) -> list[tuple[int, int]]:
        """(offset, length) of the arena's free ranges, in address order (for tests and debugging)."""
        with self._tables.read() as txn:
            return self._arena.free_ranges(txn)

    def _live(self, txn: lmdb.Transaction) -> ArenaRecord:
        """The arena a write goes to; UNAVAILABLE when it went with its owner since ``prepare``."""
        arena = self._arena.live(txn)
        if arena is None:
            raise EpdError(
                "the GPU embedding store's memory went with the process that allocated it; retry the request",
                ErrorCode.UNAVAILABLE,
            )
        return arena

"""Where a GPU store keeps its bytes: one block of device memory per node, cut into ranges.

The first process that writes to a GPU store allocates one block of ``capacity_bytes``
(``DeviceMemory.allocate``) and records it (:class:`ArenaRecord`: size, owner, IPC
handle) in the store's LMDB ``config`` table; every other process maps the block once
(``DeviceMemory.open``) and caches the mapping. An entry is a byte range of the block.
The free ranges live in LMDB too (``extents``: offset -> length, first fit, neighbours
merged on free), so the process that evicts an entry frees its range and the process that
inserts one takes a range in the same write transaction that updates the entry table:
placement, LRU and capacity can never disagree across processes.

Why one block rather than an allocation per entry: a reader maps each block once
(``cudaIpcOpenMemHandle`` costs far more than a lookup), and no process has to ask the
writer of an entry to free it.

Lifetime: CUDA frees a block when the process that allocated it exits. Its entries are
then gone; readers get NOT_FOUND ("send the media again") because the entry's arena id
no longer names the live arena, and the next writer makes a new block and drops the lost
entries (counted as ``entries_lost``). In Triton every model instance lives until the
server stops or the model is unloaded, so in practice the block lives as long as the
encoder instance that wrote first.
"""

from __future__ import annotations

import os
import struct
import threading

import lmdb
import numpy as np

from python_backends.store.device_memory import DeviceMemory, DeviceView
from python_backends.store.processes import process_is_alive, process_start_time
from python_backends.store.records import ArenaRecord

ALIGNMENT = 256  # bytes; what cudaMalloc guarantees, so every entry starts as aligned as a fresh tensor
_ARENA_KEY = b"arena"
_U64 = struct.Struct(">Q")  # big-endian, so LMDB's byte order is the numeric order of offsets


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class Arena:
    """One process's view of the node's GPU block and its free ranges.

    Called by ``EmbeddingStore`` only, inside its LMDB transactions (``txn``); thread-safe
    for the mapping cache. Holds no entry state: that is all in LMDB."""

    def __init__(self, memory: DeviceMemory, config_db: lmdb._Database, extents_db: lmdb._Database) -> None:
        self._memory = memory
        self._config_db = config_db
        self._extents_db = extents_db
        self._pointers: dict[int, int] = {}  # arena id -> base pointer in this process
        self._owned: set[int] = set()  # arena ids this process allocated (freed on close)
        self._lock = threading.Lock()

    # --- the block ----------------------------------------------------------------------------

    def live(self, txn: lmdb.Transaction) -> ArenaRecord | None:
        """The block in use, or None when none was made or its owner has exited."""
        raw = txn.get(_ARENA_KEY, db=self._config_db)
        if raw is None:
            return None
        record = ArenaRecord.from_bytes(raw)
        mine = record.arena_id in self._owned
        return record if mine or process_is_alive(record.pid, record.start_time) else None

    def allocate_block(self, size: int) -> tuple[int, bytes]:
        """Device memory for a new arena, before the transaction that records it."""
        return self._memory.allocate(size)

    def install(self, txn: lmdb.Transaction, arena_id: int, size: int, pointer: int, handle: bytes) -> ArenaRecord:
        """Record a block this process allocated as the node's arena, all of it free."""
        pid = os.getpid()
        record = ArenaRecord(
            arena_id=arena_id,
            size=size,
            pid=pid,
            start_time=process_start_time(pid),
            handle=handle.hex(),
        )
        txn.put(_ARENA_KEY, record.to_bytes(), db=self._config_db)
        self.reset(txn, size)
        return record

    def adopt(self, record: ArenaRecord, pointer: int) -> None:
        """This process owns ``record``'s block (called in the transaction that installs it)."""
        with self._lock:
            self._pointers[record.arena_id] = pointer
            self._owned.add(record.arena_id)

    def forget(self, arena_id: int) -> None:
        """Undo ``adopt`` when the installing transaction did not commit."""
        with self._lock:
            self._pointers.pop(arena_id, None)
            self._owned.discard(arena_id)

    def discard_block(self, pointer: int) -> None:
        """Free a block that lost the race to become the arena (or whose transaction failed)."""
        self._memory.free(pointer)

    def reset(self, txn: lmdb.Transaction, size: int) -> None:
        """Every byte of the arena free again (the store was cleared or the arena is new)."""
        txn.drop(self._extents_db, delete=False)
        txn.put(_U64.pack(0), _U64.pack(size), db=self._extents_db)

    def base(self, record: ArenaRecord) -> int:
        """The block's address in this process, mapping it on first use."""
        with self._lock:
            pointer = self._pointers.get(record.arena_id)
            if pointer is None:
                pointer = self._memory.open(bytes.fromhex(record.handle))
                self._unmap_stale(record.arena_id)
                self._pointers[record.arena_id] = pointer
            return pointer

    def _unmap_stale(self, live_id: int) -> None:
        for arena_id in [known for known in self._pointers if known != live_id and known not in self._owned]:
            self._memory.close(self._pointers.pop(arena_id))

    def close(self) -> None:
        """Unmap every mapped block and free the ones this process owns (its entries go too)."""
        with self._lock:
            for arena_id, pointer in self._pointers.items():
                if arena_id in self._owned:
                    self._memory.free(pointer)
                else:
                    self._memory.close(pointer)
            self._pointers.clear()
            self._owned.clear()

    # --- byte ranges --------------------------------------------------------------------------

    def take(self, txn: lmdb.Transaction, nbytes: int) -> int | None:
        """The offset of a free range for ``nbytes`` (first fit), now taken; None if none fits."""
        size = aligned(nbytes)
        for raw_offset, raw_length in txn.cursor(db=self._extents_db):
            length = _U64.unpack(bytes(raw_length))[0]
            if length >= size:
                offset = _U64.unpack(bytes(raw_offset))[0]
                txn.delete(bytes(raw_offset), db=self._extents_db)
                if length > size:
                    txn.put(_U64.pack(offset + size), _U64.pack(length - size), db=self._extents_db)
                return offset
        return None

    def give_back(self, txn: lmdb.Transaction, offset: int, nbytes: int) -> None:
        """Free the range an entry held, merged with free neighbours."""
        size = aligned(nbytes)
        following = txn.get(_U64.pack(offset + size), db=self._extents_db)
        if following is not None:
            txn.delete(_U64.pack(offset + size), db=self._extents_db)
            size += _U64.unpack(bytes(following))[0]
        preceding = _range_before(txn.cursor(db=self._extents_db), offset)
        if preceding is not None and preceding[0] + preceding[1] == offset:
            txn.delete(_U64.pack(preceding[0]), db=self._extents_db)
            offset, size = preceding[0], preceding[1] + size
        txn.put(_U64.pack(offset), _U64.pack(size), db=self._extents_db)

    def free_ranges(self, txn: lmdb.Transaction) -> list[tuple[int, int]]:
        """(offset, length) of every free range, in address order (metrics and tests)."""
        return [
            (_U64.unpack(bytes(offset))[0], _U64.unpack(bytes(length))[0])
            for offset, length in txn.cursor(db=self._extents_db)
        ]

    # --- bytes --------------------------------------------------------------------------------

    def write(self, record: ArenaRecord, offset: int, source: int, nbytes: int) -> None:
        """Copy ``nbytes`` from ``source`` (host or device pointer) into the arena at ``offset``."""
        self._memory.copy(self.base(record) + offset, source, nbytes)

    def to_host(self, view: DeviceView) -> np.ndarray:
        """An owned host copy of a view's bytes."""
        out = np.empty(view.shape, dtype=view.dtype)
        self._memory.copy(out.ctypes.data, view.pointer, out.nbytes)
        return out


def _range_before(cursor: lmdb.Cursor, offset: int) -> tuple[int, int] | None:
    """The free range with the largest offset below ``offset``, if any."""
    found = cursor.prev() if cursor.set_range(_U64.pack(offset)) else cursor.last()
    if not found:
        return None
    start = _U64.unpack(bytes(cursor.key()))[0]
    return (start, _U64.unpack(bytes(cursor.value()))[0]) if start < offset else None

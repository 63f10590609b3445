"""The store's LMDB environment: its tables, transactions, identity, counters and entry records.

Every part of the store (placement, leases, single-flight, entries) reads and writes LMDB
through one :class:`Tables`, inside the transactions it opens; the layout of each table is
in ``records.py``. Nothing here knows where an entry's bytes live.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import lmdb

from python_backends.errors import EpdError, ErrorCode
from python_backends.store.config import StoreConfig
from python_backends.store.records import (
    CLOCK,
    CONFIG_CAPACITY,
    CONFIG_SCHEMA,
    CONFIG_SECRET,
    CONFIG_STORE_ID,
    CUMULATIVE_COUNTERS,
    DATABASE_NAMES,
    GAUGE_COUNTERS,
    SCHEMA_VERSION,
    EntryRecord,
    decode_counter,
    encode_counter,
    encode_tick,
)
from python_backends.store.recreate import open_or_recreate

log = logging.getLogger(__name__)


class Tables:
    """One process's LMDB environment of the store and its named databases (``db``).

    Safe to share between threads; refuses use after ``fork`` (an LMDB environment must not
    cross it)."""

    def __init__(self, config: StoreConfig) -> None:
        self._path = config.path
        self._pid = os.getpid()
        self._env = open_environment(config)
        self.db = {name: self._env.open_db(name.encode()) for name in DATABASE_NAMES}

    def close(self) -> None:
        self._env.close()

    # --- transactions -------------------------------------------------------------------------

    @contextmanager
    def write(self) -> Iterator[lmdb.Transaction]:
        self._check_process()
        try:
            with self._env.begin(write=True) as txn:
                yield txn
        except lmdb.MapFullError:
            raise EpdError(
                f"embedding store file at {self._path} is full: long-open views keep freed pages in use; "
                "shorten views or raise map_size_bytes",
                ErrorCode.UNAVAILABLE,
            ) from None
        except lmdb.Error as exc:  # e.g. /dev/shm itself is full (a container's --shm-size)
            raise EpdError(f"embedding store at {self._path} failed: {exc}", ErrorCode.UNAVAILABLE) from None

    @contextmanager
    def read(self) -> Iterator[lmdb.Transaction]:
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

    def free_dead_readers(self) -> int:
        """Free the LMDB reader slots (open views) of dead processes: they would pin freed pages."""
        return self._env.reader_check()

    # --- identity and capacity ----------------------------------------------------------------

    def open_identity(self, capacity_bytes: int) -> tuple[str, bytes]:
        """The store id and HMAC secret, made by the first process to open the store; records
        ``capacity_bytes`` (the last process to open the store sets it for all). A store of another
        schema version, or one without an identity, is emptied and given a new identity (it is a
        cache): its old references then answer NOT_FOUND, never match new entries."""
        with self.write() as txn:
            config = self.db["config"]
            schema = txn.get(CONFIG_SCHEMA, db=config)
            has_identity = txn.get(CONFIG_STORE_ID, db=config) is not None and txn.get(CONFIG_SECRET, db=config)
            if schema is not None and bytes(schema) != SCHEMA_VERSION:
                self._recreate(txn, f"it has schema {bytes(schema)!r} and this code reads {SCHEMA_VERSION!r}")
            elif schema is not None and not has_identity:
                self._recreate(txn, "it has no identity (store id and secret)")
            elif schema is None:
                self._new_identity(txn)
            txn.put(CONFIG_CAPACITY, encode_counter(capacity_bytes), db=config)
            store_id, secret = txn.get(CONFIG_STORE_ID, db=config), txn.get(CONFIG_SECRET, db=config)
            if store_id is None or secret is None:  # just written above, in this transaction
                raise EpdError(f"embedding store at {self._path} lost its identity", ErrorCode.INTERNAL)
            return bytes(store_id).decode(), bytes(secret)

    def _new_identity(self, txn: lmdb.Transaction) -> None:
        config = self.db["config"]
        txn.put(CONFIG_SCHEMA, SCHEMA_VERSION, db=config)
        txn.put(CONFIG_STORE_ID, uuid.uuid4().hex.encode(), db=config)
        txn.put(CONFIG_SECRET, secrets.token_bytes(32), db=config)

    def _recreate(self, txn: lmdb.Transaction, reason: str) -> None:
        """Empty every table and make a new identity, in the caller's transaction (one writer)."""
        for db in self.db.values():
            txn.drop(db, delete=False)
        self._new_identity(txn)
        log.warning("embedding store at %s: %s; recreated it empty (it is a cache)", self._path, reason)

    def capacity(self, txn: lmdb.Transaction) -> int:
        return decode_counter(txn.get(CONFIG_CAPACITY, db=self.db["config"]))

    # --- counters -----------------------------------------------------------------------------

    def counter(self, txn: lmdb.Transaction, name: str) -> int:
        return decode_counter(txn.get(name.encode(), db=self.db["counters"]))

    def add(self, txn: lmdb.Transaction, name: str, delta: int) -> int:
        value = self.counter(txn, name) + delta
        txn.put(name.encode(), encode_counter(value), db=self.db["counters"])
        return value

    def metrics(self) -> dict[str, int]:
        with self.read() as txn:
            snapshot = {name: self.counter(txn, name) for name in CUMULATIVE_COUNTERS + GAUGE_COUNTERS}
            snapshot["capacity_bytes"] = self.capacity(txn)
        # High-water mark of the LMDB file: payload plus B-tree pages plus pages pinned by views.
        snapshot["map_used_bytes"] = (self._env.info()["last_pgno"] + 1) * self._env.stat()["psize"]
        snapshot["map_size_bytes"] = self._env.info()["map_size"]
        return snapshot

    # --- entry records and their LRU order ----------------------------------------------------

    def entry(self, txn: lmdb.Transaction, key: str) -> EntryRecord | None:
        raw = txn.get(key.encode(), db=self.db["entries"])
        return None if raw is None else EntryRecord.from_bytes(raw)

    def has_entry(self, txn: lmdb.Transaction, key: str) -> bool:
        return txn.get(key.encode(), db=self.db["entries"]) is not None

    def put_entry(self, txn: lmdb.Transaction, key: str, entry: EntryRecord) -> None:
        txn.put(key.encode(), entry.to_bytes(), db=self.db["entries"])

    def insert_entry(self, txn: lmdb.Transaction, key: str, entry: EntryRecord) -> None:
        """A new entry, most recently used, counted in the gauges."""
        self.put_entry(txn, key, entry)
        txn.put(encode_tick(entry.tick), key.encode(), db=self.db["lru"])
        self.add(txn, "bytes_used", entry.nbytes)
        self.add(txn, "entries", 1)

    def drop_entry(self, txn: lmdb.Transaction, key: str, entry: EntryRecord) -> None:
        """Forget an entry's record (its bytes are the placement's to free)."""
        txn.delete(key.encode(), db=self.db["entries"])
        txn.delete(encode_tick(entry.tick), db=self.db["lru"])
        self.add(txn, "bytes_used", -entry.nbytes)
        self.add(txn, "entries", -1)

    def touch(self, txn: lmdb.Transaction, key: str, entry: EntryRecord) -> EntryRecord:
        """Move ``entry`` to the most recently used end."""
        txn.delete(encode_tick(entry.tick), db=self.db["lru"])
        touched = dataclasses.replace(entry, tick=self.add(txn, CLOCK, 1))
        txn.put(encode_tick(touched.tick), key.encode(), db=self.db["lru"])
        self.put_entry(txn, key, touched)
        return touched

    def least_recently_used(self, txn: lmdb.Transaction) -> Iterator[tuple[str, EntryRecord]]:
        """Every entry, least recently used first."""
        for _tick, raw_key in txn.cursor(db=self.db["lru"]):
            key = bytes(raw_key).decode()
            entry = self.entry(txn, key)
            if entry is not None:
                yield key, entry

    def entries(self, txn: lmdb.Transaction) -> list[tuple[str, EntryRecord]]:
        return [(bytes(key).decode(), EntryRecord.from_bytes(raw)) for key, raw in txn.cursor(db=self.db["entries"])]

    def clear(self, txn: lmdb.Transaction) -> None:
        """Drop every entry record, lease, claim and failure and zero the gauges."""
        for name in ("entries", "lru", "leases", "pending", "failures"):
            txn.drop(self.db[name], delete=False)
        for gauge in GAUGE_COUNTERS:
            txn.put(gauge.encode(), encode_counter(0), db=self.db["counters"])


# Only the store's owner may read it: embeddings of every tenant and the reference secret live here.
STORE_DIR_MODE = 0o700
STORE_FILE_MODE = 0o600


def _owner_only(path: str, mode: int) -> None:
    """Tighten ``path`` to ``mode`` when this user owns it (another user's store is left alone:
    opening it then fails on its own permissions)."""
    info = os.stat(path)
    if info.st_uid == os.geteuid() and info.st_mode & 0o777 != mode:
        os.chmod(path, mode)


def open_environment(config: StoreConfig) -> lmdb.Environment:
    """The store's LMDB environment; unreadable files are set aside and recreated (``recreate.py``)."""
    os.makedirs(config.path, mode=STORE_DIR_MODE, exist_ok=True)
    _owner_only(config.path, STORE_DIR_MODE)
    for name in ("data.mdb", "lock.mdb"):  # made by an older version with LMDB's default 0644
        if os.path.exists(os.path.join(config.path, name)):
            _owner_only(os.path.join(config.path, name), STORE_FILE_MODE)
    try:
        return open_or_recreate(config.path, lambda: _open_lmdb(config))
    except lmdb.Error as exc:
        if "already open" in str(exc):
            raise EpdError(
                f"embedding store at {config.path} is already open in this process; share that EmbeddingStore",
                ErrorCode.INTERNAL,
            ) from None
        raise EpdError(f"cannot open the embedding store at {config.path}: {exc}", ErrorCode.UNAVAILABLE) from None


def _open_lmdb(config: StoreConfig) -> lmdb.Environment:
    return lmdb.open(
        config.path,
        mode=STORE_FILE_MODE,
        map_size=config.effective_map_size(),
        max_dbs=len(DATABASE_NAMES),
        max_readers=config.max_readers,
        # A cache in shared memory: a process crash loses nothing (the pages live in the
        # kernel), a machine crash loses /dev/shm anyway, so no fsync.
        sync=False,
        metasync=False,
        readahead=False,
    )

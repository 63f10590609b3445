"""Leases: what keeps one generation of an entry from eviction while a request uses it.

A lease is a row of the ``leases`` table (:class:`LeaseRecord`: entry, generation, owner
pid and start time) and a count on the entry. Its owner releases it when the request ends;
reaping releases the leases of processes that died (or, with ``max_lease_age_s``, that a
live process forgot). Every function here runs inside the caller's write transaction.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import time
from dataclasses import dataclass

import lmdb

from python_backends.errors import EpdError, ErrorCode, invalid_arg
from python_backends.store.processes import process_is_alive, process_start_time
from python_backends.store.records import EntryRecord, LeaseRecord, PendingRecord
from python_backends.store.reference import Reference
from python_backends.store.tables import Tables

_LEASE_ID = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class ReapReport:
    leases: int  # leases of dead processes (or older than max_lease_age_s) released
    claims: int  # single-flight claims of dead processes dropped
    readers: int = 0  # LMDB reader slots (open views) of dead processes freed


class Leases:
    """The ``leases`` table and the lease counts of entries."""

    def __init__(self, tables: Tables, max_lease_age_s: float | None) -> None:
        self._tables = tables
        self._max_age_s = max_lease_age_s
        self._db = tables.db["leases"]

    def take(self, txn: lmdb.Transaction, key: str, entry: EntryRecord, owner_pid: int | None) -> str:
        """A new lease on ``entry`` for ``owner_pid`` (default: this process); its id."""
        pid = os.getpid() if owner_pid is None else owner_pid
        lease_id = secrets.token_hex(16)
        record = LeaseRecord(
            key=key, generation=entry.generation, pid=pid, start_time=process_start_time(pid), created=time.time()
        )
        txn.put(lease_id.encode(), record.to_bytes(), db=self._db)
        self._tables.put_entry(txn, key, dataclasses.replace(entry, leases=entry.leases + 1))
        self._tables.add(txn, "active_leases", 1)
        return lease_id

    def release(self, txn: lmdb.Transaction, lease_id: str) -> bool:
        """False when the lease was not held (already released, reaped or cleared)."""
        raw = txn.get(lease_id.encode(), db=self._db)
        if raw is None:
            return False
        record = LeaseRecord.from_bytes(raw)
        txn.delete(lease_id.encode(), db=self._db)
        entry = self._tables.entry(txn, record.key)
        if entry is not None and entry.generation == record.generation:
            self._tables.put_entry(txn, record.key, dataclasses.replace(entry, leases=max(0, entry.leases - 1)))
        self._tables.add(txn, "active_leases", -1)
        return True

    def check_held(self, txn: lmdb.Transaction, ref: Reference) -> None:
        """NOT_FOUND unless the lease ``ref`` carries still holds its entry's generation."""
        raw = txn.get(ref.lease_id.encode(), db=self._db)
        record = None if raw is None else LeaseRecord.from_bytes(raw)
        if record is None or record.key != ref.key or record.generation != ref.generation:
            raise EpdError(
                f"lease {ref.lease_id} of embedding {ref.key[:16]} is no longer held (released or reaped); "
                "look the embedding up again",
                ErrorCode.NOT_FOUND,
            )

    def reap(self, txn: lmdb.Transaction) -> int:
        """Release the leases of dead owners (and those older than ``max_lease_age_s``)."""
        dead = [
            bytes(lease_id).decode()
            for lease_id, raw in txn.cursor(db=self._db)
            if self._is_dead(LeaseRecord.from_bytes(raw))
        ]
        for lease_id in dead:
            self.release(txn, lease_id)
        self._tables.add(txn, "leases_reaped", len(dead))
        return len(dead)

    def _is_dead(self, record: LeaseRecord) -> bool:
        too_old = self._max_age_s is not None and time.time() - record.created > self._max_age_s
        return too_old or not owner_alive(record)


def check_lease_id(lease_id: object) -> None:
    if not isinstance(lease_id, str) or _LEASE_ID.fullmatch(lease_id) is None:
        raise invalid_arg("a lease id is 32 lowercase hex characters")


def owner_alive(record: LeaseRecord | PendingRecord) -> bool:
    return process_is_alive(record.pid, record.start_time)

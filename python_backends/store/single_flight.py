"""Single-flight: one producer per missing key, however many processes ask for it at once.

A ``pending`` row (:class:`PendingRecord`: a token, the producer's pid and start time)
marks a key someone is producing. ``claim`` makes the mark or joins it; the producer
``fulfil``s (the store writes the entry and clears the mark) or ``abandon``s (the mark goes
and the error stays under the token in ``failures`` for its waiters); waiters poll until
the entry is there, the error is, or the mark vanished. A mark whose owner died, or older
than ``producer_timeout_s``, is taken over.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import lmdb
import numpy as np

from python_backends.errors import EpdError, ErrorCode, invalid_arg
from python_backends.store.config import StoreConfig
from python_backends.store.leases import owner_alive
from python_backends.store.payload import EntryMeta
from python_backends.store.processes import process_start_time
from python_backends.store.records import FailureRecord, PendingRecord
from python_backends.store.reference import Reference
from python_backends.store.tables import Tables

Producer = Callable[[], "tuple[np.ndarray, EntryMeta]"]


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

    def hit_reference(self) -> Reference:
        if self.reference is None:
            raise EpdError(f"HIT claim for {self.key[:16]} carries no reference", ErrorCode.INTERNAL)
        return self.reference

    def check_producing(self) -> None:
        if self.kind is not ClaimKind.PRODUCE:
            raise invalid_arg(f"only a PRODUCE claim can be fulfilled or abandoned, got {self.kind.value}")


class SingleFlight:
    """The ``pending`` and ``failures`` tables."""

    def __init__(self, tables: Tables, config: StoreConfig) -> None:
        self._tables = tables
        self._config = config
        self._pending_db = tables.db["pending"]
        self._failures_db = tables.db["failures"]

    def join_or_produce(self, txn: lmdb.Transaction, key: str) -> Claim:
        """For a key with no entry: JOIN a live production, or mark a new one (PRODUCE)."""
        pending = self._pending(txn, key)
        if pending is not None and self._is_live(pending):
            self._tables.add(txn, "joins", 1)
            return Claim(key, ClaimKind.JOIN, token=pending.token)
        if pending is not None:
            self._tables.add(txn, "claims_reaped", 1)
        self._tables.add(txn, "misses", 1)
        token = secrets.token_hex(16)
        pid = os.getpid()
        record = PendingRecord(token=token, pid=pid, start_time=process_start_time(pid), started=time.time())
        txn.put(key.encode(), record.to_bytes(), db=self._pending_db)
        return Claim(key, ClaimKind.PRODUCE, token=token)

    def finish(self, txn: lmdb.Transaction, claim: Claim) -> None:
        """Clear the mark of ``claim`` (if it is still this production's)."""
        pending = self._pending(txn, claim.key)
        if pending is not None and pending.token == claim.token:
            txn.delete(claim.key.encode(), db=self._pending_db)

    def fail(self, txn: lmdb.Transaction, claim: Claim, error: BaseException | str) -> None:
        """Clear the mark and leave the producer's error under the token for its waiters."""
        code, message = failure_of(error)
        self.finish(txn, claim)
        self._drop_old_failures(txn)
        failure = FailureRecord(code=code.value, message=message, failed=time.time())
        txn.put(claim.token.encode(), failure.to_bytes(), db=self._failures_db)
        self._tables.add(txn, "producer_failures", 1)

    def wait(self, claim: Claim, timeout_s: float | None, serve: Callable[[], Reference | None]) -> Reference | None:
        """Poll until the production of a JOIN ``claim`` ends: ``serve()`` once it stored the
        entry, None when it vanished; raises its error, or UNAVAILABLE after ``timeout_s``."""
        if claim.kind is not ClaimKind.JOIN:
            raise invalid_arg(f"wait_for needs a JOIN claim, got {claim.kind.value}")
        deadline = time.monotonic() + (timeout_s or self._config.wait_timeout_s)
        pause = 0.001
        while True:
            state = self._state(claim)
            if state == "stored":
                return serve()  # None when evicted between the two transactions: claim again
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

    def reap(self, txn: lmdb.Transaction) -> int:
        """Drop the marks of dead producers."""
        dead = [
            bytes(key) for key, raw in txn.cursor(db=self._pending_db) if not owner_alive(PendingRecord.from_bytes(raw))
        ]
        for key in dead:
            txn.delete(key, db=self._pending_db)
        self._tables.add(txn, "claims_reaped", len(dead))
        return len(dead)

    def _state(self, claim: Claim) -> str:
        """'stored', 'running' or 'gone'; raises the producer's error if it failed."""
        with self._tables.read() as txn:
            if self._tables.has_entry(txn, claim.key):
                return "stored"
            raw_failure = txn.get(claim.token.encode(), db=self._failures_db)
            if raw_failure is not None:
                failure = FailureRecord.from_bytes(raw_failure)
                raise EpdError(failure.message, ErrorCode(failure.code))
            pending = self._pending(txn, claim.key)
        if pending is None or pending.token != claim.token or not self._is_live(pending):
            return "gone"
        return "running"

    def _is_live(self, pending: PendingRecord) -> bool:
        fresh = time.time() - pending.started < self._config.producer_timeout_s
        return fresh and owner_alive(pending)

    def _drop_old_failures(self, txn: lmdb.Transaction) -> None:
        # A failure is read by waiters that joined before it; none waits longer than this.
        oldest_useful = time.time() - 2 * self._config.wait_timeout_s
        expired = [
            bytes(token)
            for token, raw in txn.cursor(db=self._failures_db)
            if FailureRecord.from_bytes(raw).failed < oldest_useful
        ]
        for token in expired:
            txn.delete(token, db=self._failures_db)

    def _pending(self, txn: lmdb.Transaction, key: str) -> PendingRecord | None:
        raw = txn.get(key.encode(), db=self._pending_db)
        return None if raw is None else PendingRecord.from_bytes(raw)


def failure_of(error: BaseException | str) -> tuple[ErrorCode, str]:
    """What waiters are told when the producer failed: its message if it was ours, else the kind."""
    if isinstance(error, EpdError):
        return error.code, error.message
    if isinstance(error, str):
        return ErrorCode.INTERNAL, error[:500]
    detail = str(error)[:300]
    message = f"producing the embedding failed: {type(error).__name__}"
    return ErrorCode.INTERNAL, f"{message}: {detail}" if detail else message

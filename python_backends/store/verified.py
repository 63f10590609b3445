"""Parse and verify a reference once per process.

One request's reference reaches a process several times (the BLS, prefill, decode, a retry
of each), always as the same bytes. What parsing (JSON, types, ranges, layout) and
verifying (store id, HMAC tag) find depends on those bytes and this store's identity only,
never on the store's state, so the answer is kept: a bounded LRU of verified references,
keyed by the exact bytes (and by the verified :class:`Reference` itself, for callers that
pass the object on). Bytes that fail are not kept: they fail again, in full, each time.
What does depend on the state (is the entry there, is it that generation, is the lease
held, are its bytes alive) is checked by the store on every read, never here.
"""

from __future__ import annotations

import threading

from cachetools import LRUCache

from python_backends.errors import EpdError, ErrorCode
from python_backends.store.reference import Reference, check_reference, parse_reference, verify_tag

CACHED_REFERENCES = 4096  # a few MB at most: a reference is at most 1 KiB


class VerifiedReferences:
    """The references this process has verified for one store. Thread-safe."""

    def __init__(self, store_id: str, secret: bytes, merge_size: int | None, maxsize: int = CACHED_REFERENCES) -> None:
        self._store_id = store_id
        self._secret = secret
        self._merge_size = merge_size
        self._verified: LRUCache[bytes | Reference, Reference] = LRUCache(maxsize=maxsize)
        self._lock = threading.Lock()

    def parse(self, raw: bytes) -> Reference:
        """The verified reference of ``raw``; INVALID_ARG if malformed or tampered with,
        NOT_FOUND if issued by another store."""
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            return parse_reference(raw, merge_size=self._merge_size)  # raises its INVALID_ARG
        key = bytes(raw)
        found = self._cached(key)
        if found is None:
            found = self._verify(parse_reference(key, merge_size=self._merge_size))
            self._keep(key, found)
            self._keep(found, found)  # callers pass the object on to open_view, resolve, ...
        return found

    def check(self, reference: Reference) -> Reference:
        """``reference`` itself once it is verified (an object that equals a verified one is verified)."""
        if self._cached(reference) is None:
            check_reference(reference, merge_size=self._merge_size)
            self._keep(reference, self._verify(reference))
        return reference

    def __len__(self) -> int:
        with self._lock:
            return len(self._verified)

    def _cached(self, key: bytes | Reference) -> Reference | None:
        with self._lock:
            return self._verified.get(key)

    def _keep(self, key: bytes | Reference, reference: Reference) -> None:
        with self._lock:
            self._verified[key] = reference

    def _verify(self, ref: Reference) -> Reference:
        if ref.store_id != self._store_id:
            raise EpdError(
                f"embedding reference belongs to store {ref.store_id} at {ref.location}, not to this node's store "
                f"{self._store_id}; send the media again",
                ErrorCode.NOT_FOUND,
            )
        verify_tag(ref, self._secret)
        return ref

"""The settings of one embedding store.

Its defaults (path, capacity) are the contract's (``contract/parameters.py``): the repository
builder's cache policy, the model parameters and the store read the same two constants.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from python_backends.contract.parameters import DEFAULT_CAPACITY_BYTES, DEFAULT_STORE_PATH
from python_backends.errors import invalid_arg
from python_backends.store.device_memory import cuda_device_index
from python_backends.store.reference import check_location

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
    capacity_bytes: int = DEFAULT_CAPACITY_BYTES
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

"""The GPU store's logic on CPU: placement of entries in one shared block, views that hold a
lease, LRU under fragmentation, and an arena that dies with its owner. The device is
``ShmDeviceMemory`` (shared memory mapped by name, like a CUDA IPC handle); the CUDA path
itself runs in tests/gpu/test_cuda_store.py."""

import multiprocessing
import os
import threading
from collections.abc import Iterator
from multiprocessing import shared_memory

import lmdb
import numpy as np
import pytest

from python_backends.errors import ErrorCode
from python_backends.store import EmbeddingStore, StoreConfig, content_key
from python_backends.store.arena import ALIGNMENT, Arena, aligned
from python_backends.store.device_memory import (
    DeviceArray,
    DeviceView,
    cuda_device_index,
)
from tests.store_helpers import error_of, store_directory
from tests.unit.shm_device_memory import HostArrayAsDevice, ShmDeviceMemory

HIDDEN = 64
SPAWN = multiprocessing.get_context("spawn")


def key_of(name: str) -> str:
    return content_key(name.encode(), {"size": 336}, "encoder-v1")


def embedding(seed: int, rows: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, HIDDEN)).astype(np.float16)


def entry_bytes(rows: int = 16) -> int:
    return rows * HIDDEN * 2


@pytest.fixture
def config() -> Iterator[StoreConfig]:
    with store_directory("epd-arena-test-") as path:
        yield StoreConfig(path=path, capacity_bytes=4 * entry_bytes(), device="cuda:0", wait_timeout_s=20.0)


@pytest.fixture
def memory() -> ShmDeviceMemory:
    return ShmDeviceMemory()


@pytest.fixture
def store(config: StoreConfig, memory: ShmDeviceMemory) -> Iterator[EmbeddingStore]:
    with EmbeddingStore(config, device_memory=memory) as opened:
        yield opened


def free_ranges(store: EmbeddingStore) -> list[tuple[int, int]]:
    return store._placement.free_ranges()


def test_device_names_are_checked():
    assert cuda_device_index("cpu") is None
    assert cuda_device_index("cuda") == 0
    assert cuda_device_index("cuda:3") == 3
    for bad in ("gpu", "cuda:x", "cuda:", "CUDA:0"):
        assert error_of(lambda bad=bad: cuda_device_index(bad)).code is ErrorCode.INVALID_ARG
    assert StoreConfig(device="cuda:1").effective_location().endswith("/gpu1")
    assert StoreConfig(device="cuda:1").effective_location().startswith("cuda://")


def test_put_and_view_share_one_block_without_copies(store, memory):
    first = store.put(key_of("a"), embedding(1))
    second = store.put(key_of("b"), HostArrayAsDevice(embedding(2)))  # the device-array path
    assert memory.allocations == 1  # one block for the node, made at the first write
    with store.open_view(first) as view_a, store.open_view(second) as view_b:
        assert isinstance(view_a, DeviceView)
        interface = view_a.__cuda_array_interface__
        assert interface["shape"] == (16, HIDDEN) and interface["typestr"] == "<f2"
        assert view_b.pointer - view_a.pointer == aligned(entry_bytes())
        assert view_a.pointer % ALIGNMENT == 0 and view_b.pointer % ALIGNMENT == 0
    np.testing.assert_array_equal(store.resolve(first), embedding(1))
    np.testing.assert_array_equal(store.resolve(second), embedding(2))
    assert first.location.startswith("cuda://")


def test_device_arrays_are_checked(store):
    strided = HostArrayAsDevice(np.asfortranarray(embedding(3)))
    assert "C-contiguous" in error_of(lambda: store.put(key_of("f"), strided)).message
    wrong = HostArrayAsDevice(embedding(3).astype(np.float64))
    assert error_of(lambda: store.put(key_of("g"), wrong)).code is ErrorCode.INVALID_ARG
    assert "numpy array or a CUDA array" in error_of(lambda: DeviceArray.of([1, 2])).message


def test_a_host_store_refuses_device_arrays(tmp_path):
    with EmbeddingStore(StoreConfig(path=str(tmp_path), capacity_bytes=1 << 20)) as host:
        error = error_of(lambda: host.put(key_of("a"), HostArrayAsDevice(embedding(1))))
        assert error.code is ErrorCode.INVALID_ARG and "numpy" in error.message


def test_a_view_holds_a_lease_and_needs_a_held_one(store):
    unleased = store.put(key_of("a"), embedding(1), lease=False)
    with store.open_view(unleased):
        assert store.metrics()["active_leases"] == 1  # taken for the view
    assert store.metrics()["active_leases"] == 0
    leased = store.lookup(key_of("a"))
    store.release(leased)
    error = error_of(lambda: store.open_view(leased).__enter__())
    assert error.code is ErrorCode.NOT_FOUND and "no longer held" in error.message


def test_evicted_ranges_are_reused_and_merged(store, config):
    refs = [store.put(key_of(f"e{i}"), embedding(i), lease=False) for i in range(4)]
    assert free_ranges(store) == []  # exactly full
    store.put(key_of("e4"), embedding(4), lease=False)  # evicts e0, takes its range
    assert not store.contains(refs[0].key)
    with store.open_view(store.lookup(key_of("e4"), lease=False)) as view:
        with store.open_view(refs[1]) as neighbour:
            assert neighbour.pointer - view.pointer == aligned(entry_bytes())
    store.clear()
    assert free_ranges(store) == [(0, config.capacity_bytes)]


def test_fragmented_arena_evicts_more_but_never_a_leased_entry(store, config):
    held = store.put(key_of("held"), embedding(0, rows=8))  # leased
    for i in range(7):
        store.put(key_of(f"s{i}"), embedding(i + 1, rows=8), lease=False)
    # Bytes would fit after evicting one small entry, but a 32-row entry needs a range of 4.
    big = store.put(key_of("big"), embedding(99, rows=32), lease=False)
    np.testing.assert_array_equal(store.resolve(big), embedding(99, rows=32))
    np.testing.assert_array_equal(store.resolve(held), embedding(0, rows=8))
    metrics = store.metrics()
    assert metrics["evictions"] >= 4  # a 4-range hole next to the leased entry, or past it
    # Entry sizes are multiples of the alignment: free + used ranges cover the block exactly.
    free = sum(length for _offset, length in free_ranges(store))
    assert free == config.capacity_bytes - metrics["bytes_used"]


def test_full_of_leased_entries_is_unavailable(store):
    for i in range(4):
        store.put(key_of(f"l{i}"), embedding(i))
    error = error_of(lambda: store.put(key_of("more"), embedding(9)))
    assert error.code is ErrorCode.UNAVAILABLE and "full" in error.message


def test_threads_racing_to_make_the_arena_leave_one_block(config, memory):
    with EmbeddingStore(config, device_memory=memory) as store:
        barrier = threading.Barrier(4)

        def put(i: int) -> None:
            barrier.wait()
            store.put(key_of(f"t{i}"), embedding(i), lease=False)

        threads = [threading.Thread(target=put, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert memory.allocations - memory.frees == 1
        assert store.metrics()["entries"] == 4


def _write_and_crash(config: StoreConfig, queue) -> None:
    memory = ShmDeviceMemory()
    store = EmbeddingStore(config, device_memory=memory)
    reference = store.put(key_of("crash"), embedding(5), lease=False)
    queue.put((reference.to_bytes(), memory.names))
    queue.close()
    queue.join_thread()
    os._exit(0)  # no close(): the owner vanishes as a crashed model instance would


def _read_in_child(config: StoreConfig, reference: bytes, queue) -> None:
    with EmbeddingStore(config, device_memory=ShmDeviceMemory()) as store, store.open_view(reference) as view:
        host = np.empty(view.shape, dtype=view.dtype)
        ctypes_copy(host, view)
        queue.put(host.tobytes())


def ctypes_copy(host: np.ndarray, view: DeviceView) -> None:
    import ctypes

    ctypes.memmove(host.ctypes.data, view.pointer, host.nbytes)


def test_another_process_reads_the_block_it_maps(store, config):
    reference = store.put(key_of("shared"), embedding(7))
    queue = SPAWN.Queue()
    child = SPAWN.Process(target=_read_in_child, args=(config, reference.to_bytes(), queue))
    child.start()
    data = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    np.testing.assert_array_equal(np.frombuffer(data, dtype=np.float16).reshape(16, HIDDEN), embedding(7))


def test_entries_die_with_the_arena_owner_and_the_next_writer_starts_anew(config, memory):
    queue = SPAWN.Queue()
    child = SPAWN.Process(target=_write_and_crash, args=(config, queue))
    child.start()
    orphan, orphan_blocks = queue.get(timeout=60)
    child.join(timeout=60)
    with EmbeddingStore(config, device_memory=memory) as store:
        error = error_of(lambda: store.resolve(orphan))
        assert error.code is ErrorCode.NOT_FOUND and "send the media again" in error.message
        fresh = store.put(key_of("after"), embedding(8), lease=False)
        np.testing.assert_array_equal(store.resolve(fresh), embedding(8))
        metrics = store.metrics()
        assert metrics["entries_lost"] == 1 and metrics["entries"] == 1
        assert memory.allocations == 1  # this process made the new block
    for name in orphan_blocks:  # CUDA frees a dead owner's block; shared memory must be unlinked
        shared_memory.SharedMemory(name=name).unlink()


def test_freed_ranges_merge_with_both_neighbours(tmp_path):
    env = lmdb.open(str(tmp_path), max_dbs=2)
    arena = Arena(ShmDeviceMemory(), env.open_db(b"config"), env.open_db(b"extents"))
    with env.begin(write=True) as txn:
        arena.reset(txn, 4 * ALIGNMENT * 4)
        a, b, c = (arena.take(txn, 3 * ALIGNMENT + 1) for _ in range(3))  # rounded up to 4 units
        assert (a, b, c) == (0, 4 * ALIGNMENT, 8 * ALIGNMENT)
        assert arena.take(txn, 5 * ALIGNMENT) is None  # 4 units left
        arena.give_back(txn, b, 3 * ALIGNMENT + 1)
        arena.give_back(txn, a, 3 * ALIGNMENT + 1)  # merges with the range after it
        assert arena.free_ranges(txn) == [(0, 8 * ALIGNMENT), (12 * ALIGNMENT, 4 * ALIGNMENT)]
        arena.give_back(txn, c, 3 * ALIGNMENT + 1)  # merges with both sides
        assert arena.free_ranges(txn) == [(0, 16 * ALIGNMENT)]
    env.close()

"""The GPU embedding store on a real GPU: device memory shared by CUDA IPC between processes.

Each test spawns real processes that open the same store with ``device="cuda:0"``; bytes
are written from torch CUDA tensors and read through ``torch.as_tensor(view)``. Skipped
where torch sees no GPU (CI); run on a GPU machine with ``pytest tests/gpu -v``.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator

import pytest

from python_backends.errors import ErrorCode
from python_backends.store import EmbeddingStore, EntryMeta, StoreConfig, content_key
from python_backends.store.reference import MAX_REFERENCE_BYTES
from tests.store_helpers import error_of, store_directory


def _gpu_missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    try:
        import cuda.bindings.runtime  # noqa: F401
    except ImportError:
        return "cuda-python (cuda.bindings) is not installed"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_missing() is not None, reason=str(_gpu_missing()))]

SPAWN = multiprocessing.get_context("spawn")
ROWS, HIDDEN = 256, 1536  # one 448x448 image of a Qwen2-VL-2B-sized model, fp16: 768 KiB


def key_of(name: str) -> str:
    return content_key(name.encode(), {"size": 448}, "encoder-gpu-test")


def device_embedding(seed: int, rows: int = ROWS):
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn((rows, HIDDEN), generator=generator, device="cuda", dtype=torch.float16)


@pytest.fixture
def config() -> Iterator[StoreConfig]:
    with store_directory("epd-cuda-store-") as path:
        entry = ROWS * HIDDEN * 2
        yield StoreConfig(path=path, capacity_bytes=4 * entry, device="cuda:0", wait_timeout_s=60.0, merge_size=2)


def run_children(target, args_list: list[tuple]) -> list:
    queue = SPAWN.Queue()
    children = [SPAWN.Process(target=target, args=(*args, queue)) for args in args_list]
    for child in children:
        child.start()
    results = [queue.get(timeout=120) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    return results


# --- child processes -------------------------------------------------------------------------


def _read_and_scribble(config: StoreConfig, reference: bytes, queue) -> None:
    import torch

    with EmbeddingStore(config) as store, store.open_view(reference) as view:
        tensor = torch.as_tensor(view, device="cuda")
        same_memory = tensor.data_ptr() == view.pointer
        checksum = float(tensor.float().sum())
        tensor[0, 0] = 1234.0  # only to prove the bytes are shared; readers must not write
        torch.cuda.synchronize()
        queue.put((os.getpid(), same_memory, checksum))


def _get_or_create(config: StoreConfig, seed: int, queue) -> None:
    import torch

    with EmbeddingStore(config) as store:
        reference = store.get_or_create(key_of("single"), lambda: (device_embedding(seed), EntryMeta()))
        with store.open_view(reference) as view:
            checksum = float(torch.as_tensor(view, device="cuda").float().sum())
        store.release(reference)
        queue.put(checksum)
        # The first process allocated the arena: keep every process alive until all have read.
        torch.cuda.synchronize()


def _own_and_exit(config: StoreConfig, queue) -> None:
    store = EmbeddingStore(config)
    reference = store.put(key_of("orphan"), device_embedding(3), lease=False)
    queue.put(reference.to_bytes())
    queue.close()
    queue.join_thread()
    os._exit(0)  # no close(): CUDA frees the block with the process, as when an instance crashes


# --- tests -----------------------------------------------------------------------------------


def test_another_process_maps_the_same_device_bytes(config):
    import torch

    with EmbeddingStore(config) as store:
        source = device_embedding(1)
        reference = store.put(key_of("a"), source)
        [(pid, same_memory, checksum)] = run_children(_read_and_scribble, [(config, reference.to_bytes())])
        assert pid != os.getpid() and same_memory
        assert checksum == pytest.approx(float(source.float().sum()), rel=1e-3)
        stored = torch.from_numpy(store.resolve(reference)).cuda()
        assert float(stored[0, 0]) == 1234.0  # the child's write landed in this process's block
        assert torch.equal(stored[1:], source[1:])
        assert len(reference.to_bytes()) <= MAX_REFERENCE_BYTES
        assert reference.location.startswith("cuda://")


def test_processes_asking_for_one_new_key_produce_it_once(config):
    with EmbeddingStore(config) as store:
        store.put(key_of("warm"), device_embedding(0), lease=False)  # this process owns the arena
        checksums = run_children(_get_or_create, [(config, seed) for seed in range(4)])
        assert store.metrics()["encodes"] == 1
        assert len(set(checksums)) == 1  # all read the one producer's bytes


def test_a_leased_entry_keeps_its_bytes_while_eviction_reuses_ranges(config):
    import torch

    with EmbeddingStore(config) as store:
        held = store.put(key_of("held"), device_embedding(10))
        for i in range(20):
            store.put(key_of(f"churn{i}"), device_embedding(100 + i), lease=False)
        metrics = store.metrics()
        assert metrics["evictions"] >= 17 and metrics["bytes_used"] <= config.capacity_bytes
        with store.open_view(held) as view:
            assert torch.equal(torch.as_tensor(view, device="cuda"), device_embedding(10))
        latest = store.lookup(key_of("churn19"))
        assert torch.equal(torch.from_numpy(store.resolve(latest)).cuda(), device_embedding(119))


def test_bad_and_lost_references_are_clean_errors(config):
    with EmbeddingStore(config) as store:
        [orphan] = run_children(_own_and_exit, [(config,)])
        lost = error_of(lambda: store.resolve(orphan))
        assert lost.code is ErrorCode.NOT_FOUND and "send the media again" in lost.message
        fresh = store.put(key_of("fresh"), device_embedding(4))
        assert store.metrics()["entries_lost"] == 1
        tampered = fresh.to_bytes().replace(b'"n":256', b'"n":255')
        assert error_of(lambda: store.resolve(tampered)).code is ErrorCode.INVALID_ARG
        store.release(fresh)
        assert error_of(lambda: store.open_view(fresh).__enter__()).code is ErrorCode.NOT_FOUND


def test_a_reference_stays_small_for_a_huge_embedding(tmp_path):
    config = StoreConfig(path=str(tmp_path), capacity_bytes=256 << 20, device="cuda:0")
    with EmbeddingStore(config) as store:
        import torch

        generator = torch.Generator(device="cuda").manual_seed(16384)
        big = torch.randn((16384, 3584), generator=generator, device="cuda", dtype=torch.float16)  # 112 MiB
        reference = store.put(key_of("big"), big, EntryMeta(grid_thw=(1, 256, 256)))
        assert len(reference.to_bytes()) <= MAX_REFERENCE_BYTES
        with store.open_view(reference) as view:
            assert torch.equal(torch.as_tensor(view, device="cuda"), big)  # every value, not only the size


def test_prefill_reads_a_device_entry_into_an_owned_cuda_tensor(config):
    import torch

    from python_backends.pd.stage import resolve_images

    with EmbeddingStore(config) as store:
        source = device_embedding(6)
        reference = store.put(key_of("prefill"), source, EntryMeta(grid_thw=(1, 32, 32)), lease=False)
        [image], [ref] = resolve_images(store, [reference.to_bytes()])
        assert image.embeds.is_cuda and image.embeds.dtype == torch.float32
        assert torch.equal(image.embeds, source.float()) and image.grid_thw == (1, 32, 32)
        store.clear()  # the range is free for reuse: the engine's tensor must not change
        store.put(key_of("other"), device_embedding(7), lease=False)
        assert torch.equal(image.embeds, source.float()) and ref.key == reference.key

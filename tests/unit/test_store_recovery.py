"""Embedding store after crashes: a writer SIGKILLed mid-write leaves no torn entry and its leases
are reaped; a store of an older format, a corrupted or truncated file, or a store without an
identity is recreated empty with a warning, never read as garbage."""

import contextlib
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import lmdb
import numpy as np
import pytest

from python_backends.errors import ErrorCode
from python_backends.store import EmbeddingStore, StoreConfig, content_key
from python_backends.store.records import CONFIG_SCHEMA, CONFIG_STORE_ID
from python_backends.store.recreate import recreation_lock_path
from tests.store_helpers import error_of, store_directory

HIDDEN = 64
SPAWN = multiprocessing.get_context("spawn")


def key_of(i: int) -> str:
    return content_key(f"image {i}".encode(), {"size": 336}, "encoder-v1")


def embedding(i: int) -> np.ndarray:
    # Rows vary so that entries span one page or several (LMDB overflow pages).
    rows = 8 + (i * 37) % 300
    return np.random.default_rng(i).standard_normal((rows, HIDDEN)).astype(np.float32)


@pytest.fixture
def config() -> Iterator[StoreConfig]:
    with store_directory("epd-store-recovery-") as path:
        yield StoreConfig(path=path, capacity_bytes=64 << 20, wait_timeout_s=20.0)
        recreation_lock_path(path).unlink(missing_ok=True)


def _endless_writer(config: StoreConfig, ready) -> None:
    store = EmbeddingStore(config)
    i = 0
    while True:  # until SIGKILL: every put keeps its lease, like requests in flight
        store.put(key_of(i), embedding(i))
        i += 1
        if i == 20:
            ready.set()


def test_a_writer_killed_mid_write_leaves_no_torn_entry_and_its_leases_are_reaped(config):
    ready = SPAWN.Event()
    writer = SPAWN.Process(target=_endless_writer, args=(config, ready))
    writer.start()
    assert ready.wait(60)
    time.sleep(0.3)  # well inside a stream of writes
    os.kill(writer.pid, signal.SIGKILL)
    writer.join(10)
    assert writer.exitcode == -signal.SIGKILL

    with EmbeddingStore(config) as store:
        before = store.metrics()
        assert before["entries"] >= 20 and before["active_leases"] == before["entries"]
        report = store.reap_dead_processes()
        assert report.leases == before["entries"]
        # Every entry that exists is whole: its bytes are exactly what was written; the first
        # missing key is where the writer died, and nothing after it exists.
        stored = [i for i in range(before["entries"] + 5) if store.contains(key_of(i))]
        assert stored == list(range(before["entries"]))
        total = 0
        for i in stored:
            reference = store.lookup(key_of(i), lease=False)
            assert reference is not None
            assert np.array_equal(store.resolve(reference), embedding(i))
            total += embedding(i).nbytes
        after = store.metrics()
        assert (after["active_leases"], after["bytes_used"]) == (0, total)


def test_a_store_of_another_schema_is_recreated_empty_with_a_warning(config, caplog):
    with EmbeddingStore(config) as store:
        old = store.put(key_of(1), embedding(1), lease=False)
        old_id = store.store_id
    with lmdb.open(config.path, max_dbs=16) as env:  # as an older release would have left it
        table = env.open_db(b"config")  # outside the write transaction: open_db takes its own
        with env.begin(write=True) as txn:
            txn.put(CONFIG_SCHEMA, b"0", db=table)
    with caplog.at_level(logging.WARNING), EmbeddingStore(config) as store:
        assert store.store_id != old_id
        assert not store.contains(key_of(1)) and store.metrics()["entries"] == 0
        assert error_of(lambda: store.resolve(old)).code is ErrorCode.NOT_FOUND  # another store's now
        store.put(key_of(2), embedding(2), lease=False)
        assert np.array_equal(store.resolve(store.lookup(key_of(2), lease=False)), embedding(2))
    assert any("schema b'0'" in r.message and "recreated it empty" in r.message for r in caplog.records)


def test_a_store_without_identity_is_recreated(config, caplog):
    with EmbeddingStore(config) as store:
        store.put(key_of(1), embedding(1), lease=False)
    with lmdb.open(config.path, max_dbs=16) as env:
        table = env.open_db(b"config")
        with env.begin(write=True) as txn:
            txn.delete(CONFIG_STORE_ID, db=table)
    with caplog.at_level(logging.WARNING), EmbeddingStore(config) as store:
        assert store.metrics()["entries"] == 0
    assert any("no identity" in r.message for r in caplog.records)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "zeroed header"])
def test_a_corrupted_store_file_is_set_aside_and_recreated(config, caplog, damage):
    with EmbeddingStore(config) as store:
        for i in range(4):
            store.put(key_of(i), embedding(i), lease=False)
    data = Path(config.path) / "data.mdb"
    raw = data.read_bytes()
    if damage == "garbage":
        data.write_bytes(os.urandom(len(raw)))
    elif damage == "truncated":
        data.write_bytes(raw[:100])
    else:
        data.write_bytes(bytes(8192) + raw[8192:])
    with caplog.at_level(logging.WARNING), EmbeddingStore(config) as store:
        assert store.metrics()["entries"] == 0 and not store.contains(key_of(0))
        reference = store.put(key_of(9), embedding(9), lease=False)
        assert np.array_equal(store.resolve(reference), embedding(9))
    warnings = [r.message for r in caplog.records if "not a readable LMDB database" in r.message]
    assert len(warnings) == 1, caplog.text
    aside = [p for p in Path(config.path).iterdir() if p.name.startswith("unreadable-")]
    assert len(aside) == 1 and (aside[0] / "data.mdb").exists()


def _open_and_report(config: StoreConfig, out) -> None:
    with EmbeddingStore(config) as store:
        out.put(store.store_id)


def test_processes_opening_a_corrupted_store_at_once_agree_on_one_new_store(config):
    with EmbeddingStore(config):
        pass
    data = Path(config.path) / "data.mdb"
    data.write_bytes(os.urandom(data.stat().st_size))
    out = SPAWN.Queue()
    openers = [SPAWN.Process(target=_open_and_report, args=(config, out)) for _ in range(3)]
    for opener in openers:
        opener.start()
    ids = {out.get(timeout=60) for _ in openers}
    for opener in openers:
        opener.join(30)
    assert len(ids) == 1
    assert len([p for p in Path(config.path).iterdir() if p.name.startswith("unreadable-")]) == 1


def test_the_node_custodian_reaps_a_dead_process_leases_while_serving(config):
    """``epd``'s periodic task (CacheMetrics.refresh_every) returns a killed writer's leases with
    no request and no full store needed to trigger it."""
    import asyncio

    from python_backends.triton_edge.metrics import CacheMetrics, ModelMetrics

    ready = SPAWN.Event()
    writer = SPAWN.Process(target=_endless_writer, args=(config, ready))
    writer.start()
    assert ready.wait(60)
    os.kill(writer.pid, signal.SIGKILL)
    writer.join(10)
    with EmbeddingStore(config) as store:
        assert store.metrics()["active_leases"] >= 20
        custodian = CacheMetrics(ModelMetrics("epd"), store, node_gauges=True)

        async def serve_a_while() -> None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(custodian.refresh_every(0.01, reap_every_s=0.05), timeout=0.3)

        asyncio.run(serve_a_while())
        metrics = store.metrics()
        assert metrics["active_leases"] == 0 and metrics["leases_reaped"] >= 20

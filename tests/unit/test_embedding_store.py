"""Embedding store: content keys, references against entries, LRU + leases, single-flight,
reaping, metrics. The multi-process tests spawn real processes that open the same store."""

import dataclasses
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from python_backends.errors import EpdError, ErrorCode
from python_backends.store import (
    DEFAULT_CAPACITY_BYTES,
    ClaimKind,
    EmbeddingStore,
    EntryMeta,
    StoreConfig,
    content_key,
    verified,
)
from python_backends.store.processes import process_is_alive, process_start_time
from python_backends.store.reference import make_reference, verify_tag
from tests.store_helpers import error_of, store_directory

HIDDEN = 64
ROWS = 16
ENTRY_BYTES = ROWS * HIDDEN * 2  # float16
SPAWN = multiprocessing.get_context("spawn")


def key_of(name: str) -> str:
    return content_key(name.encode(), {"size": 336}, "encoder-v1")


def embedding(seed: int, rows: int = ROWS) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, HIDDEN)).astype(np.float16)


@pytest.fixture
def config() -> Iterator[StoreConfig]:
    with store_directory("epd-store-test-") as path:
        yield StoreConfig(path=path, capacity_bytes=4 * ENTRY_BYTES, wait_timeout_s=20.0, merge_size=2)


@pytest.fixture
def store(config: StoreConfig) -> Iterator[EmbeddingStore]:
    with EmbeddingStore(config) as opened:
        yield opened


# --- content keys -----------------------------------------------------------------------------


def test_content_key_covers_media_config_and_encoder_version():
    base = content_key(b"image", {"size": 336, "mean": [0.5]}, "v1")
    assert base == content_key(b"image", {"mean": [0.5], "size": 336}, "v1")  # key order does not matter
    assert len(base) == 64
    others = {
        content_key(b"image2", {"size": 336, "mean": [0.5]}, "v1"),
        content_key(b"image", {"size": 448, "mean": [0.5]}, "v1"),
        content_key(b"image", {"size": 336, "mean": [0.5]}, "v2"),
    }
    assert base not in others and len(others) == 3


def test_content_key_parts_are_framed():
    # Moving bytes between the parts must change the key.
    assert content_key(b"ab", {}, "c") != content_key(b"a", {}, "bc")


@pytest.mark.parametrize(
    "media, config, version, fragment",
    [
        (b"", {}, "v1", "non-empty bytes"),
        (b"x", {"f": object()}, "v1", "plain JSON"),
        (b"x", {"f": float("nan")}, "v1", "plain JSON"),
        (b"x", [], "v1", "must be a mapping"),
        (b"x", {}, "", "encoder version"),
    ],
)
def test_content_key_rejects_bad_parts(media, config, version, fragment):
    error = error_of(lambda: content_key(media, config, version))
    assert error.code is ErrorCode.INVALID_ARG and fragment in error.message


# --- put, views, references -------------------------------------------------------------------


def test_put_then_view_is_zero_copy_and_read_only(store):
    array = embedding(1)
    reference = store.put(key_of("a"), array, EntryMeta(grid_thw=(1, 8, 8)))
    assert reference.shape == (ROWS, HIDDEN) and reference.num_placeholders == ROWS
    with store.open_view(reference.to_bytes()) as view:
        assert np.array_equal(view, array)
        assert not view.flags.owndata and not view.flags.writeable
        with pytest.raises(ValueError):
            view[0, 0] = 1
    copy = store.resolve(reference)
    assert copy.flags.writeable and copy.flags.owndata and np.array_equal(copy, array)


@pytest.mark.parametrize("dtype, meta_dtype", [(np.float32, None), (np.uint16, "bfloat16")])
def test_other_dtypes_round_trip(store, dtype, meta_dtype):
    array = (np.arange(ROWS * HIDDEN) % 1000).reshape(ROWS, HIDDEN).astype(dtype)
    reference = store.put(key_of(str(dtype)), array, EntryMeta(dtype=meta_dtype))
    assert reference.dtype == (meta_dtype or "float32")
    assert np.array_equal(store.resolve(reference), array)


@pytest.mark.parametrize(
    "array, meta, fragment",
    [
        (np.zeros((ROWS, HIDDEN), np.float64), EntryMeta(), "not storable"),
        (np.zeros((ROWS, HIDDEN), np.uint16), EntryMeta(), "not storable"),
        (np.zeros((ROWS, HIDDEN), np.float16), EntryMeta(num_placeholders=3), "placeholder count 3"),
        (np.zeros((ROWS, HIDDEN), np.float16), EntryMeta(grid_thw=(1, 8, 6)), "gives 12 placeholder"),
        (np.zeros((ROWS, HIDDEN), np.float16), EntryMeta(modality="smell"), "'mod' must be"),
        (np.zeros((0, HIDDEN), np.float16), EntryMeta(), "'sh' must be in"),
        ([[1.0]], EntryMeta(), "numpy array"),
    ],
)
def test_put_rejects_bad_embeddings(store, array, meta, fragment):
    error = error_of(lambda: store.put(key_of("bad"), array, meta))
    assert error.code is ErrorCode.INVALID_ARG and fragment in error.message
    assert store.metrics()["entries"] == 0


def test_put_of_a_stored_key_keeps_the_entry(store):
    first = store.put(key_of("a"), embedding(1), lease=False)
    second = store.put(key_of("a"), embedding(1), lease=False)
    assert second.generation == first.generation
    assert store.metrics()["puts"] == 1


def test_lookup_counts_hits_and_misses(store):
    assert store.lookup(key_of("a")) is None
    store.put(key_of("a"), embedding(1), lease=False)
    hit = store.lookup(key_of("a"))
    assert hit is not None and hit.lease_id
    metrics = store.metrics()
    assert (metrics["hits"], metrics["misses"], metrics["active_leases"]) == (1, 1, 1)
    assert store.release(hit) and not store.release(hit)
    assert store.metrics()["active_leases"] == 0
    assert error_of(lambda: store.release("x" * 600)).code is ErrorCode.INVALID_ARG
    assert error_of(lambda: store.lookup("not a key")).code is ErrorCode.INVALID_ARG


def test_bad_references_are_clean_errors(store, config):
    stored = store.put(key_of("a"), embedding(1), lease=False)

    tampered = stored.to_bytes().replace(b'"gen":1', b'"gen":2')
    error = error_of(lambda: store.resolve(tampered))
    assert error.code is ErrorCode.INVALID_ARG and "integrity" in error.message

    never_stored = make_reference(**{**_reference_fields(stored), "key": key_of("never")}, secret=store.secret)
    error = error_of(lambda: store.resolve(never_stored))
    assert error.code is ErrorCode.NOT_FOUND and "not in the store" in error.message

    foreign = make_reference(**{**_reference_fields(stored), "store_id": "f" * 32}, secret=b"x" * 32)
    error = error_of(lambda: store.resolve(foreign.to_bytes()))
    assert error.code is ErrorCode.NOT_FOUND and "belongs to store" in error.message

    error = error_of(lambda: store.resolve(b'{"v":1}'))
    assert error.code is ErrorCode.INVALID_ARG and "missing" in error.message


def _reference_fields(reference):
    return dict(
        modality=reference.modality,
        mm_hash=reference.mm_hash,
        store_id=reference.store_id,
        location=reference.location,
        key=reference.key,
        generation=reference.generation,
        lease_id=reference.lease_id,
        dtype=reference.dtype,
        shape=reference.shape,
        num_placeholders=reference.num_placeholders,
        grid_thw=reference.grid_thw,
    )


def test_reference_bytes_are_parsed_and_verified_once_per_process(store, monkeypatch):
    verifications = []

    def counting_verify(reference, secret):
        verifications.append(reference.key)
        return verify_tag(reference, secret)

    monkeypatch.setattr(verified, "verify_tag", counting_verify)
    raw = store.put(key_of("a"), embedding(1), lease=False).to_bytes()
    parsed = store.parse_reference(raw)
    assert store.parse_reference(bytearray(raw)) is parsed and store.parse(raw) is parsed
    np.testing.assert_array_equal(store.resolve(raw), embedding(1))
    assert store.release(store.acquire_lease(raw))
    with store.open_view(parsed):
        pass
    assert verifications == [parsed.key]  # the bytes once; the verified object is not checked again

    tampered = raw.replace(b'"gen":1', b'"gen":2')
    for _ in range(2):  # a failure is never kept: it fails in full each time
        assert "integrity" in error_of(lambda: store.parse_reference(tampered)).message
    assert len(verifications) == 3


def test_cached_references_are_still_checked_against_the_store_on_every_read(store):
    raw = store.put(key_of("a"), embedding(1), lease=False).to_bytes()
    np.testing.assert_array_equal(store.resolve(raw), embedding(1))
    store.clear()
    store.parse_reference(raw)  # still a well-formed, signed reference...
    for read in (store.resolve, store.acquire_lease, lambda ref: store.open_view(ref).__enter__()):
        error = error_of(lambda read=read: read(raw))  # ...that names nothing now
        assert error.code is ErrorCode.NOT_FOUND and "not in the store" in error.message


def test_the_reference_cache_is_bounded(store):
    references = verified.VerifiedReferences(store.store_id, store.secret, merge_size=2, maxsize=2)
    raws = [store.put(key_of(f"r{i}"), embedding(i), lease=False).to_bytes() for i in range(3)]
    for raw in raws:
        assert references.parse(raw).to_bytes() == raw
    assert len(references) == 2


def test_the_capacity_default_is_one_constant():
    assert StoreConfig().capacity_bytes == DEFAULT_CAPACITY_BYTES == 1 << 30


def test_evicted_and_reinserted_entries_are_not_found(store):
    old = store.put(key_of("a"), embedding(1), lease=False)
    for index in range(4):  # capacity is four entries: "a" is least recently used
        store.put(key_of(f"filler{index}"), embedding(10 + index), lease=False)
    error = error_of(lambda: store.resolve(old))
    assert error.code is ErrorCode.NOT_FOUND and "evicted" in error.message

    new = store.put(key_of("a"), embedding(1), lease=False)
    assert new.generation != old.generation
    error = error_of(lambda: store.resolve(old))
    assert error.code is ErrorCode.NOT_FOUND and f"generation {old.generation} was evicted" in error.message
    assert np.array_equal(store.resolve(new), embedding(1))


def test_clear_drops_entries_but_keeps_generations_and_identity(store):
    old = store.put(key_of("a"), embedding(1))
    store.clear()
    metrics = store.metrics()
    assert (metrics["entries"], metrics["bytes_used"], metrics["active_leases"]) == (0, 0, 0)
    assert metrics["puts"] == 1
    assert error_of(lambda: store.resolve(old)).code is ErrorCode.NOT_FOUND
    assert store.put(key_of("a"), embedding(1)).generation > old.generation
    assert store.release(old) is False


def test_identity_persists_and_the_last_opener_sets_capacity(config):
    with EmbeddingStore(config) as first:
        identity = (first.store_id, first.secret)
    with EmbeddingStore(StoreConfig(path=config.path, capacity_bytes=8 * ENTRY_BYTES)) as second:
        assert (second.store_id, second.secret) == identity
        assert second.metrics()["capacity_bytes"] == 8 * ENTRY_BYTES


def test_opening_one_store_twice_in_a_process_is_a_clear_error(store, config):
    error = error_of(lambda: EmbeddingStore(config))
    assert error.code is ErrorCode.INTERNAL and "already open in this process" in error.message


# --- LRU and leases ---------------------------------------------------------------------------


def test_lru_evicts_least_recently_used_and_never_a_leased_entry(store):
    leased = store.put(key_of("leased"), embedding(0))
    store.put(key_of("old"), embedding(1), lease=False)
    store.put(key_of("touched"), embedding(2), lease=False)
    store.lookup(key_of("touched"), lease=False)  # now more recent than "old"
    for index in range(6):
        store.put(key_of(f"new{index}"), embedding(10 + index), lease=False)
        assert store.metrics()["bytes_used"] <= 4 * ENTRY_BYTES
    assert store.contains(key_of("leased"))
    assert np.array_equal(store.resolve(leased), embedding(0))
    assert not store.contains(key_of("old")) and not store.contains(key_of("touched"))
    assert store.metrics()["evictions"] == 5


def test_full_of_leased_entries_refuses_cleanly_until_a_release(store):
    references = [store.put(key_of(f"k{index}"), embedding(index)) for index in range(4)]
    error = error_of(lambda: store.put(key_of("one more"), embedding(9)))
    assert error.code is ErrorCode.UNAVAILABLE and "held by 4 leases" in error.message
    assert all(store.contains(ref.key) for ref in references)
    store.release(references[2])
    store.put(key_of("one more"), embedding(9))
    assert not store.contains(references[2].key) and store.metrics()["bytes_used"] == 4 * ENTRY_BYTES


def test_entry_larger_than_capacity_is_invalid(store):
    error = error_of(lambda: store.put(key_of("huge"), embedding(1, rows=5 * ROWS)))
    assert error.code is ErrorCode.INVALID_ARG and "larger than the store capacity" in error.message


def test_acquire_lease_on_a_reference_and_release(store):
    plain = store.put(key_of("a"), embedding(1), lease=False)
    assert plain.lease_id == ""
    leased = store.acquire_lease(plain.to_bytes())
    assert leased.lease_id and leased.generation == plain.generation
    assert store.metrics()["active_leases"] == 1
    assert store.release(leased.lease_id)


def test_leases_older_than_the_maximum_age_are_reaped(config):
    with EmbeddingStore(StoreConfig(path=config.path, max_lease_age_s=0.05)) as store:
        reference = store.put(key_of("a"), embedding(1))
        assert store.reap_dead_processes().leases == 0
        time.sleep(0.1)
        assert store.reap_dead_processes().leases == 1
        assert store.release(reference) is False and store.metrics()["active_leases"] == 0


def test_open_view_survives_eviction_of_its_entry(store):
    reference = store.put(key_of("a"), embedding(1), lease=False)
    with store.open_view(reference) as view:
        for index in range(8):  # evicts "a" and reuses freed space while the view is open
            store.put(key_of(f"filler{index}"), embedding(10 + index), lease=False)
        assert not store.contains(key_of("a"))
        assert np.array_equal(view, embedding(1))  # the read transaction pins its snapshot


# --- single-flight ----------------------------------------------------------------------------


def test_threads_asking_for_one_new_key_produce_it_once(store):
    calls = []
    results = []
    errors = []

    def producer():
        calls.append(1)
        time.sleep(0.2)
        return embedding(5), EntryMeta()

    def request():
        try:
            results.append(store.get_or_create(key_of("new"), producer))
        except EpdError as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=request) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(calls) == 1
    assert len({ref.generation for ref in results}) == 1 and len({ref.lease_id for ref in results}) == 12
    metrics = store.metrics()
    assert (metrics["encodes"], metrics["misses"], metrics["joins"] + metrics["hits"]) == (1, 1, 11)
    assert metrics["active_leases"] == 12


def test_producer_failure_reaches_every_waiter_and_a_later_call_retries(store):
    started = threading.Event()
    release = threading.Event()

    def failing_producer():
        started.set()
        release.wait(5)
        raise EpdError("image could not be decoded", ErrorCode.INVALID_ARG)

    outcomes = []

    def request():
        try:
            store.get_or_create(key_of("x"), failing_producer)
        except EpdError as exc:
            outcomes.append((exc.code, exc.message))

    producer_thread = threading.Thread(target=request)
    producer_thread.start()
    started.wait(5)
    waiters = [threading.Thread(target=request) for _ in range(5)]
    for thread in waiters:
        thread.start()
    _wait_until(lambda: store.metrics()["joins"] == 5)
    release.set()
    for thread in [producer_thread, *waiters]:
        thread.join()
    assert outcomes == [(ErrorCode.INVALID_ARG, "image could not be decoded")] * 6
    assert store.metrics()["producer_failures"] == 1

    retried = store.get_or_create(key_of("x"), lambda: (embedding(3), EntryMeta()))
    assert np.array_equal(store.resolve(retried), embedding(3))


def test_unexpected_producer_exception_is_internal_for_waiters(store):
    claim = store.claim(key_of("x"))
    joined = store.claim(key_of("x"))
    assert (claim.kind, joined.kind) == (ClaimKind.PRODUCE, ClaimKind.JOIN)
    store.abandon(claim, RuntimeError("CUDA out of memory"))
    error = error_of(lambda: store.wait_for(joined))
    assert error.code is ErrorCode.INTERNAL and "RuntimeError: CUDA out of memory" in error.message


def test_waiter_times_out_cleanly(store):
    claim = store.claim(key_of("slow"))
    joined = store.claim(key_of("slow"))
    error = error_of(lambda: store.wait_for(joined, timeout_s=0.1))
    assert error.code is ErrorCode.UNAVAILABLE and "timed out" in error.message
    store.fulfil(claim, embedding(1))
    assert store.claim(key_of("slow")).kind is ClaimKind.HIT


def test_claim_misuse_is_invalid_arg(store):
    claim = store.claim(key_of("a"))
    joined = store.claim(key_of("a"))
    assert error_of(lambda: store.fulfil(joined, embedding(1))).code is ErrorCode.INVALID_ARG
    assert error_of(lambda: store.wait_for(claim)).code is ErrorCode.INVALID_ARG


def test_stale_claim_is_taken_over(config):
    with EmbeddingStore(StoreConfig(path=config.path, producer_timeout_s=0.05)) as store:
        store.claim(key_of("a"))  # a producer that never reports back
        time.sleep(0.1)
        assert store.claim(key_of("a")).kind is ClaimKind.PRODUCE
        assert store.metrics()["claims_reaped"] == 1


def _wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


# --- processes --------------------------------------------------------------------------------


def test_process_liveness_tells_a_reused_pid_apart():
    me = os.getpid()
    assert process_is_alive(me, process_start_time(me))
    assert process_is_alive(me, "")
    assert not process_is_alive(me, "not my start time")
    assert not process_is_alive(0, "")


def _single_flight_worker(config: StoreConfig, threads: int, barrier, out) -> None:
    produced = []
    references = []

    def producer():
        produced.append(os.getpid())
        time.sleep(0.3)  # long enough for every other caller to arrive while it runs
        return embedding(42), EntryMeta(grid_thw=(1, 8, 8))

    def request(store):
        references.append(store.get_or_create(key_of("shared"), producer).to_bytes())

    with EmbeddingStore(config) as store:
        barrier.wait()
        workers = [threading.Thread(target=request, args=(store,)) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        out.put((len(produced), references))


def test_processes_and_threads_asking_for_one_new_key_produce_it_once(store, config):
    processes, threads = 4, 8
    barrier = SPAWN.Barrier(processes)
    out = SPAWN.Queue()
    workers = [
        SPAWN.Process(target=_single_flight_worker, args=(config, threads, barrier, out)) for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    results = [out.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(30)
    assert sum(produced for produced, _ in results) == 1
    references = [store.parse(raw) for _, refs in results for raw in refs]
    assert len(references) == processes * threads
    assert len({ref.generation for ref in references}) == 1
    metrics = store.metrics()
    assert (metrics["encodes"], metrics["misses"]) == (1, 1)
    assert metrics["joins"] + metrics["hits"] == processes * threads - 1
    assert metrics["active_leases"] == processes * threads
    assert np.array_equal(store.resolve(references[0]), embedding(42))


def _writer_worker(config: StoreConfig, count: int, out) -> None:
    with EmbeddingStore(config) as store:
        references = [store.put(key_of(f"w{index}"), embedding(100 + index), lease=False) for index in range(count)]
        out.put([ref.to_bytes() for ref in references])


def test_reader_process_sees_the_writer_process_bytes_without_a_copy(store, config):
    out = SPAWN.Queue()
    writer = SPAWN.Process(target=_writer_worker, args=(config, 2, out))
    writer.start()
    raw_references = out.get(timeout=60)
    writer.join(30)
    for index, raw in enumerate(raw_references):
        with store.open_view(raw) as view:
            assert not view.flags.owndata
            assert view.tobytes() == embedding(100 + index).tobytes()


def _pressure_worker(config: StoreConfig, worker: int, threads: int, rounds: int, out) -> None:
    problems = []

    def requests(thread: int) -> None:
        try:
            put_read_release(thread)
        except Exception as exc:  # reported to the test, not lost in the thread
            problems.append(repr(exc))

    def put_read_release(thread: int) -> None:
        for round_ in range(rounds):
            seed = 1000 * worker + 100 * thread + round_
            reference = store.put(key_of(f"p{seed}"), embedding(seed))  # leased: must survive until released
            with store.open_view(reference) as view:
                time.sleep(0.005)  # a request in flight while the others insert and evict
                if not np.array_equal(view, embedding(seed)):
                    problems.append(f"entry {seed} changed while leased")
            if store.metrics()["bytes_used"] > config.capacity_bytes:
                problems.append("bytes over capacity")
            store.release(reference)

    with EmbeddingStore(config) as store:
        workers = [threading.Thread(target=requests, args=(thread,)) for thread in range(threads)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
    out.put(problems)


def test_eviction_under_concurrent_pressure_never_frees_a_leased_entry(config):
    config = dataclasses.replace(config, capacity_bytes=6 * ENTRY_BYTES)
    store = EmbeddingStore(config)
    held = store.put(key_of("held"), embedding(7))  # a long request's lease, held throughout
    out = SPAWN.Queue()
    # 2 processes x 2 threads, 10 puts each: 40 entries through a 6-entry store, at most 5 leases at once.
    writers = [SPAWN.Process(target=_pressure_worker, args=(config, worker, 2, 10, out)) for worker in range(2)]
    for writer in writers:
        writer.start()
    problems = [problem for _ in writers for problem in out.get(timeout=60)]
    for writer in writers:
        writer.join(30)
    assert problems == []
    metrics = store.metrics()
    assert metrics["evictions"] >= 35 and metrics["bytes_used"] <= config.capacity_bytes
    assert metrics["entries"] * ENTRY_BYTES == metrics["bytes_used"]
    assert metrics["active_leases"] == 1
    assert np.array_equal(store.resolve(held), embedding(7))
    store.close()


def _crashing_worker(config: StoreConfig, out) -> None:
    store = EmbeddingStore(config)
    reference = store.put(key_of("crash"), embedding(1))
    claim = store.claim(key_of("never finished"))
    view = store.open_view(reference)
    view.__enter__()  # an open zero-copy view: a read transaction the process never ends
    out.put((reference.to_bytes(), claim.kind.value))
    out.close()
    out.join_thread()  # the message must be out before the process dies
    os._exit(1)  # dies holding a lease and a claim, like a killed model instance


def test_leases_and_claims_of_a_dead_process_are_reaped(store, config):
    out = SPAWN.Queue()
    crashing = SPAWN.Process(target=_crashing_worker, args=(config, out))
    crashing.start()
    raw_reference, claim_kind = out.get(timeout=60)
    crashing.join(30)
    assert claim_kind == "produce"
    assert store.metrics()["active_leases"] == 1

    # The dead producer's claim does not make anyone wait: the next caller takes it over.
    assert store.claim(key_of("never finished"), lease=False).kind is ClaimKind.PRODUCE
    report = store.reap_dead_processes()
    assert (report.leases, report.claims, report.readers) == (1, 0, 1)
    metrics = store.metrics()
    assert (metrics["active_leases"], metrics["leases_reaped"], metrics["claims_reaped"]) == (0, 1, 1)
    assert store.reap_dead_processes().leases == 0
    # The entry is still there (only unleased now), so its reference still resolves.
    assert np.array_equal(store.resolve(raw_reference), embedding(1))

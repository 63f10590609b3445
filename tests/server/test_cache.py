"""The shared embedding cache on the real server: encoders share one node store, single-flight,
warm-up by mm_hash, eviction (a stale reference is NOT_FOUND), pressure (a store smaller than
the working set), and /metrics counting what the test did.

Every image here is new to the store (``fresh_image``: a per-session note in its metadata) and
every counter is read as a delta around the test's own requests, so what a test expects
depends on nothing an earlier test or server session left in the node's store."""

from __future__ import annotations

import concurrent.futures
import functools
import secrets
import threading
import time
import urllib.request

import pytest

from bench.server_stats import parse_metrics
from builders.tritonserver import TritonServer
from client.epd_client import ClientError, GrpcClient, chat_prompt
from python_backends.store import EmbeddingStore
from tests.images import synthetic_image, with_note
from tests.server.conftest import CACHE_POLICY, DISAGGREGATED, encoder_references, open_node_store
from tests.server.test_epd import _prefill_error

pytestmark = pytest.mark.server

GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}  # exactly 4 tokens
POLICY = CACHE_POLICY
ENTRY_224 = (224 // 28) ** 2 * 128 * 4  # bytes of one 224x224 image's embedding (64 tokens x 128 fp32)


SESSION_NOTE = f"triton-epd test_cache {secrets.token_hex(8)}".encode()


def fresh_image(width: int, height: int, seed: int) -> bytes:
    """A picture no earlier session put in the store: new bytes (hence content key), same pixels."""
    return with_note(synthetic_image(width, height, seed), SESSION_NOTE)


def _counters(server: TritonServer) -> dict[tuple[str, str], float]:
    """(metric, model[/result]) -> value, for the cache metrics of every model."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    snapshot = parse_metrics(text)
    values: dict[tuple[str, str], float] = {}
    for (name, labels), value in {**snapshot.counters, **snapshot.gauges}.items():
        label = dict(labels)
        if "model" in label:
            key = label["model"] + (f"/{label['result']}" if "result" in label else "")
            values[(name, key)] = values.get((name, key), 0.0) + value
    return values


def _delta(before: dict, after: dict, name: str, key: str) -> float:
    return after.get((name, key), 0.0) - before.get((name, key), 0.0)


def test_an_image_encoded_by_one_encoder_is_a_hit_for_the_other_and_metrics_count_it(server, epd):
    image, other = fresh_image(256, 192, seed=5001), fresh_image(160, 160, seed=5002)
    prompt = chat_prompt("Where did this come from?", 1)
    before = _counters(server)
    first = epd.generate(prompt, [image], GREEDY, parameters={"encoder": "encoder_0"})
    # Through encoder_1 directly (a warm-up call): the node store already has it.
    client = GrpcClient(server.grpc_url, "epd")
    try:
        [mm_hash] = client.warm_up([image], encoder="encoder_1")
        [other_hash] = client.warm_up([other], encoder="encoder_1")
    finally:
        client.close()
    again = epd.generate(prompt, [image], GREEDY, parameters={"encoder": "encoder_1"})
    by_hash = epd.generate(prompt, [f"mm_hash:{other_hash}".encode()], GREEDY)
    after = _counters(server)
    assert again.token_ids == first.token_ids
    assert by_hash.num_output_tokens == 4 and len(mm_hash) == 64
    # The per-request output: how many of the request's images the cache served.
    assert (first.cache_hits, again.cache_hits, by_hash.cache_hits) == (0, 1, 1)
    assert {"hash", "lookup", "prefill", "decode"} <= set(again.timings_ms)
    # What each model saw: encoder_0 encoded the first image, encoder_1 found it and encoded the
    # other one, epd found the repeated image and the mm_hash itself (no encoder call).
    assert _delta(before, after, "epd_cache_lookups", "encoder_0/miss") == 1
    assert _delta(before, after, "epd_cache_encodes", "encoder_0") == 1
    assert _delta(before, after, "epd_cache_lookups", "encoder_1/hit") == 1
    assert _delta(before, after, "epd_cache_lookups", "encoder_1/miss") == 1
    assert _delta(before, after, "epd_cache_encodes", "encoder_1") == 1
    assert _delta(before, after, "epd_cache_lookups", "epd/hit") == 2
    assert _delta(before, after, "nv_inference_request_success", "encode") == 2
    # The node gauges (exported by epd, refreshed every second) agree with the store itself.
    time.sleep(1.5)
    with open_node_store() as store:
        state = store.metrics()
    gauges = _counters(server)
    assert gauges[("epd_store_entries", "epd")] == state["entries"]
    assert gauges[("epd_store_bytes_used", "epd")] == state["bytes_used"]
    assert gauges[("epd_store_capacity_bytes", "epd")] == POLICY.capacity_bytes
    assert ("epd_store_entries", "encoder_0") not in gauges  # one exporter per node, no double counts


def test_thirty_two_concurrent_requests_with_one_new_image_encode_it_once(server, epd):
    image = fresh_image(300, 200, seed=5100)
    prompt = chat_prompt("All at once.", 1)
    before = _counters(server)
    clients = [GrpcClient(server.grpc_url, "epd") for _ in range(32)]
    try:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            def ask(c: GrpcClient):
                return c.generate(prompt, [image], GREEDY, parameters=DISAGGREGATED, timeout_s=600)

            results = list(pool.map(ask, clients))
    finally:
        for client in clients:
            client.close()
    after = _counters(server)
    assert len({tuple(r.token_ids) for r in results}) == 1
    assert _delta(before, after, "nv_inference_request_success", "encode") == 1
    encodes = sum(_delta(before, after, "epd_cache_encodes", m) for m in POLICY.encoder_models)
    joins = sum(_delta(before, after, "epd_cache_lookups", f"{m}/join") for m in POLICY.encoder_models)
    assert encodes == 1
    assert joins + _delta(before, after, "epd_cache_lookups", "epd/hit") + sum(
        _delta(before, after, "epd_cache_lookups", f"{m}/hit") for m in POLICY.encoder_models
    ) == 31


def test_unknown_mm_hash_is_not_found_with_a_hint(server, epd):
    with pytest.raises(ClientError) as info:
        epd.generate(chat_prompt("Which one?", 1), [b"mm_hash:" + b"0" * 64], GREEDY)
    assert "send the image bytes" in str(info.value)
    with pytest.raises(ClientError) as info:
        epd.generate(chat_prompt("Which one?", 1), [b"mm_hash:not-hex"], GREEDY)
    assert "64 lowercase hex" in str(info.value)
    llm = GrpcClient(server.grpc_url, "llm")
    try:
        with pytest.raises(ClientError) as info:
            llm.generate(chat_prompt("Which one?", 1), [b"mm_hash:" + b"0" * 64], GREEDY)
        assert "served by epd" in str(info.value)
    finally:
        llm.close()
    assert "unknown encoder" in _stage_error_with_pin(server)


def _stage_error_with_pin(server: TritonServer) -> str:
    client = GrpcClient(server.grpc_url, "epd")
    try:
        with pytest.raises(ClientError) as info:
            client.generate(chat_prompt("x", 0), [], GREEDY, parameters={"encoder": "encoder_9"})
        return str(info.value)
    finally:
        client.close()


def test_an_evicted_reference_is_not_found_and_never_garbage(server, epd):
    victim = fresh_image(224, 224, seed=5200)
    client = GrpcClient(server.grpc_url, "epd")
    try:
        response = encoder_references(server, [victim])
        [reference] = response
        [victim_hash] = client.warm_up([victim])
        with open_node_store(capacity_bytes=3 * ENTRY_224):  # shrink: three 224x224 entries fit
            client.warm_up([fresh_image(224, 224, seed=5201 + i) for i in range(4)])
        with open_node_store() as store:  # capacity back for the rest of the session
            assert store.metrics()["evictions"] >= 1
            assert not store.contains(victim_hash)
        message = _prefill_error(server, [reference])
        assert "not found" in message.lower() or "evicted" in message.lower(), message
        with pytest.raises(ClientError) as info:
            epd.generate(chat_prompt("Gone?", 1), [f"mm_hash:{victim_hash}".encode()], GREEDY)
        assert "send the image bytes" in str(info.value)
        # Sending the bytes again works (and re-encodes).
        assert epd.generate(chat_prompt("Gone?", 1), [victim], GREEDY).num_output_tokens == 4
    finally:
        client.close()


def test_a_store_smaller_than_the_working_set_evicts_but_every_answer_stays_right(server, epd, llm):
    images = [fresh_image(224, 224, seed=5300 + i) for i in range(10)]
    prompt = chat_prompt("Under pressure.", 1)
    expected = [llm.generate(prompt, [image], GREEDY).token_ids for image in images]
    capacity = 5 * ENTRY_224  # half the working set; 4 requests in flight hold at most 4 entries
    peak = {"bytes_used": 0}
    stop = threading.Event()

    def watch(store: EmbeddingStore) -> None:
        while not stop.is_set():
            peak["bytes_used"] = max(peak["bytes_used"], store.metrics()["bytes_used"])
            time.sleep(0.01)

    order = [i % len(images) for i in range(0, 3 * len(images) * 7, 7)]  # mixed, repeats
    with open_node_store(capacity_bytes=capacity) as store:
        store.clear()
        evictions = store.metrics()["evictions"]
        watcher = threading.Thread(target=watch, args=(store,), daemon=True)
        watcher.start()
        lanes = [list(enumerate(order))[lane::4] for lane in range(4)]  # 4 requests in flight

        def run_lane(lane: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
            client = GrpcClient(server.grpc_url, "epd")
            try:
                ask = functools.partial(client.generate, prompt, sampling=GREEDY, parameters=DISAGGREGATED)
                return [(n, ask([images[i]]).token_ids) for n, i in lane]
            finally:
                client.close()

        try:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                answered = dict(pair for lane in pool.map(run_lane, lanes) for pair in lane)
        finally:
            stop.set()
            watcher.join()
        # A request lets go of its leases before its last response goes out (EpdPipeline.run).
        final = store.metrics()
    with open_node_store():
        pass  # capacity back for the rest of the session
    assert len(answered) == len(order)
    mismatched = [i for n, i in enumerate(order) if answered[n] != expected[i]]
    assert not mismatched, f"answers differ from llm for images {mismatched}"
    assert final["evictions"] - evictions > 0
    assert peak["bytes_used"] <= capacity and final["bytes_used"] <= capacity
    assert final["active_leases"] == 0

"""`epd` over the wire: same greedy tokens as `llm`, cache hits, references only, bad
references, cancellation."""

from __future__ import annotations

import json
import queue
import re
import time
import urllib.request

import numpy as np
import pytest

from builders.tritonserver import TritonServer
from client.epd_client import ClientError, HttpClient, chat_prompt
from python_backends.pd.transfer import TransferParams
from python_backends.store import EmbeddingStore, EntryMeta, StoreConfig, content_key
from tests.images import synthetic_image
from tests.server.conftest import DISAGGREGATED, open_node_store
from tests.store_helpers import store_directory

pytestmark = pytest.mark.server

GREEDY = {"max_tokens": 12, "temperature": 0.0}
EXACT = {**GREEDY, "ignore_eos": True}  # exactly 12 tokens, whatever the random model's greedy choices
CASES = [
    ("Say something about nothing.", []),
    ("What is in this picture?", [(640, 480)]),
    ("Describe the scene.", [(64, 64)]),
    ("Read the tall image.", [(300, 1000)]),
    ("Compare these two images.", [(640, 480), (200, 300)]),
    (" ".join(["A long prompt that spans more than one KV block."] * 20), [(128, 96)]),
]


def _metrics(server: TritonServer) -> str:
    return urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()


def _metric(server: TritonServer, name: str, **labels: str) -> float:
    text = _metrics(server)
    total = 0.0
    found = False
    for line in text.splitlines():
        match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
            found = True
    assert found, f"metric {name} {labels} is not exported"
    return total


def test_greedy_tokens_equal_llm_over_grpc_streaming(epd, llm):
    for i, (text, sizes) in enumerate(CASES):
        images = [synthetic_image(w, h, seed=100 + 10 * i + j) for j, (w, h) in enumerate(sizes)]
        prompt = chat_prompt(text, len(images))
        expected = llm.generate(prompt, images, GREEDY)
        pieces: list[str] = []
        got = epd.generate(prompt, images, GREEDY, on_text=pieces.append)
        assert got.token_ids == expected.token_ids, text
        assert got.num_output_tokens == expected.num_output_tokens == len(got.token_ids) <= 12
        assert got.num_input_tokens == expected.num_input_tokens
        assert got.finish_reason == expected.finish_reason
        # 12 tokens unless the model itself ended the answer (end-of-sequence).
        assert got.finish_reason == ("length" if got.num_output_tokens == 12 else "stop")
        assert len(got.chunk_times) > 1  # first token from prefill, then decode's stream
        assert "".join(pieces) == got.text


def test_repeated_image_is_a_cache_hit_without_a_second_encode(server, epd):
    image = synthetic_image(320, 240, seed=4242)
    prompt = chat_prompt("Once more.", 1)
    first = epd.generate(prompt, [image], GREEDY, parameters=DISAGGREGATED)  # stores it
    encodes = _metric(server, "nv_inference_request_success", model="encode")
    hits = _metric(server, "epd_cache_hits", model="epd")
    second = epd.generate(prompt, [image], GREEDY)
    assert second.token_ids == first.token_ids
    assert _metric(server, "nv_inference_request_success", model="encode") == encodes
    assert _metric(server, "epd_cache_hits", model="epd") == hits + 1


def test_only_references_cross_from_encode_to_prefill(server, epd):
    before_bytes = _metric(server, "epd_prefill_input_bytes", kind="reference")
    before_refs = _metric(server, "epd_prefill_references")
    images = [synthetic_image(800, 600, seed=77), synthetic_image(96, 96, seed=78)]
    epd.generate(chat_prompt("Two images.", 2), images, GREEDY, parameters=DISAGGREGATED)
    sent = _metric(server, "epd_prefill_input_bytes", kind="reference") - before_bytes
    refs = _metric(server, "epd_prefill_references") - before_refs
    assert refs == 2
    assert 0 < sent / refs <= 1024  # a reference, whatever the embedding size
    assert _metric(server, "epd_prefill_input_bytes", kind="media") == 0


def _stage_error(server: TritonServer, model: str, values: dict[str, list[bytes]]) -> str:
    """Send ``model`` one request of BYTES inputs; return the error message."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:

        def tensor(name, values):
            item = grpcclient.InferInput(name, [len(values)], "BYTES")
            item.set_data_from_numpy(np.array(values, dtype=np.object_))
            return item

        client.async_stream_infer(model, [tensor(name, items) for name, items in values.items()])
        _, error = responses.get(timeout=120)
        assert error is not None, f"{model} accepted bad input {values}"
        return error.message()
    finally:
        client.stop_stream()
        client.close()


def _prefill_error(server: TritonServer, references: list[bytes]) -> str:
    return _stage_error(
        server,
        "prefill",
        {
            "text_input": [chat_prompt("x", len(references)).encode()],
            "references": references,
            "sampling_parameters": [json.dumps(GREEDY).encode()],
        },
    )


def test_decode_with_bad_kv_parameters_is_a_clear_error(server, epd):
    garbage = _stage_error(server, "decode", {"transfer_params": [b"{not json"]})
    assert "KV transfer parameters are not valid JSON" in garbage
    unknown = TransferParams(transfer_id="0" * 32, num_prompt_tokens=8, first_token_id=1, digest="0" * 64)
    message = _stage_error(server, "decode", {"transfer_params": [unknown.to_json().encode()]})
    assert "not found" in message and "Traceback" not in message
    assert epd.generate(chat_prompt("Still here?", 0), [], EXACT).num_output_tokens == 12


def test_unknown_or_tampered_reference_is_refused_by_prefill(server, epd):
    # A real reference of the server's store, made by this process (same node, same store).
    with open_node_store() as store:
        key = content_key(b"test-reference", {"t": 1}, "v1")
        ref = store.put(key, np.zeros((4, 64), np.float32), EntryMeta(grid_thw=(1, 4, 4)), lease=False)
        good = ref.to_bytes()
    fields = json.loads(good)
    fields["shape"] = [8, 64]
    tampered = json.dumps(fields).encode()
    assert "reference" in _prefill_error(server, [b"not a reference"]).lower()
    message = _prefill_error(server, [tampered])
    assert "reference" in message and "Traceback" not in message
    # A reference from another node's store: NOT_FOUND ("send the media again").
    with store_directory("epd-other-store-") as other_dir:
        with EmbeddingStore(StoreConfig(path=other_dir, capacity_bytes=1 << 20, merge_size=2)) as other:
            foreign = other.put(key, np.zeros((4, 64), np.float32), EntryMeta(grid_thw=(1, 4, 4)), lease=False)
        assert "send the media again" in _prefill_error(server, [foreign.to_bytes()])
    # The server keeps serving.
    assert epd.generate(chat_prompt("Still here?", 0), [], EXACT).num_output_tokens == 12


def test_cancelled_stream_leaves_no_lease_and_no_vllm_request(server, epd):
    long_run = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0.0}
    image = synthetic_image(200, 200, seed=999)
    partial = epd.generate(chat_prompt("Go on forever.", 1), [image], long_run, cancel_after_chunks=3)
    assert 3 <= len(partial.token_ids) < 1500
    # The store's own count (all processes) is authoritative; the gauges follow it (epd's store
    # gauges every second), so they are read after the store says the request let go of its leases.
    with open_node_store() as store:
        deadline = time.monotonic() + 60
        while store.metrics()["active_leases"] != 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert store.metrics()["active_leases"] == 0
    for gauge in ("epd_decode_unfinished_requests", "epd_store_active_leases"):
        while _metric(server, gauge) != 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _metric(server, gauge) == 0, gauge
    assert epd.generate(chat_prompt("Next one.", 0), [], EXACT).num_output_tokens == 12


def test_the_streamed_decode_read_is_refused_unless_the_server_allows_it(server, epd):
    """The old streamed decode read (measurement only) deadlocks the stub under load: a server
    started without TRITON_EPD_ALLOW_STREAMED_DECODE=1 refuses it and keeps serving."""
    parameters = {**DISAGGREGATED, "decode_reads": "stream"}
    with pytest.raises(ClientError) as info:
        epd.generate(chat_prompt("Stream it.", 0), [], GREEDY, parameters=parameters)
    assert "TRITON_EPD_ALLOW_STREAMED_DECODE=1" in str(info.value) and "deadlocks" in str(info.value)
    polled = epd.generate(chat_prompt("Poll it.", 0), [], EXACT, parameters={**DISAGGREGATED, "decode_reads": "poll"})
    assert polled.num_output_tokens == 12


def test_bad_image_is_one_coded_error(server, epd):
    broken = b"\xff\xd8\xff\xe0 not really a jpeg"
    prompt = chat_prompt("Broken.", 1)
    with pytest.raises(ClientError) as info:  # a gRPC stream carries the message only
        epd.generate(prompt, [broken], GREEDY)
    message = str(info.value)
    assert "image[0] cannot be read" in message and "Traceback" not in message, message
    # Over HTTP: the same message, once, with 400. (Triton 2.51's generate endpoint answered 400
    # here even with the error deliberately raised as INTERNAL, so the code itself is asserted
    # where it is made: tests/unit/test_preprocess_parity.py's bad inputs are INVALID_ARG.)
    http = HttpClient(server.http_url, "epd")
    try:
        with pytest.raises(ClientError) as info:
            http.generate(prompt, [broken], GREEDY)
    finally:
        http.close()
    assert (info.value.status, str(info.value)) == ("400", message)

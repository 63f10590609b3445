"""Inputs of the prefill/decode models: references are checked and read from the store."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
import pytest

from python_backends.engines.prompt import ImageEmbeds, multi_modal_data, multi_modal_uuids, owned_float32
from python_backends.errors import EpdError, ErrorCode
from python_backends.pd.stage import parse_stage_inputs, resolve_images
from python_backends.request.sampling import SamplingLimits
from python_backends.store import EmbeddingStore, EntryMeta, StoreConfig, content_key


@pytest.fixture
def store():
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = tempfile.mkdtemp(prefix="epd-pd-stage-test-", dir=root)
    with EmbeddingStore(StoreConfig(path=path, capacity_bytes=1 << 20, merge_size=2)) as opened:
        yield opened
    shutil.rmtree(path, ignore_errors=True)


def strings(*values: str | bytes) -> np.ndarray:
    return np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=np.object_)


def test_parse_stage_inputs():
    parsed = parse_stage_inputs(
        {
            "text_input": strings("hi"),
            "references": strings(b"r1", b"r2"),
            "sampling_parameters": strings(json.dumps({"max_tokens": 5})),
            "stream": np.array([False]),
            "request_id": strings("abc"),
        },
        SamplingLimits(max_tokens=100),
    )
    assert parsed.text == "hi" and parsed.references == [b"r1", b"r2"] and parsed.sampling["max_tokens"] == 5
    assert parsed.stream is False and parsed.request_id == "abc" and parsed.abort is False
    with pytest.raises(EpdError):
        sampling = {"sampling_parameters": strings(json.dumps({"max_tokens": 500}))}
        parse_stage_inputs(sampling, SamplingLimits(max_tokens=100))


def test_resolve_images_reads_the_entry_and_refuses_bad_references(store):
    embeds = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)
    ref = store.put(content_key(b"img", {}, "v1"), embeds, EntryMeta(grid_thw=(1, 4, 4)), lease=False)
    images, refs = resolve_images(store, [ref.to_bytes()])
    assert images[0].grid_thw == (1, 4, 4) and refs[0].key == ref.key
    # The content key is vLLM's identity of the item in both processes (not vLLM's own hash,
    # which depends on each process's hash seed for embeddings).
    assert images[0].uuid == ref.key
    assert multi_modal_uuids(images) == {"image": [ref.key]}
    assert multi_modal_uuids([ImageEmbeds(images[0].embeds, (1, 4, 4))]) is None
    assert np.array_equal(images[0].embeds.numpy(), embeds)
    fields = json.loads(ref.to_bytes())
    fields["shape"] = [8, 8]
    for bad in (b"garbage", json.dumps(fields).encode()):
        with pytest.raises(EpdError) as info:
            resolve_images(store, [bad])
        assert info.value.code == ErrorCode.INVALID_ARG
    store.clear()
    with pytest.raises(EpdError) as info:
        resolve_images(store, [ref.to_bytes()])
    assert info.value.code == ErrorCode.NOT_FOUND


def test_audio_references_become_one_audio_embeds_tensor_per_clip(store):
    """Clips (no grid, different lengths): vLLM's Qwen2-Audio takes a list of [tokens, hidden]."""
    clips = [np.full((n, 8), n, dtype=np.float32) for n in (25, 75)]
    refs = [
        store.put(content_key(bytes([n]), {}, "v1"), clip, EntryMeta(modality="audio"), lease=False)
        for n, clip in zip((1, 2), clips, strict=True)
    ]
    items, _ = resolve_images(store, [ref.to_bytes() for ref in refs])
    data = multi_modal_data(items)
    assert data is not None and list(data) == ["audio"] and list(data["audio"]) == ["audio_embeds"]
    assert [tuple(t.shape) for t in data["audio"]["audio_embeds"]] == [(25, 8), (75, 8)]
    assert multi_modal_uuids(items) == {"audio": [ref.key for ref in refs]}
    image = store.put(content_key(b"img", {}, "v1"), clips[0], EntryMeta(modality="audio", grid_thw=(1, 10, 10)),
                      lease=False)  # fmt: skip
    with pytest.raises(EpdError, match="not an image or video embedding with a grid, nor an audio one"):
        resolve_images(store, [image.to_bytes()])


def test_bfloat16_entries_are_read_as_bfloat16_bit_patterns(store):
    import torch

    values = torch.tensor([[1.5, -2.25], [0.0, 3.0]], dtype=torch.bfloat16)
    bits = values.view(torch.uint16).numpy()
    ref = store.put(content_key(b"bf16", {}, "v1"), bits, EntryMeta(dtype="bfloat16"), lease=False)
    with store.open_view(ref) as view:
        tensor = owned_float32(view, ref.dtype)
    assert tensor.dtype == torch.float32 and torch.equal(tensor, values.float())

"""The encoder instance in front of the store: single-flight, scopes, stale safety, TTL,
full-store waits, and its wire parsing. A real (temporary) LMDB store; the ``encode``
ensemble is a scripted coroutine."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from python_backends.encode.cached import (
    CachedEncoder,
    EncodedImage,
    Outcome,
    cache_namespace,
    parse_encoder_inputs,
)
from python_backends.errors import EpdError, ErrorCode
from python_backends.store import EmbeddingStore, KeyConfig, StoreConfig, StoreFullError
from tests.images import synthetic_image

HIDDEN = 8
ROWS = 4
ENTRY_BYTES = ROWS * HIDDEN * 4
KEYS = KeyConfig({"size": 336}, "encoder-v1")


class ScriptedEncode:
    """The ``encode`` ensemble: 4 rows per image from a seed of its bytes; counts calls."""

    def __init__(self, delay_s: float = 0.0, fail_on: bytes | None = None) -> None:
        self.calls: list[bytes] = []
        self.delay_s = delay_s
        self.fail_on = fail_on

    async def __call__(self, image: bytes) -> EncodedImage:
        self.calls.append(image)
        await asyncio.sleep(self.delay_s)
        if image == self.fail_on:
            raise EpdError("image 0 is not an image", ErrorCode.INVALID_ARG)
        seed = int.from_bytes(image[-4:], "little")
        return EncodedImage(np.random.default_rng(seed).standard_normal((ROWS, HIDDEN)).astype(np.float32), (1, 4, 4))


def _store(capacity_bytes: int = 1 << 20, **kwargs) -> Iterator[EmbeddingStore]:
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = tempfile.mkdtemp(prefix="epd-encoder-test-", dir=root)
    with EmbeddingStore(StoreConfig(path=path, capacity_bytes=capacity_bytes, merge_size=2, **kwargs)) as opened:
        yield opened
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def store() -> Iterator[EmbeddingStore]:
    yield from _store()


def test_thirty_two_concurrent_requests_for_one_new_image_encode_once(store):
    encode = ScriptedEncode(delay_s=0.05)
    encoder = CachedEncoder(store, KEYS, encode)

    async def run():
        return await asyncio.gather(*(encoder.reference(b"new-image", lease_owner=os.getpid()) for _ in range(32)))

    answers = asyncio.run(run())
    assert len(encode.calls) == 1
    assert sorted(a.outcome.value for a in answers).count("miss") == 1
    assert {a.reference.key for a in answers} == {answers[0].reference.key}
    metrics = store.metrics()
    assert metrics["encodes"] == 1 and metrics["joins"] + metrics["hits"] == 31
    assert metrics["active_leases"] == 32  # one per request, for the owner to release
    for answer in answers:
        assert store.release(answer.reference)
    assert store.metrics()["active_leases"] == 0


def test_two_encoders_share_the_node_cache_but_not_per_instance_caches(store):
    encode = ScriptedEncode()
    a, b = (
        CachedEncoder(store, KEYS, encode, namespace=cache_namespace("node", n)) for n in ("encoder_0", "encoder_1")
    )
    assert asyncio.run(a.reference(b"img")).outcome is Outcome.MISS
    assert asyncio.run(b.reference(b"img")).outcome is Outcome.HIT
    a, b = (
        CachedEncoder(store, KEYS, encode, namespace=cache_namespace("instance", n)) for n in ("encoder_0", "encoder_1")
    )
    assert asyncio.run(a.reference(b"img")).outcome is Outcome.MISS
    assert asyncio.run(b.reference(b"img")).outcome is Outcome.MISS
    assert asyncio.run(b.reference(b"img")).outcome is Outcome.HIT
    assert len(encode.calls) == 3
    with pytest.raises(ValueError):
        cache_namespace("cluster", "encoder_0")


def test_a_rebuilt_encoder_or_new_preprocessing_config_never_meets_old_embeddings(store, tmp_path: Path):
    config = tmp_path / "preprocessor_config.json"
    onnx = tmp_path / "model.onnx"
    config.write_text(json.dumps({"min_pixels": 3136, "max_pixels": 12845056}))
    onnx.write_bytes(b"encoder graph v1")
    encode = ScriptedEncode()

    def answer():
        encoder = CachedEncoder(store, KeyConfig.from_files(config, onnx), encode)
        return asyncio.run(encoder.reference(b"same image bytes"))

    first = answer()
    assert answer().outcome is Outcome.HIT  # same files: same key
    onnx.write_bytes(b"encoder graph v2")  # rebuilt encoder
    rebuilt = answer()
    config.write_text(json.dumps({"min_pixels": 3136, "max_pixels": 1003520}))  # new resize limit
    reconfigured = answer()
    assert rebuilt.outcome is Outcome.MISS and reconfigured.outcome is Outcome.MISS
    assert len({first.reference.key, rebuilt.reference.key, reconfigured.reference.key}) == 3
    assert len(encode.calls) == 3
    with pytest.raises(ValueError, match="does not exist"):
        KeyConfig.from_files(config, tmp_path / "missing.onnx")


def test_one_failing_image_fails_the_request_and_releases_the_others_leases(store):
    encode = ScriptedEncode(fail_on=b"bad")
    encoder = CachedEncoder(store, KEYS, encode)
    with pytest.raises(EpdError) as info:
        asyncio.run(encoder.references([b"good-1", b"bad", b"good-2"], lease_owner=os.getpid()))
    assert info.value.code is ErrorCode.INVALID_ARG
    metrics = store.metrics()
    assert metrics["active_leases"] == 0 and metrics["entries"] == 2 and metrics["producer_failures"] == 1
    # The failed claim is gone: the image can be tried again.
    encode.fail_on = None
    assert asyncio.run(encoder.reference(b"bad")).outcome is Outcome.MISS


def test_a_full_store_waits_for_leases_to_end_instead_of_failing():
    for store in _store(capacity_bytes=ENTRY_BYTES):
        encoder = CachedEncoder(store, KEYS, ScriptedEncode(), full_store_wait_s=5.0)
        held = asyncio.run(encoder.reference(b"held", lease_owner=os.getpid()))

        async def release_later(store=store, held=held):
            await asyncio.sleep(0.2)
            store.release(held.reference)

        async def run(encoder=encoder):
            _, answer = await asyncio.gather(release_later(), encoder.reference(b"next", lease_owner=os.getpid()))
            return answer

        answer = asyncio.run(run())
        assert answer.outcome is Outcome.MISS and store.metrics()["evictions"] == 1
        # Held for good: the wait is bounded and ends in a clear UNAVAILABLE.
        impatient = CachedEncoder(store, KEYS, ScriptedEncode(), full_store_wait_s=0.2)
        with pytest.raises(StoreFullError) as info:
            asyncio.run(impatient.reference(b"third", lease_owner=os.getpid()))
        assert info.value.code is ErrorCode.UNAVAILABLE
        assert store.metrics()["bytes_used"] <= ENTRY_BYTES


def test_entries_expire_after_the_ttl_unless_leased():
    for store in _store(ttl_s=0.2):
        encode = ScriptedEncode()
        encoder = CachedEncoder(store, KEYS, encode)
        asyncio.run(encoder.reference(b"old"))
        leased = asyncio.run(encoder.reference(b"kept", lease_owner=os.getpid()))
        time.sleep(0.3)
        assert asyncio.run(encoder.reference(b"kept")).outcome is Outcome.HIT  # leased: in use, stays
        assert asyncio.run(encoder.reference(b"old")).outcome is Outcome.MISS  # expired: encoded again
        assert store.metrics()["expirations"] == 1
        store.release(leased.reference)


def test_encoder_inputs_take_raw_or_base64_images_with_the_same_key():
    png = synthetic_image(32, 32, 0, "PNG")
    raw, _ = parse_encoder_inputs({"image": np.array([png], dtype=np.object_)}, 8, 1 << 20)
    b64, owner = parse_encoder_inputs(
        {"image": np.array([base64.b64encode(png)], dtype=np.object_), "lease_owner": np.array([42], dtype=np.int64)},
        8,
        1 << 20,
    )
    assert raw == b64 == [png] and owner == 42
    assert KEYS.key(raw[0]) == KEYS.key(b64[0])


@pytest.mark.parametrize(
    ("inputs", "fragment"),
    [
        ({}, "at least one"),
        ({"image": np.array([1, 2], dtype=np.uint8)}, "must be BYTES"),
        ({"image": np.array([b"not an image"], dtype=np.object_)}, "neither an encoded image"),
        ({"image": np.array([b""], dtype=np.object_)}, "empty"),
        ({"image": np.array([synthetic_image(8, 8, 0, "PNG")] * 9, dtype=np.object_)}, "above the limit of 8"),
        (
            {"image": np.array([synthetic_image(8, 8, 0, "PNG")], dtype=np.object_), "lease_owner": np.array([-1])},
            "lease_owner",
        ),
    ],
)
def test_bad_encoder_inputs_are_invalid_arg(inputs, fragment):
    with pytest.raises(EpdError) as info:
        parse_encoder_inputs(inputs, 8, 1 << 20)
    assert info.value.code is ErrorCode.INVALID_ARG and fragment in info.value.message


def test_a_video_key_covers_the_video_config_and_the_frame_sampling(tmp_path: Path):
    """Other frames (sampling) or another frame size (the video processor's config) are other
    embeddings: another key. An image's key does not depend on either, and the same bytes sent
    as an image and as a video are two keys."""
    config = tmp_path / "preprocessor_config.json"
    onnx = tmp_path / "model.onnx"
    config.write_text(json.dumps({"min_pixels": 3136, "max_pixels": 12845056}))
    onnx.write_bytes(b"encoder graph v1")
    media = b"the same bytes"

    def keys(sampling: dict[str, int]) -> tuple[str, str]:
        loaded = KeyConfig.from_files(config, onnx, sampling)
        return loaded.key(media), loaded.key(media, modality="video")

    image, video = keys({"max_frames": 768})
    assert image != video
    assert keys({"max_frames": 768}) == (image, video)
    image_capped, video_capped = keys({"max_frames": 32})
    assert image_capped == image and video_capped != video
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"max_pixels": 100352}))
    image_sized, video_sized = keys({"max_frames": 768})
    assert image_sized == image and video_sized not in (video, video_capped)
    # An audio clip's key is none of those (another modality over the same bytes), and others have none.
    assert KEYS.key(media, modality="audio") not in (KEYS.key(media), KEYS.key(media, modality="video"))
    with pytest.raises(EpdError, match="no content key for modality 'text'"):
        KEYS.key(media, modality="text")


def test_the_encoders_precision_and_image_backend_are_part_of_the_key(tmp_path: Path) -> None:
    """One graph file, other pixels (DALI) or other arithmetic (bf16): other embeddings, other keys."""
    config, encoder = tmp_path / "preprocessor_config.json", tmp_path / "model.onnx"
    config.write_text(json.dumps({"max_pixels": 100352}))
    encoder.write_bytes(b"graph")
    keys = {
        (backend, precision): KeyConfig.from_files(config, encoder, image_backend=backend, vit_precision=precision)
        for backend in ("torchvision", "dali")
        for precision in ("fp32", "bf16")
    }
    assert len({k.key(b"image") for k in keys.values()}) == 4

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
from tests.unit.bls_fakes import FakeOutput

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


class ScriptedEncodeMany(ScriptedEncode):
    """The cpu target's ``encode``: several images in one call as well (counted apart); a bad
    image fails the whole call naming its index within the call, as ``preprocess`` does."""

    def __init__(self, delay_s: float = 0.0, fail_on: bytes | None = None, many_error: EpdError | None = None) -> None:
        super().__init__(delay_s, fail_on)
        self.many_calls: list[list[bytes]] = []
        self.many_error = many_error  # an error of the call itself (not the input's)

    async def __call__(self, image: bytes) -> EncodedImage:
        if image == self.fail_on:  # one image a call: it is image[0] (the encoder renames it)
            self.calls.append(image)
            raise EpdError("image[0] cannot be read", ErrorCode.INVALID_ARG)
        return await super().__call__(image)

    async def encode_many(self, images) -> list[EncodedImage]:
        self.many_calls.append(list(images))
        await asyncio.sleep(self.delay_s)
        if self.many_error is not None:
            raise self.many_error
        if self.fail_on in images:
            raise EpdError(f"image[{list(images).index(self.fail_on)}] cannot be read", ErrorCode.INVALID_ARG)
        return [_embedding(image) for image in images]


def _embedding(image: bytes) -> EncodedImage:
    seed = int.from_bytes(image[-4:], "little")
    return EncodedImage(np.random.default_rng(seed).standard_normal((ROWS, HIDDEN)).astype(np.float32), (1, 4, 4))


def _coalescing(store: EmbeddingStore, encode: ScriptedEncodeMany) -> CachedEncoder:
    return CachedEncoder(store, KEYS, encode, encode_many=encode.encode_many)


def test_a_requests_misses_are_encoded_in_one_call_and_hits_and_joins_are_not(store):
    encode = ScriptedEncodeMany(delay_s=0.05)
    encoder = _coalescing(store, encode)
    asyncio.run(encoder.reference(b"stored"))  # one image alone: one call of its own
    assert encode.calls == [b"stored"] and encode.many_calls == []
    owner = os.getpid()

    async def run():
        # Another request starts encoding "busy" first: this request joins it.
        other = asyncio.create_task(encoder.reference(b"busy", lease_owner=owner))
        await asyncio.sleep(0.01)
        request = encoder.references([b"new-1", b"stored", b"busy", b"new-2", b"new-1"], lease_owner=owner)
        return await asyncio.gather(other, request)

    other, answers = asyncio.run(run())
    assert [a.outcome for a in answers] == [Outcome.MISS, Outcome.HIT, Outcome.JOIN, Outcome.MISS, Outcome.JOIN]
    assert encode.many_calls == [[b"new-1", b"new-2"]]  # this request's misses, once each, in one call
    assert encode.calls == [b"stored", b"busy"]  # the joined image was the other request's to encode
    assert answers[4].reference.key == answers[0].reference.key  # a repeat joins this request's own encode
    for image, answer in zip([b"new-1", b"new-2"], [answers[0], answers[3]], strict=True):
        np.testing.assert_array_equal(store.resolve(answer.reference), _embedding(image).embeds)
    assert store.metrics()["active_leases"] == 6
    for answer in [other, *answers]:
        assert store.release(answer.reference)


def test_a_bad_image_among_a_requests_misses_is_named_by_its_index(store):
    encode = ScriptedEncodeMany(fail_on=b"bad")
    encoder = _coalescing(store, encode)
    asyncio.run(encoder.reference(b"stored"))
    with pytest.raises(EpdError) as info:
        asyncio.run(encoder.references([b"stored", b"good-1", b"bad", b"good-2"], lease_owner=os.getpid()))
    # The call of the three misses named its image 1; one call per image then names it 2, its index
    # in the request.
    assert encode.many_calls == [[b"good-1", b"bad", b"good-2"]]
    assert sorted(encode.calls) == sorted([b"stored", b"good-1", b"bad", b"good-2"])
    assert info.value.code is ErrorCode.INVALID_ARG and info.value.message == "image[2] cannot be read"
    metrics = store.metrics()
    assert metrics["active_leases"] == 0 and metrics["entries"] == 3 and metrics["producer_failures"] == 1
    encode.fail_on = None  # the failed claim is gone: the image can be tried again
    assert asyncio.run(encoder.reference(b"bad")).outcome is Outcome.MISS


def test_a_failed_call_that_is_not_the_inputs_fails_every_miss_without_retrying(store):
    encode = ScriptedEncodeMany(many_error=EpdError("encode is not ready", ErrorCode.UNAVAILABLE))
    encoder = _coalescing(store, encode)
    with pytest.raises(EpdError) as info:
        asyncio.run(encoder.references([b"a", b"b"], lease_owner=os.getpid()))
    assert info.value.code is ErrorCode.UNAVAILABLE and encode.calls == []
    metrics = store.metrics()
    assert metrics["active_leases"] == 0 and metrics["entries"] == 0 and metrics["producer_failures"] == 2
    encode.many_error = None
    assert [a.outcome for a in asyncio.run(encoder.references([b"a", b"b"]))] == [Outcome.MISS] * 2


def test_split_encoded_splits_the_concatenated_embeddings_by_grid():
    from python_backends.encode.cached import split_encoded

    grid = np.array([[1, 2, 4], [1, 4, 4], [2, 2, 2]], dtype=np.int64)  # 2, 4 and 2 tokens (merge 2)
    embeds = np.arange(8 * 3, dtype=np.float32).reshape(1, 8, 3)
    parts = split_encoded(embeds, grid, 2, 3)
    assert [p.grid_thw for p in parts] == [(1, 2, 4), (1, 4, 4), (2, 2, 2)]
    np.testing.assert_array_equal(np.concatenate([p.embeds for p in parts]), embeds[0])
    assert [p.embeds.shape for p in parts] == [(2, 3), (4, 3), (2, 3)]
    for bad_grid, images in ((grid, 2), (grid[:2], 2)):  # a grid per image; rows per grid
        with pytest.raises(EpdError) as info:
            split_encoded(embeds, bad_grid, 2, images)
        assert info.value.code is ErrorCode.INTERNAL


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


class _Response:
    def __init__(self, outputs: dict[str, np.ndarray]) -> None:
        self._outputs = outputs

    def has_error(self) -> bool:
        return False

    def output_tensors(self) -> list[FakeOutput]:
        return [FakeOutput(name, array) for name, array in self._outputs.items()]


def test_bls_encode_sends_the_wire_shapes_of_each_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu: a request's images as BYTES [n] in one ``encode`` request, the concatenated embeddings
    split by grid; a video's rows [t*h*w, width] + grid [1, 3] to ``vit_encoder``. gpu
    (``encode_one_image``): one image as UINT8 [1, bytes], no ``encode_many``."""
    import triton_python_backend_utils as pb_utils

    from python_backends import contract
    from python_backends.runtime.model_params import ModelParameters
    from python_backends.triton_edge.bls import BlsEncode

    sent: list[tuple[str, dict[str, np.ndarray]]] = []
    grid = np.array([[1, 2, 4], [1, 4, 4]], dtype=np.int64)  # 2 + 4 tokens (merge 2)
    embeds = np.arange(6 * 3, dtype=np.float32).reshape(1, 6, 3)

    class Request:
        def __init__(self, model_name: str, inputs: list, requested_output_names: list[str]) -> None:
            sent.append((model_name, {t.name(): t.as_numpy() for t in inputs}))
            self.model = model_name

        def exec(self) -> _Response:
            if self.model == contract.VIT_ENCODER_MODEL:
                return _Response({contract.IMAGE_EMBEDS: embeds[:, :2]})
            images = len(sent[-1][1][contract.IMAGE])
            return _Response({contract.IMAGE_EMBEDS: embeds if images == 2 else embeds[:, :2],
                              contract.IMAGE_GRID_THW: grid[:images]})

    monkeypatch.setattr(pb_utils, "InferenceRequest", Request, raising=False)
    cpu = BlsEncode.from_params(ModelParameters("encoder_0", {contract.SPATIAL_MERGE_SIZE: "2"}))
    assert cpu.encode_many is not None and not cpu.one_image
    try:
        parts = asyncio.run(cpu.encode_many([b"one", b"two"]))
        model, inputs = sent[-1]
        assert model == contract.ENCODE_MODEL and inputs[contract.IMAGE].dtype == np.object_
        assert inputs[contract.IMAGE].tolist() == [b"one", b"two"]
        assert [p.grid_thw for p in parts] == [(1, 2, 4), (1, 4, 4)]
        np.testing.assert_array_equal(np.concatenate([p.embeds for p in parts]), embeds[0])
        single = asyncio.run(cpu(b"one"))
        assert sent[-1][1][contract.IMAGE].shape == (1,) and single.grid_thw == (1, 2, 4)
        pixels = np.zeros((8, 1176), np.float32)
        out = asyncio.run(cpu.encode_pixels(pixels, np.array([[2, 2, 2]])))
        model, inputs = sent[-1]
        assert model == contract.VIT_ENCODER_MODEL and out.shape == (1, 2, 3)
        assert inputs[contract.PIXEL_VALUES].shape == (8, 1176) and inputs[contract.IMAGE_GRID_THW].shape == (1, 3)
    finally:
        cpu.shutdown()
    gpu = BlsEncode.from_params(ModelParameters("encoder_0", {contract.ENCODE_ONE_IMAGE_KEY: "True"}))
    assert gpu.one_image and gpu.encode_many is None
    try:
        grid = grid[:1]
        encoded = asyncio.run(gpu(b"\x01\x02\x03"))
        image = sent[-1][1][contract.IMAGE]
        assert image.dtype == np.uint8 and image.shape == (1, 3)
        assert encoded.grid_thw == (1, 2, 4) and encoded.embeds.shape == (2, 3)
    finally:
        gpu.shutdown()

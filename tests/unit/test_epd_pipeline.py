"""The epd orchestrator with a scripted fake of the stages and a real (temporary) store."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from python_backends.encode.cached import CachedEncoder, EncodedImage, cache_namespace
from python_backends.engines.generation import GenerationChunk
from python_backends.epd.pipeline import EpdPipeline
from python_backends.errors import EpdError, ErrorCode
from python_backends.request.generate import CachedImage, GenerateRequest
from python_backends.request.parameters import RequestParameters
from python_backends.scaleout.routing import home
from python_backends.store import EmbeddingStore, KeyConfig, StoreConfig, parse_reference

KEYS = KeyConfig({"size": 336}, "encoder-v1")
HIDDEN = 8


ENCODERS = ("encoder_0", "encoder_1")


@dataclass
class FakeStages:
    """Scripted stages: encode gives 4 rows per image, prefill token 100, decode 101..
    The encoder models are real :class:`CachedEncoder` objects on the test's store whose
    ``encode`` (the ensemble) is scripted."""

    store: EmbeddingStore
    scope: str = "node"
    total_tokens: int = 4
    fail: str = ""  # stage to fail
    encoded: list[bytes] = field(default_factory=list)
    prefill_refs: list[list[bytes]] = field(default_factory=list)
    decode_refs: list[list[bytes]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    discarded: list[str] = field(default_factory=list)
    hang_decode: bool = False
    routed: list[str] = field(default_factory=list)
    encoders: dict[str, CachedEncoder] = field(default_factory=dict)
    encoded_videos: list[bytes] = field(default_factory=list)
    encoded_audios: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ENCODERS:
            namespace = cache_namespace(self.scope, name)
            self.encoders[name] = CachedEncoder(
                self.store, KEYS, self.encode, namespace=namespace, encode_video=self.encode_video,
                encode_audio=self.encode_audio,
            )  # fmt: skip

    async def encode_reference(
        self, encoder: str, image: bytes, lease_owner: int, tenant: str | None = None, modality: str = "image"
    ) -> tuple[bytes, bool]:
        self.routed.append(encoder)
        answer = await self.encoders[encoder].reference(image, lease_owner, tenant, modality)
        return answer.reference.to_bytes(), answer.cache_hit

    async def encode(self, image: bytes) -> EncodedImage:
        self.encoded.append(image)
        if image == b"corrupt":
            raise EpdError("image[0] cannot be read: corrupt header", ErrorCode.INVALID_ARG)
        if self.fail == "encode":
            raise EpdError("image 0 is not an image", ErrorCode.INVALID_ARG)
        seed = int.from_bytes(image[:4].ljust(4, b"\0"), "little")
        return EncodedImage(np.random.default_rng(seed).standard_normal((4, HIDDEN)).astype(np.float32), (1, 4, 4))

    async def encode_video(self, video: bytes) -> EncodedImage:
        """A video: 8 rows (grid 2 x 4 x 4, merge 2); "bad-video" fails as the preprocessing does."""
        self.encoded_videos.append(video)
        if video == b"bad-video":
            raise EpdError("video[0] uses codec h264, which this target does not decode", ErrorCode.INVALID_ARG)
        seed = int.from_bytes(video[:4].ljust(4, b"\0"), "little")
        return EncodedImage(np.random.default_rng(seed).standard_normal((8, HIDDEN)).astype(np.float32), (2, 4, 4))

    async def encode_audio(self, clip: bytes) -> EncodedImage:
        """A clip: 6 rows, no grid; "bad-clip" fails as the decode does."""
        self.encoded_audios.append(clip)
        if clip == b"bad-clip":
            raise EpdError("audio[0]: not an audio file FFmpeg can read", ErrorCode.INVALID_ARG)
        seed = int.from_bytes(clip[:4].ljust(4, b"\0"), "little")
        return EncodedImage(np.random.default_rng(seed).standard_normal((6, HIDDEN)).astype(np.float32), None)

    async def prefill(self, prompt, references, sampling) -> GenerationChunk:
        self.prefill_refs.append(list(references))
        if self.fail == "prefill":
            raise RuntimeError("boom")
        done = sampling.get("max_tokens", 16) <= 1
        return GenerationChunk("a", [100], 7, 1, "length" if done else None, True, '' if done else '{"t": 1}')

    async def decode(self, request_id, references, transfer_params, sampling, stream):
        self.decode_refs.append(list(references))
        if self.fail == "decode":
            raise EpdError("decode could not load KV transfer", ErrorCode.INVALID_ARG)
        assert transfer_params == '{"t": 1}'
        for n in range(2, self.total_tokens + 1):
            if self.hang_decode and n == 3:
                await asyncio.sleep(3600)
            last = n == self.total_tokens
            yield GenerationChunk("b", [99 + n], 0, n, "length" if last else None, last)

    async def abort_decode(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def discard_transfer(self, transfer_params: str) -> None:
        self.discarded.append(transfer_params)


@pytest.fixture
def store() -> Iterator[EmbeddingStore]:
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = tempfile.mkdtemp(prefix="epd-pipeline-test-", dir=root)
    with EmbeddingStore(StoreConfig(path=path, capacity_bytes=1 << 20, merge_size=2)) as opened:
        yield opened
    shutil.rmtree(path, ignore_errors=True)


def request(images: list[bytes], stream: bool = True, max_tokens: int = 4) -> GenerateRequest:
    return GenerateRequest(
        prompt="<|image_pad|>" * len(images) + "hi",
        images=images,
        stream=stream,
        sampling={"max_tokens": max_tokens, "temperature": 0.0},
        exclude_input_in_output=stream,
    )


def make_pipeline(stages: FakeStages) -> EpdPipeline:
    return EpdPipeline(stages.store, stages, KEYS, ENCODERS, node_cache=stages.scope == "node")


def collect(pipeline: EpdPipeline, req: GenerateRequest, request_id: str = "r1", encoder: str | None = None):
    async def run():
        return [chunk async for chunk in pipeline.run(req, request_id, encoder)]

    return asyncio.run(run())


def test_streams_first_token_then_decode_and_releases_leases(store):
    stages = FakeStages(store)
    chunks = collect(make_pipeline(stages), request([b"img-a", b"img-b"]))
    assert [c.token_ids for c in chunks] == [[100], [101], [102], [103]]
    assert chunks[-1].finished and chunks[-1].num_output_tokens == 4
    assert set(chunks[-1].timings_ms) == {"hash", "lookup", "encode", "prefill", "decode"}
    assert len(stages.encoded) == 2 and chunks[-1].cache_hits == 0
    # Only references travel: each is a small signed JSON naming its entry.
    refs = [parse_reference(r) for r in stages.prefill_refs[0]]
    assert [r.shape for r in refs] == [(4, HIDDEN), (4, HIDDEN)]
    assert all(len(r) <= 1024 for r in stages.prefill_refs[0])
    assert stages.decode_refs == stages.prefill_refs
    assert store.metrics()["active_leases"] == 0


def test_leases_are_released_before_the_last_chunk_is_handed_on(store):
    # A client reading the store right after its last answer must find no lease of its request.
    pipeline = make_pipeline(FakeStages(store))

    async def leases_seen_per_chunk() -> list[int]:
        return [store.metrics()["active_leases"] async for _ in pipeline.run(request([b"img-a", b"img-b"]), "r1")]

    seen = asyncio.run(leases_seen_per_chunk())
    assert seen[0] == 2 and seen[-1] == 0


def test_repeated_image_is_a_cache_hit(store):
    stages = FakeStages(store)
    pipeline = make_pipeline(stages)
    collect(pipeline, request([b"img-a"]))
    chunks = collect(pipeline, request([b"img-a", b"img-a"]))
    assert len(stages.encoded) == 1
    assert chunks[-1].cache_hits == 1  # one distinct image, found in the store
    assert chunks[-1].fast_hits == 1 and len(stages.routed) == 1  # by epd's lookup, no encoder call
    assert stages.prefill_refs[1][0] != b"" and parse_reference(stages.prefill_refs[1][0]).key == parse_reference(
        stages.prefill_refs[1][1]
    ).key
    assert store.metrics()["active_leases"] == 0


def test_concurrent_requests_for_one_image_encode_once(store):
    stages = FakeStages(store)
    pipeline = make_pipeline(stages)

    async def run_all():
        async def one(i):
            return [c async for c in pipeline.run(request([b"same"]), f"r{i}")]

        return await asyncio.gather(*(one(i) for i in range(4)))

    results = asyncio.run(run_all())
    assert all(r[-1].finished for r in results)
    assert len(stages.encoded) == 1
    assert store.metrics()["active_leases"] == 0


def test_not_streaming_gives_one_response_with_prompt(store):
    chunks = collect(make_pipeline(FakeStages(store)), request([], stream=False))
    assert len(chunks) == 1
    assert chunks[0].token_ids == [100, 101, 102, 103]
    assert chunks[0].text == "hi" + "a" + "bbb"


def test_max_tokens_one_is_served_by_prefill_alone(store):
    stages = FakeStages(store)
    chunks = collect(make_pipeline(stages), request([b"x"], max_tokens=1))
    assert [c.token_ids for c in chunks] == [[100]]
    assert chunks[0].finish_reason == "length" and stages.decode_refs == []


@pytest.mark.parametrize(
    ("stage", "code", "fragment"),
    [
        ("encode", ErrorCode.INVALID_ARG, "encode: image 0 is not an image"),
        ("prefill", ErrorCode.INTERNAL, "prefill failed: RuntimeError"),
        ("decode", ErrorCode.INVALID_ARG, "decode: decode could not load KV transfer"),
    ],
)
def test_a_stage_failure_is_one_coded_error_and_leaks_nothing(store, stage, code, fragment):
    stages = FakeStages(store, fail=stage)
    with pytest.raises(EpdError) as info:
        collect(make_pipeline(stages), request([b"img-a"]))
    assert info.value.code == code and fragment in info.value.message
    metrics = store.metrics()
    assert metrics["active_leases"] == 0
    if stage == "encode":
        assert metrics["producer_failures"] == 1 and metrics["entries"] == 0
        # The failed claim is cleared: a later request encodes again.
        stages.fail = ""
        collect(make_pipeline(stages), request([b"img-a"]))
        assert len(stages.encoded) == 2


def test_cancelled_stream_aborts_decode_and_releases_leases(store):
    stages = FakeStages(store, total_tokens=6, hang_decode=True)
    pipeline = make_pipeline(stages)

    async def run():
        got = []
        gen = pipeline.run(request([b"img-a"]), "cancel-me")
        async for chunk in gen:
            got.append(chunk)
            if len(got) == 2:  # first token + one decode token, then the client goes away
                break
        await gen.aclose()
        return got

    got = asyncio.run(run())
    assert len(got) == 2
    assert stages.aborted == ["cancel-me"]
    assert store.metrics()["active_leases"] == 0


def test_client_gone_after_the_first_token_discards_the_transfer(store):
    stages = FakeStages(store)
    pipeline = make_pipeline(stages)

    async def run():
        gen = pipeline.run(request([b"img-a"]), "early")
        first = await gen.__anext__()
        await gen.aclose()
        return first

    first = asyncio.run(run())
    assert first.token_ids == [100]
    assert stages.discarded == ['{"t": 1}'] and stages.decode_refs == [] and stages.aborted == []
    assert store.metrics()["active_leases"] == 0


def test_images_go_to_their_home_encoder_or_the_pinned_one(store):
    stages = FakeStages(store)
    pipeline = make_pipeline(stages)
    images = [f"img-{i}".encode() for i in range(8)]
    collect(pipeline, request(images[:4]))
    homes = [pipeline.encoder_for(KEYS.key(image)) for image in images[:4]]
    assert sorted(stages.routed) == sorted(homes)
    assert homes == [home(ENCODERS, KEYS.key(image)) for image in images[:4]]  # the one rule, as remote servers
    assert set(pipeline.encoder_for(KEYS.key(image)) for image in images) == set(ENCODERS)  # both get work
    stages.routed.clear()
    collect(pipeline, request(images[4:6]), encoder="encoder_1")
    assert stages.routed == ["encoder_1", "encoder_1"]
    with pytest.raises(EpdError) as info:
        collect(pipeline, request(images[6:7]), encoder="encoder_9")
    assert info.value.code is ErrorCode.INVALID_ARG and "encoder_0, encoder_1" in info.value.message


@dataclass
class SelfRoutingStages(FakeStages):
    """Stages that route images themselves, as the remote encoders do: told no encoder unless pinned."""

    routes_images: bool = True

    async def encode_reference(self, encoder, image, lease_owner, tenant=None, modality="image"):
        self.routed.append(encoder)
        answer = await self.encoders[encoder or "encoder_0"].reference(image, lease_owner, tenant, modality)
        return answer.reference.to_bytes(), answer.cache_hit


def test_stages_that_route_images_get_no_pick_only_a_pin(store):
    stages = SelfRoutingStages(store)
    pipeline = make_pipeline(stages)
    collect(pipeline, request([b"img-a", b"img-b"]))
    assert stages.routed == [None, None]  # one-directional: no pick made, none discarded
    stages.routed.clear()
    collect(pipeline, request([b"img-c"]), encoder="encoder_1")
    assert stages.routed == ["encoder_1"]
    stages.routed.clear()
    collect(pipeline, video_request([], [b"vid-1"]))  # videos are not routed by the stage: picked here
    assert stages.routed == [home(ENCODERS, KEYS.key(b"vid-1", modality="video"))]
    assert store.metrics()["active_leases"] == 0


@pytest.mark.parametrize(("scope", "encodes"), [("node", 1), ("instance", 2)])
def test_an_image_moved_to_another_encoder_is_encoded_again_only_with_per_instance_caches(store, scope, encodes):
    stages = FakeStages(store, scope=scope)
    pipeline = make_pipeline(stages)
    collect(pipeline, request([b"img-a"]), encoder="encoder_0")
    chunks = collect(pipeline, request([b"img-a"]), encoder="encoder_1")
    assert len(stages.encoded) == encodes
    assert chunks[-1].cache_hits == (1 if scope == "node" else 0)
    assert store.metrics()["active_leases"] == 0


def test_a_pre_encoded_image_is_used_by_mm_hash_and_an_unknown_one_is_not_found(store):
    stages = FakeStages(store)
    pipeline = make_pipeline(stages)
    warm = asyncio.run(stages.encoders["encoder_0"].reference(b"catalogue-1"))  # warm-up: no lease
    assert warm.reference.lease_id == "" and store.metrics()["active_leases"] == 0
    chunks = collect(pipeline, request([CachedImage(warm.reference.mm_hash)]))  # type: ignore[list-item]
    assert chunks[-1].cache_hits == 1 and stages.encoded == [b"catalogue-1"]
    assert parse_reference(stages.prefill_refs[-1][0]).key == warm.reference.key
    with pytest.raises(EpdError) as info:
        collect(pipeline, request([CachedImage("ab" * 32)]))  # type: ignore[list-item]
    assert info.value.code is ErrorCode.NOT_FOUND and "send the image bytes" in info.value.message
    assert store.metrics()["active_leases"] == 0


def test_pinned_encoder_comes_from_triton_request_parameters():
    assert RequestParameters.parse(None).encoder is None and RequestParameters.parse("{}").encoder is None
    assert RequestParameters.parse('{"encoder": "encoder_1", "other": 3}').encoder == "encoder_1"
    with pytest.raises(EpdError):
        RequestParameters.parse('{"encoder": 3}')


def test_an_encoder_error_names_the_image_by_its_index_in_the_request(store):
    stages = FakeStages(store)
    with pytest.raises(EpdError) as info:
        collect(make_pipeline(stages), request([b"img-a", b"corrupt"]))
    assert info.value.code is ErrorCode.INVALID_ARG
    assert info.value.message == "encode: image[1] cannot be read: corrupt header"
    assert store.metrics()["active_leases"] == 0


def video_request(images: list[bytes], videos: list[bytes]) -> GenerateRequest:
    return GenerateRequest(
        prompt="<|image_pad|>" * len(images) + "<|video_pad|>" * len(videos) + "hi",
        images=images,  # type: ignore[arg-type]
        stream=True,
        sampling={"max_tokens": 4, "temperature": 0.0},
        exclude_input_in_output=True,
        videos=videos,
    )


def test_videos_are_encoded_stored_and_referenced_like_images(store):
    """Images and videos in one request: each through its encoder as its modality, references in
    prompt order (images, then videos) to prefill and decode; the same request again encodes
    nothing (a stored video skips decode and encode), and a video's key is not its bytes' image key."""
    stages = FakeStages(store)
    pipeline = make_pipeline(stages)
    req = video_request([b"img-a"], [b"vid-1", b"vid-2"])
    first = collect(pipeline, req)
    assert first[-1].finished and stages.encoded == [b"img-a"] and sorted(stages.encoded_videos) == [b"vid-1", b"vid-2"]
    refs = [parse_reference(r) for r in stages.prefill_refs[0]]
    assert [r.modality for r in refs] == ["image", "video", "video"]
    assert [r.grid_thw for r in refs] == [(1, 4, 4), (2, 4, 4), (2, 4, 4)]
    assert stages.decode_refs[0] == stages.prefill_refs[0]
    second = collect(pipeline, req, "r2")
    assert len(stages.encoded) == 1 and len(stages.encoded_videos) == 2  # 0 encodes the second time
    assert second[-1].cache_hits == 3 and second[-1].fast_hits == 3
    assert [parse_reference(r).key for r in stages.prefill_refs[1]] == [r.key for r in refs]
    # The same bytes sent as an image and as a video are two entries.
    assert KEYS.key(b"vid-1") != KEYS.key(b"vid-1", modality="video")
    assert store.metrics()["active_leases"] == 0


def test_a_bad_video_is_named_by_its_index_and_leaks_nothing(store):
    stages = FakeStages(store)
    with pytest.raises(EpdError) as info:
        collect(make_pipeline(stages), video_request([b"img-a"], [b"vid-1", b"bad-video"]))
    assert info.value.code is ErrorCode.INVALID_ARG
    assert "video[1] uses codec h264" in info.value.message, info.value.message
    assert store.metrics()["active_leases"] == 0


def audio_request(videos: list[bytes], audios: list[bytes]) -> GenerateRequest:
    return dataclasses.replace(video_request([], videos), prompt="<|AUDIO|>" * len(audios) + "hi", audios=audios)


def test_audio_clips_are_encoded_stored_and_referenced_like_images(store):
    """Clips (an audio checkpoint's epd): each through its encoder as audio, references with no grid
    and the clip's rows as placeholders, after the request's videos; from the store the second time."""
    stages = FakeStages(store)
    pipeline = make_pipeline(stages)
    req = audio_request([b"vid-1"], [b"clip-1", b"clip-2"])
    first = collect(pipeline, req)
    assert first[-1].finished and sorted(stages.encoded_audios) == [b"clip-1", b"clip-2"]
    refs = [parse_reference(r) for r in stages.prefill_refs[0]]
    assert [(r.modality, r.grid_thw) for r in refs] == [("video", (2, 4, 4)), ("audio", None), ("audio", None)]
    assert [r.num_placeholders for r in refs[1:]] == [6, 6]
    assert stages.decode_refs[0] == stages.prefill_refs[0]
    second = collect(pipeline, req, "r2")
    assert len(stages.encoded_audios) == 2 and second[-1].cache_hits == 3
    assert KEYS.key(b"clip-1", modality="audio") not in (KEYS.key(b"clip-1"), KEYS.key(b"clip-1", modality="video"))
    assert store.metrics()["active_leases"] == 0


def test_a_bad_clip_is_named_by_its_index_among_the_clips(store):
    stages = FakeStages(store)
    with pytest.raises(EpdError) as info:
        collect(make_pipeline(stages), audio_request([b"vid-1"], [b"clip-1", b"bad-clip"]))
    assert info.value.code is ErrorCode.INVALID_ARG
    assert info.value.message == "encode: audio[1]: not an audio file FFmpeg can read", info.value.message
    assert store.metrics()["active_leases"] == 0

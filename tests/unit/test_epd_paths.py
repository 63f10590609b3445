"""epd's path choice (python_backends/epd/pipeline.py) and its colocated path, with the scripted
stages of test_epd_pipeline.py, a scripted colocated engine and a real (temporary) store."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from python_backends.contract import COLOCATED_PATH, DISAGGREGATED_PATH
from python_backends.engines.generation import GenerationChunk
from python_backends.epd import colocated as colocated_path
from python_backends.epd.path_cost import Decision, PathCostModel
from python_backends.epd.pipeline import EpdPipeline
from python_backends.errors import EpdError, ErrorCode, invalid_arg
from python_backends.request.generate import GenerateRequest
from python_backends.request.parameters import RequestParameters
from tests.images import synthetic_image
from tests.unit import test_epd_pipeline
from tests.unit.test_epd_pipeline import ENCODERS, KEYS, FakeStages, request

store = test_epd_pipeline.store  # the same temporary-store fixture

PHOTO = synthetic_image(64, 48, seed=1)
OTHER = synthetic_image(64, 48, seed=2)


@dataclass
class FakeEngine:
    """Scripted colocated engine: tokens 200.. ; records the vLLM prompts it was given."""

    prompts: list[dict[str, Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    hang_after_first: bool = False
    # vLLM's processor cache: the uuids of media items it processed (a None item names one).
    held: set[str] = field(default_factory=set)
    evict_before_next: bool = False  # the cache drops everything between the check and the request

    def holds_media(self, uuid: str) -> bool:
        return uuid in self.held

    async def generate_prompt(self, prompt: dict[str, Any], req: GenerateRequest, request_id: str):
        images = prompt.get("multi_modal_data", {}).get("image")
        if isinstance(images, list):  # media (not embeddings)
            if self.evict_before_next:
                self.held.clear()
                self.evict_before_next = False
            uuids = prompt["multi_modal_uuids"]["image"]
            for item, uuid in zip(images, uuids, strict=True):
                if item is None and uuid not in self.held:  # vLLM 0.32's refusal, as LlmEngine raises it
                    raise invalid_arg("request rejected by the engine: Cache miss for key: data is not provided")
            self.held.update(uuids)
        self.prompts.append(prompt)
        total = req.sampling["max_tokens"]
        for n in range(1, total + 1):
            if self.hang_after_first and n == 2:
                await asyncio.sleep(3600)
            last = n == total
            yield GenerationChunk("c", [199 + n], 7, n, "length" if last else None, last)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def pipeline(stages: FakeStages, engine: FakeEngine | None, policy: str = "adaptive", **kw: Any) -> EpdPipeline:
    return EpdPipeline(stages.store, stages, KEYS, ENCODERS, colocated=engine, policy=policy, **kw)


def run(p: EpdPipeline, req: GenerateRequest, path: str | None = None, request_id: str = "r1"):
    async def go():
        return [c async for c in p.run(req, request_id, path=path)]

    return asyncio.run(go())


def test_colocated_sends_new_media_to_the_engine(store):
    stages, engine = FakeStages(store), FakeEngine()
    chunks = run(pipeline(stages, engine), request([PHOTO]), path=COLOCATED_PATH)
    assert [c.token_ids for c in chunks] == [[200], [201], [202], [203]]
    assert chunks[-1].serving_path == COLOCATED_PATH and not chunks[0].serving_path
    assert {"hash", "lookup", "prefill", "decode"} == set(chunks[-1].timings_ms)
    (image,) = engine.prompts[0]["multi_modal_data"]["image"]
    assert isinstance(image, Image.Image) and image.size == (64, 48)
    assert engine.prompts[0]["multi_modal_uuids"] == {"image": [KEYS.key(PHOTO)]}  # vLLM does not hash it again
    assert stages.encoded == [] and stages.prefill_refs == []  # no encoder, no prefill/decode
    assert store.metrics()["active_leases"] == 0


def test_colocated_sends_media_the_engine_holds_as_none(store, monkeypatch):
    stages, engine = FakeStages(store), FakeEngine()
    p = pipeline(stages, engine)
    decoded: list[int] = []
    real_decode = colocated_path.decode_images

    def counted_decode(media: list[bytes], limits: Any) -> list[Image.Image]:
        decoded.append(len(media))
        return real_decode(media, limits)

    monkeypatch.setattr(colocated_path, "decode_images", counted_decode)
    run(p, request([PHOTO]), path=COLOCATED_PATH)
    chunks = run(p, request([PHOTO, OTHER]), path=COLOCATED_PATH)
    assert [c.token_ids for c in chunks] == [[200], [201], [202], [203]]
    photo, other = engine.prompts[1]["multi_modal_data"]["image"]
    assert photo is None and isinstance(other, Image.Image)  # only the new one decoded
    assert decoded == [1, 1]
    assert engine.prompts[1]["multi_modal_uuids"] == {"image": [KEYS.key(PHOTO), KEYS.key(OTHER)]}
    assert stages.encoded == [] and store.metrics()["active_leases"] == 0


def test_media_the_engine_dropped_after_the_check_are_sent_again(store):
    stages, engine = FakeStages(store), FakeEngine()
    p = pipeline(stages, engine)
    run(p, request([PHOTO]), path=COLOCATED_PATH)
    engine.evict_before_next = True
    chunks = run(p, request([PHOTO]), path=COLOCATED_PATH, request_id="r2")
    assert [c.token_ids for c in chunks] == [[200], [201], [202], [203]] and chunks[-1].finish_reason == "length"
    assert len(engine.prompts) == 2  # the refused attempt reached no generation
    (image,) = engine.prompts[1]["multi_modal_data"]["image"]
    assert isinstance(image, Image.Image)
    assert engine.aborted == [] and store.metrics()["active_leases"] == 0


def test_a_stored_image_goes_as_embeddings_even_when_the_engine_holds_its_media(store):
    """The engine's processor cache holds pixels, not embeddings: a store hit never relies on it."""
    stages, engine = FakeStages(store), FakeEngine()
    p = pipeline(stages, engine)
    run(p, request([PHOTO]), path=COLOCATED_PATH)  # the engine holds its media
    run(p, request([PHOTO]), path=DISAGGREGATED_PATH)  # now the store holds its embeddings
    run(p, request([PHOTO]), path=COLOCATED_PATH)
    assert set(engine.prompts[-1]["multi_modal_data"]["image"]) == {"image_embeds", "image_grid_thw"}
    assert len(stages.encoded) == 1


def test_colocated_hands_store_hits_over_as_embeddings(store):
    stages, engine = FakeStages(store), FakeEngine()
    p = pipeline(stages, engine)
    run(p, request([PHOTO]), path=DISAGGREGATED_PATH)  # stores the embeddings
    chunks = run(p, request([PHOTO]), path=COLOCATED_PATH)
    assert len(stages.encoded) == 1 and chunks[-1].cache_hits == 1  # a hit never re-encodes
    data = engine.prompts[0]["multi_modal_data"]["image"]
    assert data["image_embeds"].shape == (4, 8) and data["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert engine.prompts[0]["multi_modal_uuids"] == {"image": [KEYS.key(PHOTO)]}
    expected = asyncio.run(FakeStages(store).encode(PHOTO)).embeds  # the fake encodes from the bytes alone
    assert torch.equal(data["image_embeds"], torch.from_numpy(expected))
    assert store.metrics()["active_leases"] == 0


def test_colocated_with_some_images_stored_encodes_the_rest_first(store):
    stages, engine = FakeStages(store), FakeEngine()
    p = pipeline(stages, engine)
    run(p, request([PHOTO]), path=DISAGGREGATED_PATH)
    chunks = run(p, request([PHOTO, OTHER]), path=COLOCATED_PATH)
    assert len(stages.encoded) == 2 and "encode" in chunks[-1].timings_ms
    data = engine.prompts[0]["multi_modal_data"]["image"]
    assert data["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]  # one form for all images
    assert store.metrics()["active_leases"] == 0


def test_with_the_encoders_encoding_new_images_go_to_the_encoders_and_the_engine_gets_embeddings(store):
    """The E|PD topology (colocated_encodes = encoders): the engine never encodes, even when every
    image is new, and the stored embeddings serve the next request without another encode."""
    stages, engine = FakeStages(store), FakeEngine()
    p = pipeline(stages, engine, colocated_encodes="encoders")
    first = run(p, request([PHOTO, OTHER]), path=COLOCATED_PATH)
    assert len(stages.encoded) == 2 and "encode" in first[-1].timings_ms
    assert stages.prefill_refs == []  # prefill and decode are the colocated engine's
    data = engine.prompts[0]["multi_modal_data"]["image"]
    assert set(data) == {"image_embeds", "image_grid_thw"} and data["image_grid_thw"].tolist() == [[1, 4, 4]] * 2
    again = run(p, request([PHOTO]), path=COLOCATED_PATH, request_id="r2")
    assert len(stages.encoded) == 2 and again[-1].cache_hits == 1
    assert store.metrics()["active_leases"] == 0


def test_forcing_disaggregated_under_adaptive_is_obeyed(store):
    stages, engine = FakeStages(store), FakeEngine()
    p = pipeline(stages, engine)
    for i in range(3):
        chunks = run(p, request([PHOTO]), path=DISAGGREGATED_PATH, request_id=f"r{i}")
        assert chunks[-1].serving_path == DISAGGREGATED_PATH and chunks[0].token_ids == [100]
    assert engine.prompts == []


@pytest.mark.parametrize("policy", ["adaptive", COLOCATED_PATH])
def test_a_pinned_encoder_takes_the_disaggregated_path_unless_a_path_is_forced(store, policy):
    stages, engine = FakeStages(store), FakeEngine()
    p = pipeline(stages, engine, policy=policy)

    async def go(path: str | None):
        return [c async for c in p.run(request([PHOTO]), "r1", encoder=ENCODERS[1], path=path)]

    assert asyncio.run(go(None))[-1].serving_path == DISAGGREGATED_PATH  # only that path calls encoders
    assert engine.prompts == [] and len(stages.encoded) == 1
    assert asyncio.run(go(COLOCATED_PATH))[-1].serving_path == COLOCATED_PATH  # a forced path still wins


def test_a_forced_path_that_is_not_served_is_a_clear_error(store):
    stages = FakeStages(store)
    with pytest.raises(EpdError) as info:
        run(pipeline(stages, None), request([PHOTO]), path=COLOCATED_PATH)
    assert info.value.code == ErrorCode.UNAVAILABLE
    assert "'colocated' is not available" in info.value.message and "path=disaggregated" in info.value.message
    assert stages.encoded == [] and store.metrics()["active_leases"] == 0


def test_the_path_request_parameter():
    def requested_path(raw):
        return RequestParameters.parse(raw).path

    assert requested_path(json.dumps({"path": "colocated"})) == COLOCATED_PATH
    assert requested_path(json.dumps({"path": "adaptive"})) is None  # the deployment's rule, explicitly
    assert requested_path(json.dumps({"encoder": "encoder_0"})) is None and requested_path(None) is None
    with pytest.raises(EpdError) as info:
        requested_path(json.dumps({"path": "fastest"}))
    assert info.value.code == ErrorCode.INVALID_ARG and "disaggregated, colocated" in info.value.message


def test_the_decode_reads_request_parameter():
    assert RequestParameters.parse(json.dumps({"decode_reads": "stream"})).streamed_decode
    assert not RequestParameters.parse(json.dumps({"decode_reads": "poll"})).streamed_decode
    assert not RequestParameters.parse(None).streamed_decode
    with pytest.raises(EpdError) as info:
        RequestParameters.parse(json.dumps({"decode_reads": True}))
    assert info.value.code == ErrorCode.INVALID_ARG
    assert "'decode_reads' must be one of poll, stream" in info.value.message


def test_the_forward_media_request_parameter_and_who_may_use_it():
    """``raw`` (the forwarding experiment's baseline) only on an audio epd whose server allows it."""
    from python_backends.epd.server import EpdServer
    from python_backends.request.audios import AudioInput, AudioLimits
    from python_backends.request.generate import RequestLimits

    raw = json.dumps({"forward_media": "raw", "path": "disaggregated"})
    assert RequestParameters.parse(raw).raw_forwarding
    assert not RequestParameters.parse(json.dumps({"forward_media": "metadata"})).raw_forwarding
    with pytest.raises(EpdError, match="'forward_media' must be one of metadata, raw"):
        RequestParameters.parse(json.dumps({"forward_media": "bytes"}))

    def server(allowed: bool) -> EpdServer:
        audio = AudioInput(2, AudioLimits(), 16_000)
        limits = RequestLimits(max_audios=2)
        return EpdServer(None, None, limits, None, audio, None, None, allow_raw_forwarding=allowed)  # type: ignore[arg-type]

    inputs = {"text_input": np.array([b"hi"], dtype=np.object_), "audio": np.array([b"RIFF-clip"], dtype=np.object_)}
    request, parameters = server(True).parse(inputs, raw)
    assert parameters.raw_forwarding and request.audios == [b"RIFF-clip"]
    with pytest.raises(EpdError, match="only when started with TRITON_EPD_ALLOW_RAW_FORWARDING=1"):
        server(False).parse(inputs, raw)
    with pytest.raises(EpdError, match="send it with 'path' = 'disaggregated'"):  # prefill is on that path only
        server(True).parse(inputs, json.dumps({"forward_media": "raw"}))


def test_fixed_policies(store):
    stages, engine = FakeStages(store), FakeEngine()
    assert run(pipeline(stages, engine, "disaggregated"), request([PHOTO]))[-1].serving_path == DISAGGREGATED_PATH
    assert run(pipeline(stages, engine, "colocated"), request([PHOTO]))[-1].serving_path == COLOCATED_PATH
    assert run(pipeline(stages, None), request([PHOTO]))[-1].serving_path == DISAGGREGATED_PATH  # the only one
    with pytest.raises(ValueError, match="needs the colocated engine"):
        pipeline(stages, None, "colocated")
    with pytest.raises(ValueError, match="path_policy must be one of"):
        pipeline(stages, engine, "fastest")


def test_adaptive_probes_both_paths_then_follows_the_cost_model(store):
    stages, engine = FakeStages(store), FakeEngine()
    cost = PathCostModel(min_samples=1)  # one sample makes a path known (the default asks for more)
    p = pipeline(stages, engine, cost_model=cost)
    decisions = []

    async def one(i: int) -> GenerationChunk:
        image = synthetic_image(64, 48, seed=10 + i)
        chunks = [c async for c in p.run(request([image]), f"r{i}", on_decision=lambda d: decisions.append(d))]
        return chunks[-1]

    seen = [asyncio.run(one(i)) for i in range(6)]
    assert [c.serving_path for c in seen] == [d.path for d in decisions]
    assert {d.path for d in decisions[:2]} == {COLOCATED_PATH, DISAGGREGATED_PATH}  # one probe each, first
    assert [d.reason for d in decisions[:2]] == ["probe", "probe"]
    # Then, whatever the fakes measured, each request goes to the path predicted cheaper for it.
    for decision in decisions[2:]:
        assert decision.reason == "predicted"
        predicted = {path: ms for path, ms in decision.predicted_ms.items() if ms is not None}
        assert set(predicted) == {COLOCATED_PATH, DISAGGREGATED_PATH}
        assert decision.path == min(predicted, key=lambda path: predicted[path])
    assert store.metrics()["active_leases"] == 0


@pytest.mark.parametrize("shared_compute", [True, False])
def test_in_the_e_pd_topology_on_shared_engines_adaptive_takes_the_colocated_path(store, shared_compute):
    """colocated_encodes = encoders with epd's engine on the processors of prefill and decode: both
    paths encode alike and share the engine's cores, so the disaggregated one only adds the handoff
    (docs/benchmarks/epd-pays.md): every request goes colocated, no probe. With engines apart the
    cost model still decides, and a forced path is still obeyed."""
    stages, engine = FakeStages(store), FakeEngine()
    cost = PathCostModel(min_samples=1, shared_compute=shared_compute)
    p = pipeline(stages, engine, cost_model=cost, colocated_encodes="encoders")
    decisions: list[Decision] = []

    async def one(i: int, path: str | None = None) -> GenerationChunk:
        image = synthetic_image(64, 48, seed=30 + i)
        chunks = [c async for c in p.run(request([image]), f"r{i}", path=path, on_decision=decisions.append)]
        return chunks[-1]

    for i in range(4):
        asyncio.run(one(i))
    reasons = [(d.path, d.reason) for d in decisions]
    if shared_compute:
        assert reasons == [(COLOCATED_PATH, "dominates")] * 4 and stages.prefill_refs == []
    else:
        assert {d.reason for d in decisions} & {"probe", "predicted"}
        assert DISAGGREGATED_PATH in {d.path for d in decisions}  # probed at least
    assert asyncio.run(one(9, DISAGGREGATED_PATH)).serving_path == DISAGGREGATED_PATH
    # The engine's own encoding (the default) keeps the cost model, shared processors or not.
    assert pipeline(stages, engine, cost_model=PathCostModel()).dominant_path is None


def test_on_decision_hook_sees_every_decision(store):
    stages, engine = FakeStages(store), FakeEngine()
    p = pipeline(stages, engine)
    seen = []

    async def go():
        async for _ in p.run(request([PHOTO]), "r1", path=DISAGGREGATED_PATH, on_decision=lambda d: seen.append(d)):
            pass

    asyncio.run(go())
    assert [(d.path, d.reason) for d in seen] == [(DISAGGREGATED_PATH, "forced")]


def test_cancelling_a_colocated_stream_aborts_the_engine_request_and_releases(store):
    stages, engine = FakeStages(store), FakeEngine(hang_after_first=True)
    p = pipeline(stages, engine)
    run(p, request([PHOTO]), path=DISAGGREGATED_PATH)  # a stored image: a lease to give back

    async def go():
        gen = p.run(request([PHOTO]), "cancel-me", path=COLOCATED_PATH)
        first = await gen.__anext__()
        assert store.metrics()["active_leases"] == 1
        await gen.aclose()
        return first

    assert asyncio.run(go()).token_ids == [200]
    assert engine.aborted == ["cancel-me"]
    assert store.metrics()["active_leases"] == 0 and p.cost.in_flight[COLOCATED_PATH] == 0


def test_colocated_takes_videos_as_embeddings_from_the_store(store):
    """A request with a video: the video (and the request's new images) go through the encoders
    into the store, and the engine gets every item as embeddings by modality (never the video
    bytes: llm's own video loading is the baseline, not a path of epd); again: 0 encodes."""
    from tests.unit.test_epd_pipeline import video_request

    stages, engine = FakeStages(store), FakeEngine()
    p = pipeline(stages, engine)
    req = video_request([PHOTO], [b"vid-1", b"vid-2"])
    chunks = run(p, req, path=COLOCATED_PATH)
    assert chunks[-1].serving_path == COLOCATED_PATH
    data = engine.prompts[0]["multi_modal_data"]
    assert data["image"]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert data["video"]["video_grid_thw"].tolist() == [[2, 4, 4], [2, 4, 4]]
    assert data["video"]["video_embeds"].shape == (16, 8)
    uuids = engine.prompts[0]["multi_modal_uuids"]
    assert len(uuids["image"]) == 1 and len(uuids["video"]) == 2
    run(p, req, path=COLOCATED_PATH, request_id="r2")
    assert len(stages.encoded) == 1 and len(stages.encoded_videos) == 2
    assert torch.equal(engine.prompts[1]["multi_modal_data"]["video"]["video_embeds"], data["video"]["video_embeds"])
    assert store.metrics()["active_leases"] == 0


def test_colocated_takes_audio_clips_as_embeddings_from_the_store(store):
    """Clips, like videos: through the encoders into the store, to the engine as ``audio_embeds``
    (one tensor per clip, no grid); again: 0 encodes."""
    from tests.unit.test_epd_pipeline import audio_request

    stages, engine = FakeStages(store), FakeEngine()
    p = pipeline(stages, engine)
    req = audio_request([], [b"clip-1", b"clip-2"])
    assert run(p, req, path=COLOCATED_PATH)[-1].serving_path == COLOCATED_PATH
    data = engine.prompts[0]["multi_modal_data"]
    assert list(data) == ["audio"] and [tuple(t.shape) for t in data["audio"]["audio_embeds"]] == [(6, 8), (6, 8)]
    assert len(engine.prompts[0]["multi_modal_uuids"]["audio"]) == 2
    run(p, req, path=COLOCATED_PATH, request_id="r2")
    assert len(stages.encoded_audios) == 2 and store.metrics()["active_leases"] == 0


@pytest.mark.parametrize("path", [COLOCATED_PATH, DISAGGREGATED_PATH])
def test_the_decision_hook_runs_after_the_first_token_and_before_the_last(store, path):
    """``on_decision`` (epd: /metrics, round trips to the server) is off the time to first token:
    told once the first chunk went out, and always before the last chunk (a client that saw the
    end finds the decision counted)."""
    stages, engine = FakeStages(store), FakeEngine()
    p = pipeline(stages, engine)
    seen: list[Any] = []
    told_at: list[int] = []

    async def go():
        sent = 0
        async for chunk in p.run(request([PHOTO]), "r1", path=path, on_decision=lambda d: seen.append(d)):
            told_at.append(len(seen))
            sent += 1
            assert not chunk.finished or len(seen) == 1
        return sent

    sent = asyncio.run(go())
    assert sent > 2 and told_at[0] == 0 and told_at[1:] == [1] * (sent - 1)
    assert [d.path for d in seen] == [path]


def test_the_decision_hook_hears_of_a_request_that_failed_or_was_closed_before_any_token(store):
    stages, engine = FakeStages(store), FakeEngine(hang_after_first=True)
    p = pipeline(stages, engine)
    seen: list[Any] = []

    async def closed_at_first():
        gen = p.run(request([PHOTO]), "r1", path=COLOCATED_PATH, on_decision=lambda d: seen.append(d))
        await gen.__anext__()
        await gen.aclose()

    asyncio.run(closed_at_first())
    assert [d.path for d in seen] == [COLOCATED_PATH]

    class Broken(FakeEngine):
        async def generate_prompt(self, prompt, req, request_id):
            raise EpdError("engine gone", ErrorCode.INTERNAL)
            yield  # an async generator

    failing = pipeline(FakeStages(store), Broken())
    with pytest.raises(EpdError):
        asyncio.run(_drain(failing.run(request([PHOTO]), "r2", path=COLOCATED_PATH,
                                       on_decision=lambda d: seen.append(d))))
    assert [d.path for d in seen] == [COLOCATED_PATH, COLOCATED_PATH]
    assert store.metrics()["active_leases"] == 0


async def _drain(gen):
    return [c async for c in gen]


class SeededStages(FakeStages):
    """Prefill and decode answer tokens of the sequence's seed, with logprobs: n's sequences apart."""

    def __init__(self, store):
        super().__init__(store)
        self.seeds: list[int | None] = []

    async def prefill(self, prompt, references, sampling):
        assert "n" not in sampling  # one sequence per prefill
        self.seeds.append(sampling.get("seed"))
        chunk = await super().prefill(prompt, references, sampling)
        chunk.token_ids = [sampling["seed"] * 10]
        chunk.logprobs = [{str(sampling["seed"] * 10): {"logprob": -1.0, "rank": 1, "decoded_token": "a"}}]
        return chunk

    async def decode(self, request_id, references, transfer_params, sampling, stream):
        async for chunk in super().decode(request_id, references, transfer_params, sampling, stream):
            chunk.token_ids = [sampling["seed"] * 10 + chunk.num_output_tokens - 1]
            chunk.logprobs = [{str(chunk.token_ids[0]): {"logprob": -2.0, "rank": 1, "decoded_token": "b"}}]
            await asyncio.sleep(0)
            yield chunk


@pytest.mark.parametrize("stream", [True, False])
def test_n_sequences_on_the_split_run_each_with_seed_plus_index_and_one_final(store, stream):
    stages = SeededStages(store)
    req = request([PHOTO], stream=stream)
    req = GenerateRequest(req.prompt, req.images, stream, {**req.sampling, "n": 3, "seed": 5, "logprobs": 0}, stream)
    chunks = run(pipeline(stages, None), req)
    assert sorted(stages.seeds) == [5, 6, 7]
    assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
    by_index: dict[int, list[int]] = {}
    logprobs: dict[int, list] = {}
    for chunk in chunks:
        by_index.setdefault(chunk.index, []).extend(chunk.token_ids)
        logprobs.setdefault(chunk.index, []).extend(chunk.logprobs or [])
    assert by_index == {i: [s * 10, s * 10 + 1, s * 10 + 2, s * 10 + 3] for i, s in enumerate((5, 6, 7))}
    assert all(len(logprobs[i]) == 4 for i in range(3))  # prefill's first token's, then decode's
    assert len(chunks) == (12 if stream else 3)
    assert store.metrics()["active_leases"] == 0


def test_logprobs_under_a_grammar_leave_the_split_for_the_colocated_path(store):
    stages, engine = FakeStages(store), FakeEngine()
    req = request([PHOTO])
    sampling = {**req.sampling, "logprobs": 1, "structured_outputs": {"choice": ["a"]}}
    grammar = GenerateRequest(req.prompt, req.images, True, sampling, True)
    p = pipeline(stages, engine, policy=DISAGGREGATED_PATH)
    assert run(p, grammar)[-1].serving_path == COLOCATED_PATH
    with pytest.raises(EpdError, match="served on the colocated path only") as refused:
        run(p, grammar, path=DISAGGREGATED_PATH)
    assert refused.value.code is ErrorCode.INVALID_ARG
    plain = GenerateRequest(req.prompt, req.images, True, {**req.sampling, "logprobs": 1}, True)
    assert run(p, plain)[-1].serving_path == DISAGGREGATED_PATH

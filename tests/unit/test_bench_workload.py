"""Seeded workloads and load patterns of the benchmark harness (no server)."""

from __future__ import annotations

import asyncio
import io
import json

import numpy as np
import pytest
from PIL import Image

from bench.loadgen import LoadPoint, arrival_offsets, closed_loop, open_loop
from bench.metrics import RequestRecord
from bench.workload import FILLER_WORDS, LengthDist, WorkloadBuilder, WorkloadError, WorkloadSpec


def spec(**kw) -> WorkloadSpec:
    kw.setdefault("image_sizes", ((64, 48),))
    return WorkloadSpec(**kw)


@pytest.mark.parametrize(
    ("text", "values"),
    [("7", {7}), ("uniform:2:4", {2, 3, 4}), ("choice:0,5", {0, 5})],
)
def test_length_distributions(text, values):
    dist = LengthDist.parse(text)
    rng = np.random.default_rng(0)
    assert {dist.sample(rng) for _ in range(200)} == values
    assert str(dist) == text


def test_normal_lengths_are_clipped_at_the_minimum():
    dist = LengthDist.parse("normal:1:50", minimum=1)
    rng = np.random.default_rng(0)
    assert min(dist.sample(rng) for _ in range(200)) == 1


@pytest.mark.parametrize("text", ["uniform:5:1", "gamma:1:2", "x", "choice:a"])
def test_bad_distributions_say_what_is_wrong(text):
    with pytest.raises(WorkloadError):
        LengthDist.parse(text)


def test_same_seed_same_requests_other_seed_other_requests():
    a = WorkloadBuilder(spec(seed=1)).build(4, 0.0)
    b = WorkloadBuilder(spec(seed=1)).build(4, 0.0)
    c = WorkloadBuilder(spec(seed=2)).build(4, 0.0)
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]


def test_unique_media_never_repeats_across_points_reps_and_phases():
    builder = WorkloadBuilder(spec(images_per_request=LengthDist.parse("2")))
    requests = [
        *builder.build(5, 0.0, "measure", point=0, rep=0),
        *builder.build(5, 0.0, "measure", point=0, rep=1),
        *builder.build(5, 0.0, "measure", point=1, rep=0),
        *builder.build(5, 0.0, "warmup", point=0, rep=0),
    ]
    images = [image for r in requests for image in r.images]
    assert len(images) == 40 and len(set(images)) == 40


def test_repeated_media_comes_from_the_pool_and_keeps_request_shapes():
    builder = WorkloadBuilder(spec(media_pool_size=3, image_sizes=((64, 48), (32, 32))))
    unique = builder.build(30, 0.0)
    repeated = builder.build(30, 1.0)
    assert len({image for r in repeated for image in r.images}) <= 3
    assert sum(r.reused_images for r in repeated) == 30
    # Same prompts and lengths whatever the reuse: modes see the same work.
    assert [(r.prompt, r.sampling) for r in unique] == [(r.prompt, r.sampling) for r in repeated]


def test_reuse_ratio_is_respected_on_average():
    requests = WorkloadBuilder(spec(media_pool_size=2)).build(400, 0.25)
    share = sum(r.reused_images for r in requests) / 400
    assert 0.18 < share < 0.32


def test_requests_carry_decodable_images_and_exact_output_lengths():
    builder = WorkloadBuilder(spec(output_tokens=LengthDist.parse("12"), image_format="PNG"))
    request = builder.build(1, 0.0)[0]
    assert Image.open(io.BytesIO(request.images[0])).size == (64, 48)
    assert request.sampling == {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    assert request.prompt.count("<|image_pad|>") == 1


def test_tokenizer_cuts_prompts_to_exact_token_counts(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(FILLER_WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    builder = WorkloadBuilder(spec(tokenizer=path, prompt_tokens=LengthDist.parse("9")))
    text = builder.prompts.text(9, np.random.default_rng(0))
    assert len(tokenizer.encode(text).ids) == 9
    assert 0 not in tokenizer.encode(text).ids  # real words, not unknown pieces


def test_folder_media_uses_the_real_files(tmp_path):
    for i in range(2):
        Image.new("RGB", (10 + i, 10)).save(tmp_path / f"{i}.png")
    (tmp_path / "notes.txt").write_text("not an image")
    requests = WorkloadBuilder(spec(image_dir=tmp_path)).build(6, 0.0)
    files = {(tmp_path / f"{i}.png").read_bytes() for i in range(2)}
    assert {r.images[0] for r in requests} <= files


def test_empty_image_folder_is_a_clear_error(tmp_path):
    with pytest.raises(WorkloadError, match="no image files"):
        WorkloadBuilder(spec(image_dir=tmp_path))


def test_poisson_arrivals_have_the_asked_mean_rate():
    offsets = arrival_offsets("poisson", 10.0, 2000, np.random.default_rng(0))
    assert offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0)
    assert 2000 / offsets[-1] == pytest.approx(10.0, rel=0.1)


def test_burst_arrivals_come_in_groups():
    offsets = arrival_offsets("burst", 4.0, 8, np.random.default_rng(0), burst_size=4)
    assert list(offsets) == [0.0] * 4 + [1.0] * 4


def test_load_point_labels():
    assert LoadPoint("concurrency", 8).label == "c=8"
    assert LoadPoint("rate", 2.5, "poisson").label == "poisson 2.5/s"
    assert LoadPoint("rate", 4, "burst", 4).label == "burstx4 4/s"


class FakeServer:
    """Answers after ``delay`` s and remembers the most requests it had at once."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.in_flight = 0
        self.peak = 0

    async def send(self, item: int) -> RequestRecord:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        return RequestRecord(key=str(item), chunk_times=[self.delay])


def test_closed_loop_keeps_exactly_n_in_flight_and_sends_everything():
    server = FakeServer(0.01)
    ticks = []
    result = asyncio.run(closed_loop(server.send, list(range(20)), 4, 60.0, lambda: ticks.append(1)))
    assert server.peak == 4
    assert sorted(int(r.key) for r in result.records) == list(range(20))
    assert len(ticks) == 20 and result.not_sent == 0


def test_closed_loop_stops_issuing_at_the_time_bound():
    server = FakeServer(0.05)
    result = asyncio.run(closed_loop(server.send, list(range(100)), 1, 0.12, lambda: None))
    assert 2 <= len(result.records) <= 4
    assert result.not_sent == 100 - len(result.records)


def test_open_loop_sends_on_schedule_and_counts_latency_from_it():
    server = FakeServer(0.05)
    offsets = [0.0, 0.0, 0.0, 0.2]
    result = asyncio.run(open_loop(server.send, list(range(4)), offsets, 60.0, max_inflight=1, tick=lambda: None))
    by_key = {r.key: r for r in result.records}
    assert server.peak == 1
    # With one slot, the third request waited ~0.1 s behind the first two: that wait is latency.
    assert by_key["2"].chunk_times[0] == pytest.approx(0.15, abs=0.04)
    assert result.max_dispatch_lag_s >= 0.09
    assert json.dumps(by_key["3"].to_json())  # records stay JSON-serialisable


def test_identical_requests_share_prompt_image_and_sampling_but_not_keys():
    builder = WorkloadBuilder(spec(media_pool_size=4, prompt_tokens=LengthDist.parse("uniform:8:32")))
    requests = builder.build(6, 1.0, identical=True)
    assert len({(r.prompt, r.images, json.dumps(r.sampling)) for r in requests}) == 1
    assert len({r.key for r in requests}) == 6 and requests[0].reused_images == 1
    assert requests[0].images == builder.pool_primers()[0].images  # the first pool image
    assert len({r.prompt for r in builder.build(6, 1.0)}) > 1  # repeated: prompts differ


@pytest.mark.parametrize(
    ("text", "model", "media", "path"),
    [
        ("llm", "llm", "default", None),
        ("llm:identical", "llm", "identical", None),
        ("epd:adaptive", "epd", "default", "adaptive"),
        ("epd:disaggregated:repeated", "epd", "repeated", "disaggregated"),
        ("epd:unique:colocated", "epd", "unique", "colocated"),
        ("llm:unique:again", "llm", "unique", None),
    ],
)
def test_mode_names_carry_media_and_path(text, model, media, path):
    from bench.sweep import ModeSpec

    mode = ModeSpec.parse(text)
    assert (mode.label, mode.model, mode.media, mode.path) == (text, model, media, path)
    assert mode.prepare_options() == ({"parameters": {"path": path}} if path else {})


@pytest.mark.parametrize(
    "text", ["epd:fastest", "epd:repeated:unique", ":repeated", "epd:colocated:adaptive", "llm:again:again"]
)
def test_bad_mode_names_are_refused(text):
    from bench.sweep import ModeSpec

    with pytest.raises(ValueError, match="mode"):
        ModeSpec.parse(text)


@pytest.mark.parametrize("media", ["unique", "repeated", "identical"])
def test_an_again_mode_sends_the_same_work_but_never_its_originals_requests(media):
    """A control that re-sent its original's requests would find them in the server's caches."""
    from bench.sweep import ModeSpec

    builder = WorkloadBuilder(spec(media_pool_size=2))
    original, again = ModeSpec.parse(f"llm:{media}"), ModeSpec.parse(f"llm:{media}:again")
    assert again.again and not original.again and again.label != original.label

    def requests(mode):
        reuse = mode.reuse_ratio(builder.spec)
        return [
            r
            for rep in range(3)
            for r in builder.build(4, reuse, "measure", 0, mode.key_rep(rep), mode.identical, mode.media_namespace)
        ]

    ours, theirs = requests(original), requests(again)
    assert not {(r.prompt, r.images) for r in ours} & {(r.prompt, r.images) for r in theirs}
    assert not {r.key for r in ours} & {r.key for r in theirs}
    assert [len(r.images) for r in ours] == [len(r.images) for r in theirs]
    assert [r.sampling for r in ours] == [r.sampling for r in theirs]


def test_a_named_workload_sets_defaults_that_its_options_still_override():
    from bench.cli_args import build_parser, workload_spec

    article = workload_spec(build_parser().parse_args(["run", "--workload", "article"]))
    assert str(article.images_per_request) == "4" and str(article.output_tokens) == "uniform:2:16"
    assert max(w * h for w, h in article.image_sizes) == 1_000_000 and article.reuse_ratio == 0.0
    reuse = workload_spec(build_parser().parse_args(["run", "--workload", "reuse", "--reuse-ratio", "0.5"]))
    assert reuse.reuse_ratio == 0.5 and reuse.media_pool_size == 16
    plain = workload_spec(build_parser().parse_args(["run"]))
    assert str(plain.output_tokens) == "32" and plain.image_sizes == ((640, 480),)
    long_answer = workload_spec(build_parser().parse_args(["run", "--workload", "long-answer"]))
    assert str(long_answer.output_tokens) == "256" and str(long_answer.images_per_request) == "1"

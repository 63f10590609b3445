"""The whole sweep -> outputs path against a scripted target (no server): skipped modes,
instance counting, ratios, token agreement, stage readings and every output file."""

from __future__ import annotations

import asyncio
import csv
import json
import zlib
from pathlib import Path

import pytest

from bench.loadgen import LoadPoint
from bench.metrics import RequestRecord, Slo
from bench.report import markdown, write_outputs
from bench.sweep import ModeSpec, Sweep, SweepConfig, round_order
from bench.workload import BenchRequest, LengthDist, WorkloadSpec

CONFIGS = {
    "llm": {"backend": "python", "instance_group": [{"count": 1}], "model_transaction_policy": {"decoupled": True}},
    # A BLS entry point names its downstream models in parameters.
    "epd": {
        "backend": "python",
        "instance_group": [{"count": 1}],
        "model_transaction_policy": {"decoupled": True},
        "parameters": {"encode_model": {"string_value": "encode"}, "decode_model": {"string_value": "decode"}},
    },
    "encode": {"backend": "python", "instance_group": [{"count": 2, "kind": "KIND_CPU"}]},
    "decode": {"backend": "python", "instance_group": [{"count": 1}], "model_transaction_policy": {"decoupled": True}},
}
TTFT_S = {"llm": 0.200, "epd": 0.100}
# The one request on which the fake `epd` answers other tokens than `llm`: point 1 (c=2), rep 0.
DISAGREEING_KEY = "measure/1/0/3"


class FakeClient:
    async def get_server_metadata(self, as_json: bool) -> dict:
        return {"name": "triton", "version": "fake"}

    async def get_model_repository_index(self, as_json: bool) -> dict:
        return {"models": [{"name": name} for name in CONFIGS]}

    async def get_model_config(self, name: str, as_json: bool) -> dict:
        return {"config": CONFIGS[name]}


class FakeTarget:
    """Deterministic answers: tokens depend on the request's prompt and media (so two modes
    agree only when they were sent the same content), except for the (model, key) pairs in
    ``disagree``, which get other tokens; times depend on the model."""

    def __init__(self, disagree: frozenset[tuple[str, str]] = frozenset()) -> None:
        self.client = FakeClient()
        self.sent: list[tuple[str, str]] = []
        self.disagree = disagree

    async def not_ready_reason(self, model: str) -> str | None:
        return None if model in TTFT_S else f"model '{model}' is not loaded on fake"

    def prepare(self, request: BenchRequest, model: str, parameters: dict[str, str] | None = None) -> BenchRequest:
        return request

    async def send(self, model: str, request: BenchRequest, timeout_s: float) -> RequestRecord:
        await asyncio.sleep(0)
        self.sent.append((model, request.key))
        tokens = request.sampling["max_tokens"]
        seed = zlib.crc32(request.prompt.encode() + b"".join(request.images))
        if (model, request.key) in self.disagree:
            seed += 1
        ttft = TTFT_S[model]
        record = RequestRecord(
            key=request.key,
            chunk_times=[ttft + 0.01 * i for i in range(tokens)],
            chunk_tokens=[1] * tokens,
            num_output_tokens=tokens,
            num_input_tokens=50,
            output_token_ids=[(seed + i) % 1000 for i in range(tokens)],
        )
        if model == "epd":
            record.stage_ms = {"encode": 60.0, "prefill": 30.0, "decode": 10.0 * (tokens - 1)}
        return record

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list, FakeTarget, Path]:
    config = SweepConfig(
        modes=[ModeSpec.parse(m) for m in ("llm", "ensemble", "epd", "epd:repeated")],
        points=[LoadPoint("concurrency", 1), LoadPoint("concurrency", 2), LoadPoint("rate", 50.0, "poisson")],
        workload=WorkloadSpec(image_sizes=((32, 32),), output_tokens=LengthDist.parse("4", minimum=1)),
        requests_per_point=6,
        warmup_requests=2,
        reps=2,
        slo=Slo(ttft_ms=150),
        progress=False,
    )
    target = FakeTarget(disagree=frozenset({("epd", DISAGREEING_KEY)}))
    output = asyncio.run(Sweep(config, "fake:1", None, None).run(target))
    out = tmp_path_factory.mktemp("bench")
    write_outputs(out, output.summary, output.raw)
    return output.summary, output.raw, target, out


def test_missing_model_is_skipped_with_its_reason(run):
    summary, _, target, _ = run
    modes = {m["label"]: m for m in summary["modes"]}
    assert modes["ensemble"]["status"] == "skipped"
    assert "not loaded" in modes["ensemble"]["reason"]
    assert all(model != "ensemble" for model, _ in target.sent)


def test_warmup_is_sent_but_not_measured(run):
    summary, raw, target, _ = run
    # 3 modes x 3 points x (2 warm-up + 2 reps x 6 measured)
    assert len(target.sent) == 3 * 3 * (2 + 12)
    assert len(raw) == 3 * 3 * 12
    assert not any(r["key"].startswith("warmup") for r in raw)


def test_instances_count_downstream_models(run):
    summary, *_ = run
    modes = {m["label"]: m for m in summary["modes"]}
    assert modes["epd"]["layout"]["total_instances"] == 4  # epd 1 + encode 2 + decode 1
    point = next(p for p in summary["points"] if p["mode"] == "epd" and p["load_label"] == "c=1")
    s = point["summary"]
    assert s["output_token_throughput_per_instance"] == pytest.approx(s["output_token_throughput"] / 4)


def test_ratios_and_token_agreement_against_the_baseline(run):
    summary, raw, _, _ = run
    ratio = next(r for r in summary["ratios_vs_baseline"] if r["mode"] == "epd" and r["load_label"] == "c=1")
    assert ratio["ttft_ms_p50"] == pytest.approx(0.5)
    agreement = summary["token_agreement_vs_baseline"]
    # 2 reps x 6 measured requests per point; at c=2 epd answered one of the 12 differently.
    assert agreement == {"epd c=1": 1.0, "epd c=2": 11 / 12, "epd poisson 50/s": 1.0}
    assert not any(k.startswith("epd:repeated") for k in agreement)  # different media: not compared

    # 1.0 at c=1 is earned: the fake's tokens follow the media, and epd:repeated, sent other
    # media under the same keys as llm, got other tokens for them.
    def tokens(mode: str) -> dict[str, list[int]]:
        return {r["key"]: r["output_token_ids"] for r in raw if r["mode"] == mode and r["load_label"] == "c=1"}

    llm, epd, repeated = tokens("llm"), tokens("epd"), tokens("epd:repeated")
    assert len(llm) == 12 and epd == llm
    assert repeated.keys() == llm.keys() and any(repeated[k] != llm[k] for k in llm)


def test_a_path_mode_with_images_of_its_own_is_not_compared_token_by_token() -> None:
    """``epd:colocated`` is sent unique images of its own (``ModeSpec.media_namespace``), so its
    tokens cannot equal ``llm``'s; a 0% there once read as a wrong answer."""
    config = SweepConfig(
        modes=[ModeSpec.parse(m) for m in ("llm", "epd", "epd:colocated")],
        points=[LoadPoint("concurrency", 1)],
        workload=WorkloadSpec(image_sizes=((32, 32),), output_tokens=LengthDist.parse("4", minimum=1)),
        requests_per_point=4,
        warmup_requests=0,
        progress=False,
    )
    target = FakeTarget()
    summary = asyncio.run(Sweep(config, "fake:1", None, None).run(target)).summary
    assert summary["token_agreement_vs_baseline"] == {"epd c=1": 1.0}
    assert sum(model == "epd" for model, _ in target.sent) == 8  # epd:colocated did run


def test_goodput_and_stage_reading(run):
    summary, *_ = run
    llm = next(p for p in summary["points"] if p["mode"] == "llm" and p["load_label"] == "c=1")["summary"]
    epd = next(p for p in summary["points"] if p["mode"] == "epd" and p["load_label"] == "c=1")
    assert llm["goodput"] == 0.0 and epd["summary"]["goodput"] > 0  # TTFT 200 ms vs 100 ms, SLO 150 ms
    assert epd["stages"]["source"].startswith("pipeline timings")
    assert epd["stages"]["media_share"] == pytest.approx(60 / 120)
    reading = next(m["reading"] for m in summary["modes"] if m["label"] == "epd")
    assert "at c=2" in reading and "disaggregate E" in reading and "below the ~32" in reading


def test_every_output_is_written(run):
    summary, _, _, out = run
    for name in ("summary.json", "raw.json", "results.csv", "results.md", "latency_vs_concurrency.png",
                 "throughput_vs_concurrency.png", "latency_vs_rate.png", "throughput_vs_rate.png"):
        assert (out / name).stat().st_size > 0, name
    assert json.loads((out / "summary.json").read_text())["config"]["reps"] == 2
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 3 * 3 and {"ttft_ms_p99", "goodput", "client_cpu_ms_per_request"} <= set(rows[0])
    md = (out / "results.md").read_text()
    assert "| epd | c=1 |" in md and "Ratios vs `llm`" in md and "mode `ensemble`: model 'ensemble' is not loaded" in md
    assert "Harness cost" in md and "server CPU not measured" in md


def test_time_budget_reports_points_it_could_not_run(tmp_path):
    config = SweepConfig(
        modes=[ModeSpec.parse("llm"), ModeSpec.parse("ensemble")],
        points=[LoadPoint("concurrency", 1)],
        workload=WorkloadSpec(image_sizes=((32, 32),)),
        requests_per_point=2,
        time_budget_s=0.0,
        progress=False,
    )
    output = asyncio.run(Sweep(config, "fake:1", None, None).run(FakeTarget()))
    assert output.summary["points"] == [
        {"mode": "llm", "load_label": "c=1", "status": "not run: this mode's share of --time-budget was spent"}
    ]
    write_outputs(tmp_path, output.summary, output.raw)
    assert "`llm` c=1: not run" in (tmp_path / "results.md").read_text()


def test_interleave_runs_every_mode_at_a_point_before_the_next_point_in_drawn_orders():
    config = SweepConfig(
        modes=[ModeSpec.parse(m) for m in ("llm", "ensemble", "epd")],
        points=[LoadPoint("concurrency", 1), LoadPoint("concurrency", 2)],
        workload=WorkloadSpec(image_sizes=((32, 32),), output_tokens=LengthDist.parse("2", minimum=1)),
        requests_per_point=3,
        warmup_requests=1,
        reps=3,
        interleave=True,
        progress=False,
    )
    target = FakeTarget()
    output = asyncio.run(Sweep(config, "fake:1", None, None).run(target))
    # keys are "<phase>/<point index>/<rep>/<i>": per point, both warm-ups, then round r runs every
    # mode's repetition r, in the order round_order draws for that point and round
    sent = [(model, *key.split("/")[:3]) for model, key in target.sent]
    runs = [pair for i, pair in enumerate(sent) if i == 0 or sent[i - 1] != pair]
    for point in ("0", "1"):
        expected = [("llm", "warmup", "0"), ("epd", "warmup", "0")]
        for rep in range(3):
            order = round_order(2, config.workload.seed, int(point), rep)
            expected += [(("llm", "epd")[i], "measure", str(rep)) for i in order]
        assert [(model, phase, rep) for model, phase, p, rep in runs if p == point] == expected
    assert [point for _, _, point, _ in runs] == ["0"] * 8 + ["1"] * 8
    summary = output.summary
    assert [m["label"] for m in summary["modes"]] == ["llm", "ensemble", "epd"]  # the order asked for
    assert [m["status"] for m in summary["modes"]] == ["ran", "skipped", "ran"]
    assert [(p["mode"], p["load_label"]) for p in summary["points"]] == [
        ("llm", "c=1"), ("llm", "c=2"), ("epd", "c=1"), ("epd", "c=2")
    ]
    assert all(len(p["reps"]) == 3 for p in summary["points"])
    assert summary["config"]["interleave"] is True
    assert [r["mode"] for r in summary["ratios_vs_baseline"]] == ["epd", "epd"]
    assert all("reading" in m for m in summary["modes"] if m["status"] == "ran")


def test_interleave_shares_the_time_budget_over_the_sweep(tmp_path):
    config = SweepConfig(
        modes=[ModeSpec.parse("llm"), ModeSpec.parse("epd")],
        points=[LoadPoint("concurrency", 1)],
        workload=WorkloadSpec(image_sizes=((32, 32),)),
        requests_per_point=2,
        time_budget_s=0.0,
        interleave=True,
        progress=False,
    )
    output = asyncio.run(Sweep(config, "fake:1", None, None).run(FakeTarget()))
    assert [p["status"] for p in output.summary["points"]] == ["not run: --time-budget was spent"] * 2


@pytest.mark.parametrize("interleave", [False, True])
def test_a_server_that_lost_a_stage_halts_the_sweep_and_what_is_left_is_not_run(interleave):
    target = FakeTarget()
    lost = "the server lost a stage: stub:epd died"

    def halted() -> str | None:  # the stage watch (builders/stage_watch.py): epd's stub died at the 30th request
        return lost if len(target.sent) >= 30 else None

    config = SweepConfig(
        modes=[ModeSpec.parse("llm"), ModeSpec.parse("epd")],
        points=[LoadPoint("concurrency", 1), LoadPoint("concurrency", 2)],
        workload=WorkloadSpec(image_sizes=((32, 32),), output_tokens=LengthDist.parse("2", minimum=1)),
        requests_per_point=4,
        warmup_requests=1,
        reps=3,
        interleave=interleave,
        progress=False,
    )
    output = asyncio.run(Sweep(config, "fake:1", None, None, halted).run(target))
    statuses = {(p["mode"], p["load_label"]): p["status"] for p in output.summary["points"]}
    ran = [point for point, status in statuses.items() if status == "ran"]
    assert len(statuses) == 4 and 1 <= len(ran) < 4
    assert {s for s in statuses.values() if s != "ran"} == {f"not run: {lost}"}
    assert output.summary["halted"] == lost
    assert 30 <= len(target.sent) < 30 + 4  # no repetition started once it was lost
    text = markdown(output.summary)
    assert f"**Halted**: {lost}" in text and f"not run: {lost}" in text


def test_drawn_round_orders_put_modes_after_different_modes():
    """The rotation they replace kept 14 of 15 modes after the same mode in every round."""
    rounds = [round_order(15, 0, 0, rep) for rep in range(8)]
    assert all(sorted(order) == list(range(15)) for order in rounds)
    assert rounds == [round_order(15, 0, 0, rep) for rep in range(8)]  # seeded: a run can be repeated
    predecessors = {mode: {order[order.index(mode) - 1] for order in rounds if order.index(mode)} for mode in range(15)}
    assert sum(len(before) > 1 for before in predecessors.values()) >= 12


def test_a_stream_decode_mode_asks_epd_for_the_streamed_decode_read():
    polled = ModeSpec.parse("epd:disaggregated:repeated")
    streamed = ModeSpec.parse("epd:disaggregated:repeated:stream-decode")
    assert polled.prepare_options() == {"parameters": {"path": "disaggregated"}}
    assert streamed.prepare_options() == {"parameters": {"path": "disaggregated", "decode_reads": "stream"}}
    assert streamed.media_namespace == polled.media_namespace  # the same images, so the same store hits
    assert ModeSpec.parse("epd:stream-decode").prepare_options() == {"parameters": {"decode_reads": "stream"}}
    with pytest.raises(ValueError, match="stream-decode"):
        ModeSpec.parse("epd:stream-decode:stream-decode")

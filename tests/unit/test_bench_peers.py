"""bench peers without vLLM: ratios against the best peer, goals, output equality, and a whole
PeerRun over scripted server groups."""

from __future__ import annotations

import asyncio
import contextlib
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.loadgen import LoadPoint
from bench.metrics import RequestRecord
from bench.openai_target import (
    PeerServerInfo,
)
from bench.peer_equality import equality_table
from bench.peer_servers import GroupHandle, PeerSettings
from bench.peers import PeerRun, PeerRunConfig
from bench.peers_report import (
    agreement_by_policy,
    best_peer_ratios,
    goal_checks,
    validity_warnings,
    write_peer_outputs,
)
from bench.sweep import ModeSpec, SweepConfig
from bench.workload import BenchRequest, LengthDist, WorkloadSpec
from builders.processes import StartError

IMAGE = b"\xff\xd8\xff\xe0fake-jpeg"


# ---------------------------------------------------------------------------------------------
# comparisons
# ---------------------------------------------------------------------------------------------


def point(
    mode: str, load: str, ttft: float, e2e: float, rps: float, stages: dict[str, float] | None = None
) -> dict[str, Any]:
    dist = {
        "ttft_ms": {"p50": ttft, "p90": ttft * 1.5},
        "tpot_ms": {"p50": 5.0},
        "itl_ms": {"p50": 5.0},
        "e2e_ms": {"p50": e2e, "p90": e2e * 1.2},
    }
    return {
        "mode": mode,
        "load_label": load,
        "status": "ran",
        "load_kind": "concurrency",
        "load": int(load[2:]),
        "summary": {**dist, "request_throughput": rps, "output_token_throughput": rps * 32},
        "stages": {"ms": stages or {}},
    }


POINTS = [
    point("epd", "c=1", 100, 300, 3.0, {"encode": 60, "prefill": 30, "decode": 200}),
    point("epd:repeated", "c=1", 20, 200, 5.0),
    point("vllm-colocated", "c=1", 60, 250, 4.0),
    point("vllm-colocated:repeated", "c=1", 25, 180, 6.0),
    point("vllm-epd", "c=1", 150, 280, 3.5),
    point("vllm-epd:repeated", "c=1", 30, 260, 4.5),
]


def test_best_peer_is_chosen_per_metric_and_media_policy() -> None:
    rows = {(r["mode"], r["load_label"]): r for r in best_peer_ratios(POINTS)}
    assert set(rows) == {("epd", "c=1"), ("epd:repeated", "c=1")}
    unique = rows[("epd", "c=1")]
    assert unique["ttft_ms_p50"] == pytest.approx(100 / 60) and unique["best_peer"]["ttft_ms_p50"] == "vllm-colocated"
    assert unique["e2e_ms_p50"] == pytest.approx(300 / 250)
    assert (
        unique["request_throughput"] == pytest.approx(3.0 / 4.0)
        and unique["best_peer"]["request_throughput"] == "vllm-colocated"
    )
    repeated = rows[("epd:repeated", "c=1")]
    assert repeated["ttft_ms_p50"] == pytest.approx(20 / 25)  # colocated:repeated beats vllm-epd:repeated here
    assert repeated["best_peer"]["e2e_ms_p50"] == "vllm-colocated:repeated"


def test_goal_checks_name_the_stages() -> None:
    goals = {(g["goal"], g["load_label"]): g for g in goal_checks(POINTS)}
    ttft = goals[("epd:repeated TTFT p50 < vllm-epd:repeated", "c=1")]
    assert ttft["met"] and ttft["ratio"] == pytest.approx(20 / 30)
    e2e = goals[("epd e2e p50 <= 1.15x vllm-colocated", "c=1")]
    assert e2e["met"] is False and e2e["ratio"] == pytest.approx(1.2)  # 1.2 > 1.15
    assert e2e["ours_stages"].startswith("decode 200 ms, encode 60 ms")


def eq_row(
    model: str, key: str, tokens: list[int], policy: str = "unique", error: str | None = None, hits: int | None = None
) -> dict[str, Any]:
    return {
        "model": model,
        "mode": model if policy == "unique" else f"{model}:repeated",
        "key": key,
        "policy": policy,
        "error": error,
        "num_input_tokens": 298,
        "output_token_ids": tokens,
        "cache_hits": hits,
        "prompt_text_equal": True if model.startswith("vllm") else None,
    }


def test_equality_table_compares_every_model_to_the_reference() -> None:
    rows = [
        eq_row("llm", "a", [1, 2, 3]),
        eq_row("epd", "a", [1, 2, 3]),
        eq_row("vllm-epd", "a", [1, 2, 3]),
        eq_row("llm", "b", [4, 5], "repeated"),
        eq_row("epd", "b", [4, 5], "repeated", hits=1),
        eq_row("vllm-epd", "b", [4, 6], "repeated"),
    ]
    table = equality_table(rows)
    assert table["models"] == ["llm", "epd", "vllm-epd"]
    assert table["modes"] == ["llm", "epd", "vllm-epd", "llm:repeated", "epd:repeated", "vllm-epd:repeated"]
    a, b = table["requests"]
    assert a["all_equal"] and not b["all_equal"] and not table["all_equal"]
    assert b["models"]["vllm-epd"]["verdict"] == "differs at token 1"
    assert b["models"]["epd"]["cache_hits"] == 1 and b["models"]["vllm-epd"]["mode"] == "vllm-epd:repeated"
    assert table["prompt_text_checked"] == 2 and table["prompt_text_all_equal"]
    # Without the reference model, the first served one is the reference.
    assert equality_table([r for r in rows if r["model"] != "llm"])["reference"] == "epd"
    errored = equality_table([eq_row("llm", "a", [1]), eq_row("epd", "a", [], error="boom")])
    assert errored["requests"][0]["models"]["epd"]["verdict"] == "error" and not errored["all_equal"]


def test_agreement_compares_each_mode_with_the_baseline_of_its_media_policy() -> None:
    def recs(tokens: list[list[int]]) -> list[RequestRecord]:
        return [RequestRecord(key=str(i), chunk_times=[0.1], output_token_ids=t) for i, t in enumerate(tokens)]

    records = {
        ("llm", "c=1"): recs([[1], [2]]),
        ("llm:repeated", "c=1"): recs([[3], [4]]),
        ("vllm-epd", "c=1"): recs([[1], [9]]),
        ("vllm-epd:repeated", "c=1"): recs([[3], [4]]),
    }
    assert agreement_by_policy(records) == {"vllm-epd c=1 vs llm": 0.5, "vllm-epd:repeated c=1 vs llm:repeated": 1.0}


# ---------------------------------------------------------------------------------------------
# a whole run over scripted server groups
# ---------------------------------------------------------------------------------------------

TTFT_S = {"llm": 0.06, "epd": 0.10, "vllm-colocated": 0.07, "vllm-epd": 0.09}


class ScriptedTarget:
    """Tokens depend on the request only; times on the model; epd reports stages and hits."""

    def __init__(self, models: tuple[str, ...], info: PeerServerInfo) -> None:
        self.models, self.client = models, info

    async def not_ready_reason(self, model: str) -> str | None:
        return None if model in self.models else f"'{model}' not served"

    def prepare(self, request: BenchRequest, model: str) -> BenchRequest:
        return request

    async def send(self, model: str, request: BenchRequest, timeout_s: float) -> RequestRecord:
        await asyncio.sleep(0)
        seed = zlib.crc32(request.prompt.encode() + b"".join(request.images))
        tokens = request.sampling["max_tokens"]
        record = RequestRecord(
            key=request.key,
            chunk_times=[TTFT_S[model] + 0.01 * i for i in range(tokens)],
            chunk_tokens=[1] * tokens,
            num_input_tokens=298,
            num_output_tokens=tokens,
            output_token_ids=[(seed + i) % 1000 for i in range(tokens)],
        )
        if model == "epd":
            record.stage_ms = {"encode": 50.0, "prefill": 40.0, "decode": 10.0 * (tokens - 1)}
            record.cache_hits = request.reused_images
        return record

    async def close(self) -> None:
        pass


def scripted_group(name: str, models: tuple[str, ...], proof: bool = False) -> Any:
    configs = {m: {"backend": "fake", "instance_group": [{"count": 1}]} for m in models}
    info = PeerServerInfo(name, "fake", configs)

    @contextlib.contextmanager
    def group() -> Iterator[GroupHandle]:
        yield GroupHandle(
            name,
            models,
            lambda _want: ScriptedTarget(models, info),
            f"fake://{name}",
            None,
            [],
            1.5,
            {"processes": {m: {} for m in models}} if name != "triton" else {"origin": "fake"},
            ec_proof=(
                lambda request, refs: {
                    "request": request.key,
                    "proved": True,
                    "reason": "scripted",
                    "reference_tokens": refs,
                    "tokens_with_zeroed_cache": [0],
                }
            )
            if proof
            else None,
        )

    return group()


def test_peer_run_merges_groups_and_writes_every_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    modes = ["llm", "epd", "epd:repeated", "vllm-colocated", "vllm-epd", "vllm-epd:repeated", "ensemble"]
    config = SweepConfig(
        modes=[ModeSpec.parse(m) for m in modes],
        points=[LoadPoint("concurrency", 1), LoadPoint("concurrency", 2)],
        workload=WorkloadSpec(output_tokens=LengthDist.parse("4", minimum=1), image_sizes=((32, 24),)),
        requests_per_point=3,
        warmup_requests=1,
        progress=False,
    )
    settings = PeerSettings(tmp_path, {}, {}, {}, {}, tmp_path, tmp_path / "ec")
    run = PeerRun(PeerRunConfig(config, settings, equality_unique=2, equality_repeated=2), start_triton=lambda: None)
    groups = {"triton": ("llm", "epd"), "vllm-colocated": ("vllm-colocated",), "vllm-epd": ("vllm-epd",)}
    monkeypatch.setattr(
        run, "_group", lambda name, _models: scripted_group(name, groups[name], proof=name == "vllm-epd")
    )
    output = run.run()
    summary = output.summary
    peers = summary["peers"]

    assert [g["group"] for g in peers["groups"]] == ["triton", "vllm-colocated", "vllm-epd"]
    assert {m["label"]: m["status"] for m in summary["modes"]}["ensemble"] == "skipped"  # not loaded on the fake triton
    assert [m["label"] for m in summary["modes"]] == modes  # the order asked for
    assert {(p["mode"], p["load_label"]) for p in summary["points"]} >= {("vllm-epd:repeated", "c=2"), ("llm", "c=1")}
    assert {r["mode"] for r in peers["ratios_vs_best_peer"]} == {"llm", "epd", "epd:repeated"}
    assert any(g["goal"].startswith("epd e2e") for g in peers["goals"])
    eq = peers["equality"]
    assert eq["all_equal"] and eq["models"] == ["llm", "epd", "vllm-colocated", "vllm-epd"] and len(eq["requests"]) == 4
    assert peers["ec_load_proof"]["proved"]
    assert set(peers["ec_load_proof"]["reference_tokens"]) == {"llm", "epd", "vllm-colocated"}
    assert set(summary["token_agreement_vs_baseline"].values()) == {1.0}

    summary["meta"] = {"title": "peers test", "command": "python -m bench peers ..."}
    written = write_peer_outputs(tmp_path / "out", summary, output.raw)
    names = {p.name for p in written}
    assert {
        "summary.json",
        "raw.json",
        "results.csv",
        "results.md",
        "peers.csv",
        "peers_latency_vs_concurrency.png",
        "peers_ratio_vs_best_peer.png",
    } <= names
    text = (tmp_path / "out" / "results.md").read_text()
    for heading in (
        "## Server groups",
        "## Goals",
        "## Ratios vs the best peer",
        "## Output equality",
        "## Does vLLM-EPD's consumer use",
        "## Latency and throughput",
    ):
        assert heading in text
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["peers"]["equality"]["all_equal"]


def test_a_group_that_fails_to_start_is_reported_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = SweepConfig(
        modes=[ModeSpec.parse(m) for m in ("vllm-colocated", "vllm-epd")],
        points=[LoadPoint("concurrency", 1)],
        workload=WorkloadSpec(output_tokens=LengthDist.parse("2", minimum=1), image_sizes=((32, 24),)),
        requests_per_point=2,
        warmup_requests=0,
        progress=False,
    )
    run = PeerRun(
        PeerRunConfig(config, PeerSettings(tmp_path, {}, {}, {}, {}, tmp_path, tmp_path / "ec"), 1, 0), lambda: None
    )

    @contextlib.contextmanager
    def broken() -> Iterator[GroupHandle]:
        raise StartError("vllm serve exited with code 1 while starting; log x:\nboom")
        yield  # pragma: no cover

    monkeypatch.setattr(
        run, "_group", lambda name, _m: broken() if name == "vllm-epd" else scripted_group(name, ("vllm-colocated",))
    )
    summary = run.run().summary
    modes = {m["label"]: m for m in summary["modes"]}
    assert modes["vllm-colocated"]["status"] == "ran"
    assert modes["vllm-epd"]["status"] == "skipped" and "did not start" in modes["vllm-epd"]["reason"]
    assert "error" in summary["peers"]["groups"][1]


def test_a_noisy_repetition_is_measured_again_with_fresh_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.point_run as point_run_module
    import bench.sweep as sweep_module

    shares = iter([0.6, 0.1, 0.05])  # rep 1: noisy, then clean; rep 2: clean
    real = point_run_module.cpu_usage

    def scripted_usage(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return {**real(*args, **kwargs), "other_processes_cpu_share": next(shares)}

    monkeypatch.setattr(point_run_module, "cpu_usage", scripted_usage)
    config = SweepConfig(
        modes=[ModeSpec.parse("vllm-colocated")],
        points=[LoadPoint("concurrency", 1)],
        workload=WorkloadSpec(output_tokens=LengthDist.parse("2", minimum=1), image_sizes=((32, 24),)),
        requests_per_point=2,
        warmup_requests=0,
        reps=2,
        progress=False,
        max_noise=0.25,
    )
    info = PeerServerInfo("f", "0", {"vllm-colocated": {"instance_group": [{"count": 1}]}})
    target = ScriptedTarget(("vllm-colocated",), info)
    sent: list[str] = []
    original_send = target.send

    async def send(model: str, request: BenchRequest, timeout_s: float) -> RequestRecord:
        sent.append(request.key)
        return await original_send(model, request, timeout_s)

    target.send = send  # type: ignore[method-assign]
    output = asyncio.run(sweep_module.Sweep(config, "fake", None, None).run(target))
    point = output.summary["points"][0]
    assert [rep["noisy_attempts_discarded"] for rep in point["reps"]] == [1, 0]
    assert len(sent) == 6 and len(set(sent)) == 6  # the retry used requests never sent before
    assert {r["key"] for r in output.raw} == set(sent[2:])  # the noisy attempt is not kept


def test_pool_primers_show_every_pool_image_once() -> None:
    from bench.workload import WorkloadBuilder

    spec = WorkloadSpec(media_pool_size=3, images_per_request=LengthDist.parse("2"), image_sizes=((32, 24), (16, 16)))
    builder = WorkloadBuilder(spec)
    primers = builder.pool_primers()
    assert [p.image_keys for p in primers] == [("pool/0",), ("pool/1",), ("pool/2",)]
    assert all(p.reused_images == 1 and p.prompt.count("<|image_pad|>") == 1 for p in primers)
    repeated = builder.build(20, 1.0, "measure", 0, 0)
    assert {k for r in repeated for k in r.image_keys} <= {"pool/0", "pool/1", "pool/2"}
    assert any(len(set(r.image_keys)) == 2 for r in repeated)  # slots of one request still draw independently
    # The same pool image has the same bytes in a primer and in a measured request.
    by_key = {k: img for r in repeated for k, img in zip(r.image_keys, r.images, strict=True)}
    assert all(by_key.get(p.image_keys[0], p.images[0]) == p.images[0] for p in primers)


def test_media_salt_changes_images_not_prompts() -> None:
    from bench.workload import WorkloadBuilder

    plain = WorkloadBuilder(WorkloadSpec(image_sizes=((32, 24),))).build(3, 0.5, "measure", 0, 0)
    salted = WorkloadBuilder(WorkloadSpec(image_sizes=((32, 24),), media_salt="run-2")).build(3, 0.5, "measure", 0, 0)
    assert [r.prompt for r in plain] == [r.prompt for r in salted]
    assert [r.image_keys for r in plain] == [r.image_keys for r in salted]
    assert all(a != b for p, q in zip(plain, salted, strict=True) for a, b in zip(p.images, q.images, strict=True))
    again = WorkloadBuilder(WorkloadSpec(image_sizes=((32, 24),), media_salt="run-2")).build(3, 0.5, "measure", 0, 0)
    assert [r.images for r in again] == [r.images for r in salted]  # a given salt repeats exactly


def test_peers_command_salts_media_per_run_and_run_does_not() -> None:
    from bench.cli_args import build_parser, workload_spec

    peers = workload_spec(build_parser().parse_args(["peers"]))
    assert peers.media_salt  # a fresh salt
    assert workload_spec(build_parser().parse_args(["peers", "--media-salt", "x"])).media_salt == "x"
    assert workload_spec(build_parser().parse_args(["run"])).media_salt == ""  # bench run keeps its images


def test_unique_media_served_from_the_store_is_flagged() -> None:

    hit = point("epd", "c=1", 20, 150, 5.0)
    hit["summary"]["cache_hits"] = 24
    fine = point("epd:repeated", "c=1", 20, 150, 5.0)
    fine["summary"]["cache_hits"] = 24
    warnings = validity_warnings([hit, fine])
    assert len(warnings) == 1 and warnings[0].startswith("epd c=1: 24 store hits")

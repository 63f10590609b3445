"""The layout advisor (issue 14): SimPy model, profiles, fit validity on committed data, CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bench.advisor import cli, fit
from bench.advisor.profiles import ProfileError, VisionSpec, load_profile
from bench.advisor.simulator import Layout, Workload, simulate

REPO = Path(__file__).resolve().parents[2]
# The fit's validity report on the peer benchmark run and that run's summary (docs/benchmarks/peers.md,
# docs/serving-paths.md "The advisor"); the report's "measured" names where the summary lived then.
DATA = REPO / "tests" / "data" / "advisor"
VALIDITY = DATA / "validity.json"
PEERS_SUMMARY = DATA / "peers-summary.json"


def test_vision_tokens_follow_qwen2_vl_resize():
    # The bench's 640x480 JPEG is grid 1x26x36 = 936 patches, 234 image tokens (encode-breakdown note).
    spec = VisionSpec()
    assert (spec.patches(640, 480), spec.tokens(640, 480)) == (936, 234)
    # Qwen3-VL (16-pixel patches, no upper cap in reach): 640x640 -> 400 tokens as the vLLM EPD blog says.
    qwen3 = load_profile("gpu-a100").vision
    assert qwen3.tokens(640, 640) == 400


@pytest.mark.parametrize("text", ["colocated", "colocated:4", "1E+1P+1D", "2e+1p+3d", "1E+3PD"])
def test_layout_labels_round_trip(text):
    layout = Layout.parse(text)
    assert Layout.parse(layout.label) == layout


def test_layout_errors_say_what_is_accepted():
    with pytest.raises(ValueError, match="xE\\+yP\\+zD"):
        Layout.parse("3 encoders")
    with pytest.raises(ValueError, match="needs >= 1 encoder"):
        simulate(load_profile("cpu-2core"), Layout(encoders=0, prefills=1, decodes=1), Workload())


def test_simulation_is_deterministic_per_seed():
    profile = load_profile("cpu-2core")
    first = simulate(profile, "1E+1P+1D", Workload(concurrency=4, requests=32, seed=3))
    again = simulate(profile, "1E+1P+1D", Workload(concurrency=4, requests=32, seed=3))
    other = simulate(profile, "1E+1P+1D", Workload(concurrency=4, requests=32, seed=4))
    assert first.e2e_ms == again.e2e_ms and first.ttft_ms == again.ttft_ms
    assert first.e2e_ms != other.e2e_ms


def test_hits_skip_the_encoder():
    profile = load_profile("cpu-2core")
    unique = simulate(profile, "1E+1P+1D", Workload(concurrency=1, requests=16))
    repeated = simulate(profile, "1E+1P+1D", Workload(concurrency=1, requests=16, hit_ratio=1.0))
    assert repeated.stages_ms["encode"] < 0.2 * unique.stages_ms["encode"]
    assert repeated.ttft_ms["p50"] < unique.ttft_ms["p50"]


def test_shared_cpu_makes_stages_contend():
    # The same work on one dedicated device per instance vs two shared cores vs one shared core.
    profile = load_profile("cpu-2core")
    workload = Workload(concurrency=4, requests=32)
    own = simulate(profile.replace(shared_cpu_slots=None), "1E+1P+1D", workload).e2e_ms["p50"]
    two = simulate(profile, "1E+1P+1D", workload).e2e_ms["p50"]
    one = simulate(profile.replace(shared_cpu_slots=1), "1E+1P+1D", workload).e2e_ms["p50"]
    assert own < two < one


def test_colocated_encoder_work_stalls_decoding():
    # In one engine, every new image's ViT runs inside a step all running sequences wait for.
    profile = load_profile("gpu-a100")
    workload = Workload(concurrency=16, requests=64, prompt_tokens=400, output_tokens=64, image_size=(640, 640))
    light = fit.set_param(profile, "colocated_engine.vit_ms_per_patch", 0.0)
    without_vit = simulate(light, "colocated:4", workload).e2e_ms["p50"]
    assert without_vit < simulate(profile, "colocated:4", workload).e2e_ms["p50"]


def test_profile_errors_name_the_fix(tmp_path):
    with pytest.raises(ProfileError, match="cpu-2core"):
        load_profile("no-such-profile")
    broken = json.loads((REPO / "bench/advisor/profiles/cpu-2core.json").read_text())
    del broken["encoder"]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(broken))
    with pytest.raises(ProfileError, match="encoder"):
        load_profile(path)


def test_gpu_profile_states_a_source_for_each_cost():
    profile = load_profile("gpu-a100")
    for key in (
        "colocated_engine.vit_ms_per_patch",
        "colocated_engine.prefill_ms_per_token",
        "colocated_engine.step_base_ms",
        "kv_transfer_ms_per_token",
        "hardware",
        "model",
    ):
        assert key in profile.sources and len(profile.sources[key]) > 40, key
    assert any("https://" in text for text in profile.sources.values())


def test_fitted_cpu_profile_predicts_unseen_measured_points():
    """The model against committed data: the points the fit did not use, e2e p50, seed 0.

    Issue 14 asks for >= 6 such points within +-20%. The committed profile has 6 unseen points and
    gets 5 (epd:repeated at c=8 is +35%, docs/serving-paths.md): this pins that state
    so a change to the model or the profile that loses accuracy fails here.
    """
    report = json.loads(VALIDITY.read_text())
    points = [p for p in fit.load_points(PEERS_SUMMARY) if not fit.in_training(p, report["train"])]
    rows = fit.predict(load_profile("cpu-2core"), points)
    errors = {f"{r['mode']}@{r['concurrency']}": round(r["e2e_error"], 3) for r in rows}
    assert len(rows) >= 6, errors
    assert sum(abs(e) <= fit.TOLERANCE for e in errors.values()) >= 5, errors
    assert all(abs(e) <= 0.40 for e in errors.values()), errors


def test_advise_prints_layout_policy_crossover_and_writes_plot(tmp_path, capsys):
    args = "--profile gpu-a100 --layouts colocated:4 1E+3PD --concurrency 1 16 --output-tokens 24 --requests 24"
    code = cli.main([*args.split(), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "recommended layout at c=16:" in out and "path policy:" in out and "crossover concurrency" in out
    assert (tmp_path / "advise-gpu-a100.png").stat().st_size > 10_000
    saved = json.loads((tmp_path / "advise-gpu-a100.json").read_text())
    assert set(saved["sweep"]) == {"colocated:4", "1E+3PD"}


def test_advise_rejects_bad_input(capsys):
    assert cli.main(["--profile", "gpu-a100", "--hit-ratio", "1.5"]) == 2
    assert "hit-ratio" in capsys.readouterr().err
    assert cli.main(["--profile", "gpu-a100", "--layouts", "4GPUs"]) == 2


def test_idle_spin_takes_only_idle_cores():
    # Spin-waiting threads burn CPU when cores are free; under load they give way to real work.
    profile = fit.set_param(load_profile("cpu-2core"), "encoder.spin_ms", 200.0)
    busy = Workload(concurrency=8, requests=32)
    yielding = simulate(profile.replace(spin_yields=True), "1E+1P+1D", busy).e2e_ms["p50"]
    competing = simulate(profile.replace(spin_yields=False), "1E+1P+1D", busy).e2e_ms["p50"]
    assert yielding < competing


def test_fit_reads_the_path_benchmark_mode_names(tmp_path):
    """issue 14's path benchmark names the modes llm:unique, epd:disaggregated:unique/repeated;
    the fit maps them onto the simulator's llm / epd / epd:repeated and ignores the others."""
    summary = json.loads(PEERS_SUMMARY.read_text())
    renamed = {"llm": "llm:unique", "epd": "epd:disaggregated:unique", "epd:repeated": "epd:disaggregated:repeated"}
    original = fit.load_points(PEERS_SUMMARY)
    for entry in summary["points"] + summary["modes"]:
        key = "mode" if "mode" in entry else "label"
        entry[key] = renamed.get(entry[key], entry[key])
    summary["points"].append({**summary["points"][0], "mode": "epd:adaptive:unique"})  # not simulated
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    assert fit.load_points(path) == original


def test_fit_reports_and_gates_only_when_asked(tmp_path):
    measured = Path(__file__).resolve().parents[1] / "data" / "advisor" / "peers-summary.json"
    common = ["--measured", str(measured), "--train", "1", "llm@8", "epd@8", "--no-fit"]
    assert fit.main([*common, "--report", str(tmp_path / "a")]) == 0  # a report, whatever it says
    report = json.loads((tmp_path / "a" / "validity.json").read_text())
    share = report["within_tolerance"] / report["checked_points"]
    assert 0 < share < 1  # the stored run has points inside and outside the tolerance
    assert fit.main([*common, "--report", str(tmp_path / "b"), "--require-within", str(share)]) == 0
    assert fit.main([*common, "--report", str(tmp_path / "c"), "--require-within", "1.0"]) == 1


def test_each_role_is_held_to_its_own_cores():
    """cpu-2core-roles: epd's stub and engine on core 1 alone (E|PD), the encoders on core 0. On
    one shared 2-core pool the stub's relaying and the engine's steps would overlap on two cores;
    held to one core they take turns, so a decode-heavy load is slower there."""
    roles = load_profile("cpu-2core-roles")
    shared = roles.replace(cpu_sets={}, shared_cpu_slots=2)
    decode_heavy = Workload(concurrency=8, requests=24, output_tokens=64, images_per_request=0)
    pinned = simulate(roles, "1E+1PD", decode_heavy).request_throughput
    assert pinned < 0.9 * simulate(shared, "1E+1PD", decode_heavy).request_throughput
    # The encoder's threads are capped at its set: on two cores of its own it encodes faster than on one.
    two_threads = roles.replace(encoder=dataclasses.replace(roles.encoder, threads=2))
    wider = two_threads.replace(cpu_sets={"colocated": [0, 1], "encoder": [0, 2], "pd": [1]})
    one = Workload(concurrency=1, requests=8, output_tokens=1)
    on_one_core = simulate(two_threads, "1E+1PD", one).stages_ms["encode"]
    assert simulate(wider, "1E+1PD", one).stages_ms["encode"] < 0.75 * on_one_core


def test_cpu_sets_must_name_every_role_and_not_half_overlap():
    roles = load_profile("cpu-2core-roles")
    data = roles.to_json()
    with pytest.raises(ProfileError, match="each of colocated, encoder, pd"):
        type(roles).from_json({**data, "cpu_sets": {"encoder": [0], "pd": [1]}})
    with pytest.raises(ProfileError, match="overlapping in part"):
        type(roles).from_json({**data, "cpu_sets": {"colocated": [0, 1], "encoder": [0, 1], "pd": [1]}})


def test_mixed_image_sizes_cost_what_their_patches_cost():
    profile = load_profile("cpu-2core-roles")
    small, large = (224, 224), (1000, 1000)
    assert profile.vision.patches(*small) < profile.vision.patches(*large)
    runs = {
        "mixed": Workload(concurrency=1, requests=16, images_per_request=4, image_sizes=(small, large)),
        "small": Workload(concurrency=1, requests=16, images_per_request=4, image_size=small),
        "large": Workload(concurrency=1, requests=16, images_per_request=4, image_size=large),
    }
    e2e = {name: simulate(profile, "1E+1PD", w).e2e_ms["mean"] for name, w in runs.items()}
    assert e2e["small"] < e2e["mixed"] < e2e["large"]


def test_fit_over_several_runs_names_points_by_run_and_checks_winners(tmp_path):
    summary = PEERS_SUMMARY.read_text()
    paths = []
    for name in ("run-a", "run-b"):
        (tmp_path / name).mkdir()
        paths.append(tmp_path / name / "summary.json")
        paths[-1].write_text(summary)
    args = ["--train", "run-a@1", "--no-fit", "--metric", "throughput", "--report", str(tmp_path / "report")]
    assert fit.main(["--measured", *map(str, paths), *args]) == 0
    report = json.loads((tmp_path / "report" / "validity.json").read_text())
    assert {r["workload"] for r in report["rows"] if r["used_for_fit"]} == {"run-a"}
    assert report["metric"] == "throughput"
    # Per run and concurrency: the mode with the most req/s, measured against predicted.
    assert {(w["workload"], w["concurrency"]) for w in report["winners"]} == {
        (run, c) for run in ("run-a", "run-b") for c in (1, 4, 8)
    }
    assert report["winners_right"] == sum(w["right"] for w in report["winners"])
    assert "The winner (most req/s) predicted at" in (tmp_path / "report" / "validity.md").read_text()


def test_a_slim_summary_gives_the_fit_the_same_points(tmp_path):
    slim = fit.slim_summary(json.loads(PEERS_SUMMARY.read_text()))
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(slim))
    assert fit.load_points(path) == fit.load_points(PEERS_SUMMARY)
    assert path.stat().st_size < PEERS_SUMMARY.stat().st_size / 10


def test_an_encode_call_is_paid_once_per_request_not_per_image():
    profile = load_profile("cpu-2core-roles").replace(service_cv=0.0)
    with_call = profile.replace(encoder=dataclasses.replace(profile.encoder, call_ms=50.0, spin_ms=0.0))
    without = profile.replace(encoder=dataclasses.replace(profile.encoder, call_ms=0.0, spin_ms=0.0))
    four = Workload(concurrency=1, requests=4, images_per_request=4, output_tokens=1)
    encode = [simulate(p, "1E+1PD", four).stages_ms["encode"] for p in (with_call, without)]
    assert encode[0] - encode[1] == pytest.approx(50.0, rel=0.05)


ROLE_RUNS = [DATA / "roles" / run / "summary.json" for run in ("strict-long-answer", "strict-article", "strict-reuse")]


def test_per_role_profile_predicts_unseen_points_and_every_winner():
    """Issues 33 and 48: fitted for per-role cores (cpu-2core-roles, docs/benchmarks/advisor.md) on
    the committed runs (after the encoder rework), on the points it was not fitted on (every
    concurrency but 1 and 8): req/s within +-20% at 15 of 18, and the measured winner (llm, E|PD or
    E|P|D) wherever there is one: at one point the two epd paths measured the same req/s (10.72),
    a tie the advisor may call either way. This pins that state."""
    points = [p for path in ROLE_RUNS for p in fit.load_points(path, fit.PER_ROLE_SETUPS, path.parent.name)]
    rows = fit.predict(load_profile("cpu-2core-roles"), points)
    unseen = [r for r in rows if not fit.in_training(r, ["1", "8"])]
    errors = {f"{r['workload']}:{r['mode']}@{r['concurrency']}": round(r["throughput_error"], 3) for r in unseen}
    assert len(unseen) == 18
    assert sum(abs(e) <= fit.TOLERANCE for e in errors.values()) >= 15, errors
    measured = {(r["workload"], r["concurrency"], r["mode"]): r["measured_request_throughput"] for r in rows}
    winners = fit.winner_checks(rows)

    def tied(w: dict) -> bool:
        key = (w["workload"], w["concurrency"])
        return measured[(*key, w["predicted_winner"])] >= 0.99 * measured[(*key, w["measured_winner"])]

    assert len(winners) == 12 and all(w["right"] or tied(w) for w in winners), winners
    assert sum(w["right"] for w in winners) >= 11, winners


def test_advise_names_e_pd_where_the_pd_engine_is_epds_own(capsys):
    args = "--profile cpu-2core-roles --images-per-request 4 --output-tokens 9 --hit-ratio 0.8 --concurrency 1 8"
    assert cli.main(args.split()) == 0
    assert "path policy: E|PD (--colocated-encodes encoders, path colocated)" in capsys.readouterr().out

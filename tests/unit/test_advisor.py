"""The layout advisor (issue 14): SimPy model, profiles, fit validity on committed data, CLI."""

from __future__ import annotations

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
    for point in summary["points"]:
        point["mode"] = renamed.get(point["mode"], point["mode"])
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

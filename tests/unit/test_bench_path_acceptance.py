"""The issue-14 acceptance table (bench/path_acceptance.py) from a hand-made run summary."""

from __future__ import annotations

from bench.path_acceptance import acceptance_rows, markdown, token_agreement


def point(
    mode: str, load: str, e2e: float, ttft: float, paths: dict[str, int] | None = None, reps: list | None = None
) -> dict:
    summary = {"e2e_ms": {"p50": e2e}, "ttft_ms": {"p50": ttft}, "errors": 0, "serving_paths": paths}
    reps = [{"e2e_ms": {"p50": e}, "ttft_ms": {"p50": t}} for e, t in reps or []]
    return {"mode": mode, "load_label": load, "status": "ran", "summary": summary, "reps": reps}


def test_ratios_goals_and_agreement() -> None:
    points = [
        point("llm:unique", "c=1", 100, 40),
        point("epd:adaptive:unique", "c=1", 104, 41, {"colocated": 16}),
        point("epd:disaggregated:unique", "c=1", 190, 80),
        point("epd:colocated:unique", "c=1", 103, 40),
        point("llm:repeated", "c=1", 100, 40),
        point("epd:adaptive:repeated", "c=1", 90, 42, {"colocated": 15, "disaggregated": 1}),
        point("epd:disaggregated:repeated", "c=1", 150, 35),
    ]
    raw = [
        {"mode": "llm:unique", "load_label": "c=1", "key": "k1", "output_token_ids": [1, 2], "error": None},
        {"mode": "epd:adaptive:unique", "load_label": "c=1", "key": "k1", "output_token_ids": [1, 2], "error": None},
        {"mode": "epd:colocated:unique", "load_label": "c=1", "key": "k1", "output_token_ids": [9], "error": None},
        {"mode": "llm:repeated", "load_label": "c=1", "key": "k1", "output_token_ids": [3], "error": None},
        {"mode": "epd:adaptive:repeated", "load_label": "c=1", "key": "k1", "output_token_ids": [4], "error": None},
    ]
    agreement = token_agreement(raw)
    # colocated:unique has its own images (another namespace): not compared with llm's.
    assert agreement == {"epd:adaptive:unique c=1": 1.0, "epd:adaptive:repeated c=1": 0.0}
    unique, repeated = acceptance_rows({"points": points}, agreement)
    assert unique["e2e_ms_adaptive_vs_llm"] == 1.04 and unique["goals"]["adaptive_vs_llm_e2e"]["met"]
    assert unique["adaptive_paths"] == {"colocated": 16}
    assert repeated["ttft_ms_adaptive_vs_llm"] == 42 / 40 and not repeated["goals"]["adaptive_vs_llm_ttft"]["met"]
    # The better fixed policy on e2e is llm (100), on TTFT disaggregated (35).
    assert repeated["e2e_ms_adaptive_vs_best_fixed"] == 0.9 and repeated["ttft_ms_adaptive_vs_best_fixed"] == 1.2
    text = markdown([unique, repeated], {"meta": {"command": "python -m bench run ..."}})
    assert "Goals met: 3 of 4." in text and "adaptive_vs_llm_ttft NO (1.05)" in text


def test_each_goal_is_also_given_per_interleaved_round() -> None:
    # round r: repetition r of every mode (bench run --interleave)
    points = [
        point("llm:unique", "c=4", 100, 40, reps=[(100, 40), (90, 40), (120, 40)]),
        point("epd:adaptive:unique", "c=4", 104, 41, reps=[(104, 41), (99, 40), (110, 42)]),
        point("epd:disaggregated:unique", "c=4", 190, 80, reps=[(190, 80), (80, 70), (200, 90)]),
    ]
    (row,) = acceptance_rows({"points": points}, {})
    vs_llm, vs_best = row["goals"]["adaptive_vs_llm_e2e"], row["goals"]["adaptive_vs_best_fixed_e2e"]
    assert vs_llm["rounds"] == [1.04, 1.1, 110 / 120] and vs_llm["rounds_met"] == 2
    # per round against the better fixed policy of that round: disaggregated won round 2
    assert vs_best["rounds"] == [1.04, 99 / 80, 110 / 120] and vs_best["rounds_met"] == 2
    text = markdown([row], {})
    assert "adaptive_vs_llm_e2e yes (1.04; rounds 0.92-1.10, 2 of 3 met)" in text


def test_a_control_takes_adaptives_place_in_the_same_goals() -> None:
    # llm measured again (llm:<media>:again): the same tests, for the baseline against itself
    points = [
        point("llm:unique", "c=1", 100, 40, reps=[(100, 40), (90, 40)]),
        point("llm:unique:again", "c=1", 108, 39, reps=[(108, 39), (88, 41)]),
        point("epd:adaptive:unique", "c=1", 104, 41, reps=[(104, 41), (99, 40)]),
        point("epd:disaggregated:unique", "c=1", 190, 80, reps=[(190, 80), (180, 70)]),
        point("llm:repeated", "c=1", 100, 40),
        point("epd:adaptive:repeated", "c=1", 90, 39),
    ]
    unique, repeated = acceptance_rows({"points": points}, {})
    control = unique["goals"]["adaptive_vs_llm_e2e"]["control"]
    assert control["value"] == 1.08 and not control["met"] and control["rounds"] == [1.08, 88 / 90]
    assert unique["goals"]["adaptive_vs_best_fixed_e2e"]["control"]["value"] == 1.08  # best fixed: llm
    assert unique["e2e_ms_control_vs_llm"] == 1.08 and unique["ttft_ms_control_vs_llm"] == 39 / 40
    assert "control" not in repeated["goals"]["adaptive_vs_llm_ttft"]  # no llm:repeated:again in this run
    text = markdown([unique, repeated], {})
    assert "Goals met: 4 of 4." in text
    assert "The control (`llm` measured again" in text and "met 0 of the same 2 tests" in text

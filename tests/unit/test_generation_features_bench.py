"""bench.generation_features without a server: its modes, its order and its summary (made-up numbers)."""

from __future__ import annotations

import json

import pytest

from bench.generation_features import (
    MODES,
    PATHS,
    mode_sampling,
    ms_per_token,
    schedule,
    summarize,
    table,
    valid,
)


def sample(path: str, mode: str, e2e: float, ttft: float, tokens: int, **extra: object) -> dict[str, object]:
    return {"path": path, "mode": mode, "e2e_ms": e2e, "ttft_ms": ttft, "output_tokens": tokens, "error": None,
            "valid": None, "serving_path": None, **extra}  # fmt: skip


def test_ms_per_token_is_the_decode_time_after_the_first_token() -> None:
    assert ms_per_token(sample("llm", "plain", 410.0, 100.0, 32)) == pytest.approx(10.0)
    assert ms_per_token(sample("llm", "plain", 100.0, 100.0, 1)) is None  # one token: no decode step
    assert ms_per_token(sample("llm", "plain", None, None, 0)) is None  # type: ignore[arg-type]


def test_summary_medians_p90_and_ratios_against_the_paths_plain() -> None:
    samples = [
        # plain: e2e 100, 200, 300, 400 -> median 250, p90 370 (linear); 11 tokens, TTFT 50 -> ms/token 5..35
        *(sample("llm", "plain", e2e, 50.0, 11) for e2e in (400.0, 100.0, 300.0, 200.0)),
        # json: e2e 500 x3 -> median 500, ratio 2.0; ms/token (500 - 100) / 4 = 100 vs plain's median 20 -> 5.0
        *(sample("llm", "json_schema", 500.0, 100.0, 5, valid=True) for _ in range(3)),
        {**sample("llm", "json_schema", None, None, 0), "error": "refused"},  # type: ignore[arg-type]
        # another path, its own baseline: e2e 1000 and 1500 -> ratio 1.5
        sample("epd disaggregated", "plain", 1000.0, 0.0, 11),
        sample("epd disaggregated", "logprobs-5", 1500.0, 0.0, 11, serving_path="disaggregated"),
    ]
    summary = summarize(samples)
    assert list(summary) == ["llm", "epd disaggregated"] and list(summary["llm"]) == ["plain", "json_schema"]
    assert list(summarize(samples[::-1])) == list(summary)  # PATHS' and MODES' order, not the order seen
    plain = summary["llm"]["plain"]
    assert plain["requests"] == 4 and plain["errors"] == 0
    assert plain["e2e_ms_p50"] == pytest.approx(250.0) and plain["e2e_ms_p90"] == pytest.approx(370.0)
    assert plain["ms_per_token_p50"] == pytest.approx(20.0)  # (250 - 50) / 10
    assert plain["output_tokens_p50"] == 11 and plain["e2e_ratio"] == pytest.approx(1.0)
    json_row = summary["llm"]["json_schema"]
    assert (json_row["requests"], json_row["errors"], json_row["first_error"], json_row["valid"]) == (
        4,
        1,
        "refused",
        3,
    )
    assert json_row["e2e_ratio"] == pytest.approx(2.0)
    assert json_row["ms_per_token_ratio"] == pytest.approx(5.0)
    other = summary["epd disaggregated"]
    assert other["logprobs-5"]["e2e_ratio"] == pytest.approx(1.5)
    assert other["logprobs-5"]["serving_paths"] == ["disaggregated"]
    text = table(summary)
    assert "| llm | json_schema | 3 / 4 (3 valid) | 5 | 500 | 500 | 100 | 100.0 | 2.00x | 5.00x |" in text
    assert "| epd disaggregated | logprobs-5 | 1 / 1 | 11 | 1,500 |" in text


def test_a_mode_whose_every_request_failed_has_no_numbers_and_no_ratio() -> None:
    samples = [
        sample("llm", "plain", 100.0, 10.0, 4),
        {**sample("llm", "regex", None, None, 0), "error": "INVALID_ARG"},  # type: ignore[arg-type]
    ]
    row = summarize(samples)["llm"]["regex"]
    assert row["e2e_ms_p50"] is None and row["e2e_ratio"] is None and row["errors"] == 1
    assert "| llm | regex | 0 / 1 | - | - | - | - | - | -x | -x |" in table(summarize(samples))


def test_without_a_plain_row_there_is_no_ratio() -> None:
    assert summarize([sample("llm", "regex", 100.0, 10.0, 4)])["llm"]["regex"]["e2e_ratio"] is None


def test_every_round_runs_every_path_and_mode_once_in_a_seeded_order_of_its_own() -> None:
    order = schedule(3, seed=5)
    everything = sorted((path, mode) for path in PATHS for mode in MODES)
    assert all(sorted(pairs) == everything for pairs in order)
    assert order == schedule(3, seed=5) and order != schedule(3, seed=6)
    assert order[0] != order[1]  # shuffled anew each round


def test_modes_send_what_they_are_named_after() -> None:
    bias = {"220": -100.0}
    assert (
        mode_sampling("plain", bias) == mode_sampling("plain-control", bias) == {"temperature": 0.0, "max_tokens": 32}
    )
    json_mode = mode_sampling("json_schema", bias)
    assert json_mode["logit_bias"] == bias and "json" in json_mode["structured_outputs"]
    assert (
        "logit_bias" not in mode_sampling("regex", bias)
        and "regex" in mode_sampling("regex", bias)["structured_outputs"]
    )
    assert mode_sampling("logprobs-20", bias)["logprobs"] == 20
    assert mode_sampling("prompt-logprobs-5", bias)["prompt_logprobs"] == 5
    assert "logprobs" not in mode_sampling("prompt-logprobs-5", bias)
    with pytest.raises(ValueError, match="unknown mode"):
        mode_sampling("beam", bias)


def test_constrained_answers_are_checked_against_their_language() -> None:
    answer = {"title": "a\x01b", "kind": "photo", "objects": [{"name": "cat", "count": 2}]}
    assert valid("json_schema", json.dumps(answer, ensure_ascii=False), "stop") is True  # raw control char
    assert valid("json_schema", '{"title": "x"', "length") is False
    assert valid("regex", "some words here", "stop") is True
    assert valid("regex", "some words ", "length") is True  # cut by the token limit after a space
    assert valid("regex", "some words ", "stop") is False
    assert valid("plain", "anything", "length") is None

"""Test-only pauses (python_backends/runtime/stage_pauses.py): parsing, and that only a test repository has them."""

from __future__ import annotations

import pytest

from python_backends.runtime.stage_pauses import StagePauses, pause_line


def test_empty_means_no_pause():
    pauses = StagePauses.parse("")
    assert not pauses and pauses.start_s == 0 and pauses.after(1) == 0


def test_points_parse_to_seconds():
    pauses = StagePauses.parse('{"start": 2, "after_1": 1.5, "after_3": 4}')
    assert pauses and pauses.start_s == 2.0
    assert (pauses.after(1), pauses.after(2), pauses.after(3)) == (1.5, 0.0, 4.0)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[1]", "JSON object"),
        ("{", "not JSON"),
        ('{"middle": 1}', "unknown point"),
        ('{"after_0": 1}', "unknown point"),
        ('{"start": 0}', "> 0"),
        ('{"start": true}', "> 0"),
        ('{"start": "1"}', "> 0"),
    ],
)
def test_bad_pauses_are_refused_with_what_is_wrong(text: str, problem: str):
    with pytest.raises(ValueError, match=problem):
        StagePauses.parse(text)


def test_the_log_line_names_model_point_and_request():
    assert pause_line("epd", "after_1", "abc", 3.0) == "test pause: epd after_1 abc 3s"


def test_only_a_repository_generated_with_pauses_has_them():
    import dataclasses

    from builders.model_configs import _python_model_config
    from builders.repository import TARGETS
    from python_backends import contract

    for target in TARGETS.values():  # served targets: never
        assert all(target.test_parameters(m) == {} for m in target.models)
    paused = dataclasses.replace(TARGETS["cpu"], test_pauses={"epd": '{"start": 1}'})
    assert paused.test_parameters("epd") == {contract.TEST_PAUSES: '{"start": 1}'}
    assert paused.test_parameters("llm") == {}
    assert 'key: "test_pauses"' in _python_model_config(paused, "epd", contract.EPD, {})
    assert "test_pauses" not in _python_model_config(TARGETS["cpu"], "epd", contract.EPD, {})
    assert contract.EPD.accepts_parameter(contract.TEST_PAUSES)

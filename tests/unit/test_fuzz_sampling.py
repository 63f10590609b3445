"""Hypothesis: ``sampling_parameters`` of any JSON (or not JSON at all) is either accepted as
well-typed, finite, in-range keyword arguments for vLLM, or refused with our INVALID_ARG."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from python_backends.errors import EpdError, ErrorCode
from python_backends.request.sampling import _FIELDS, SamplingLimits, parse_sampling_parameters
from tests.unit.fuzz_settings import FUZZ

LIMIT = 64
# Edge values first: Hypothesis draws from the front of a one_of more often.
EDGES = st.sampled_from([float("inf"), float("-inf"), float("nan"), 2**63, -(2**63) - 1, 0, -1, 1.0, 1e308])
SCALARS = EDGES | st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
# Real field names with edge values (where bugs hide), and any names with any JSON values.
KNOWN = st.dictionaries(st.sampled_from(sorted(_FIELDS)), SCALARS, min_size=1, max_size=3)
OBJECTS = KNOWN | st.dictionaries(st.sampled_from(sorted(_FIELDS)) | st.text(max_size=12), JSON, max_size=5)


def _parse(raw: str) -> dict | None:
    try:
        return parse_sampling_parameters(raw, SamplingLimits(max_tokens=LIMIT))
    except EpdError as exc:
        assert exc.code is ErrorCode.INVALID_ARG and exc.message
        return None


def _check_accepted(params: dict) -> None:
    assert set(params) <= set(_FIELDS)
    assert isinstance(params["max_tokens"], int) and 1 <= params["max_tokens"] <= LIMIT
    for name, value in params.items():
        type_ok, _, range_ok, _ = _FIELDS[name]
        assert type_ok(value) and (range_ok is None or range_ok(value)), (name, value)
        if isinstance(value, float):
            assert math.isfinite(value), (name, value)
        if name == "seed":
            assert -(2**63) <= value < 2**63  # what vLLM's torch generators take


EDGE_VALUES = [float("inf"), float("-inf"), float("nan"), 2**63, -(2**63) - 1, 2**64, 0, -1, 1.0, 1e308, True, "1", [1]]


@pytest.mark.parametrize("name", sorted(_FIELDS))
def test_every_field_with_every_edge_value_is_accepted_well_formed_or_refused(name):
    """The edges exhaustively (random search may miss one field x value pair)."""
    for value in EDGE_VALUES:
        params = _parse(json.dumps({name: value}))
        if params is not None:
            _check_accepted(params)


@FUZZ
@given(OBJECTS)
def test_any_json_object_is_accepted_well_formed_or_refused_with_invalid_arg(values):
    params = _parse(json.dumps(values))  # NaN/Infinity floats become JSON's NaN/Infinity literals
    if params is not None:
        _check_accepted(params)


@FUZZ
@given(JSON | st.text(max_size=40).map(lambda t: {"_raw": t}))
def test_any_text_is_accepted_or_refused_with_invalid_arg(value):
    raw = value["_raw"] if isinstance(value, dict) and set(value) == {"_raw"} else json.dumps(value)
    params = _parse(raw)
    if params is not None:
        _check_accepted(params)

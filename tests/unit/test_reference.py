import json

import numpy as np
import pytest

from python_backends.errors import ErrorCode
from python_backends.store.reference import (
    MAX_REFERENCE_BYTES,
    Reference,
    make_reference,
    parse_reference,
)
from tests.store_helpers import error_of

SECRET = b"s" * 32


def signed(**overrides) -> Reference:
    fields = dict(
        modality="image",
        mm_hash="a" * 64,
        store_id="0123456789abcdef0123456789abcdef",
        location="shm://node-1",
        key="b" * 64,
        generation=7,
        lease_id="c" * 32,
        dtype="float16",
        shape=(64, 3584),
        num_placeholders=64,
        grid_thw=(1, 16, 16),
        secret=SECRET,
        merge_size=2,
    )
    fields.update(overrides)
    return make_reference(**fields)


def edited(reference: Reference, **changes) -> bytes:
    fields = json.loads(reference.to_bytes())
    fields.update(changes)
    return json.dumps(fields).encode()


def test_round_trip_keeps_every_field():
    reference = signed()
    parsed = parse_reference(reference.to_bytes(), merge_size=2, secret=SECRET)
    assert parsed == reference
    assert parsed.nbytes == 64 * 3584 * 2
    assert parsed.numpy_dtype() == np.dtype("<f2")


def test_wire_form_is_compact_canonical_json():
    raw = signed().to_bytes()
    assert b" " not in raw
    assert list(json.loads(raw)) == sorted(json.loads(raw))


def test_large_embedding_reference_fits_in_one_kilobyte():
    # 16384 placeholder rows of a 3584-wide float16 embedding: 112 MiB of data, one small reference.
    reference = signed(shape=(16384, 3584), num_placeholders=16384, grid_thw=(1, 256, 256))
    assert reference.nbytes == 16384 * 3584 * 2
    assert len(reference.to_bytes()) <= MAX_REFERENCE_BYTES


def test_longest_allowed_fields_still_fit_in_one_kilobyte():
    reference = signed(
        mm_hash="m" * 128,
        location="x" * 128,
        key="f" * 128,
        generation=2**63 - 1,
        shape=(2**31 - 1, 2, 2, 64),
        num_placeholders=2**31 - 1,
        grid_thw=None,
        dtype="bfloat16",
    )
    assert len(reference.to_bytes()) <= MAX_REFERENCE_BYTES


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"gen": 8}, "integrity"),
        ({"lease": "d" * 32}, "integrity"),
        ({"key": "e" * 64}, "integrity"),
        ({"mm": "other"}, "integrity"),
    ],
)
def test_tampered_reference_fails_the_integrity_check(changes, fragment):
    error = error_of(lambda: parse_reference(edited(signed(), **changes), merge_size=2, secret=SECRET))
    assert error.code is ErrorCode.INVALID_ARG
    assert fragment in error.message


def test_reference_signed_with_another_secret_is_rejected():
    error = error_of(lambda: parse_reference(signed().to_bytes(), secret=b"other secret"))
    assert error.code is ErrorCode.INVALID_ARG
    assert "integrity" in error.message


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"v": 2}, "version 2 is not supported"),
        ({"v": True}, "'v' must be an integer"),
        ({"gen": 0}, "'gen' must be in"),
        ({"gen": "7"}, "'gen' must be an integer"),
        ({"mod": "smell"}, "'mod' must be one of"),
        ({"dt": "int8"}, "'dt' must be one of"),
        ({"sh": []}, "'sh' must be a list of 1 to 4"),
        ({"sh": [64, 0]}, "'sh' must be in"),
        ({"sh": [64, 3584.0]}, "'sh' must be an integer"),
        ({"sh": [64, 1, 1, 1, 1]}, "'sh' must be a list of 1 to 4"),
        ({"nb": 12}, "byte length 12 does not match shape"),
        ({"n": 63}, "placeholder count 63 must equal"),
        ({"grid": [1, 16, 14]}, "gives 56 placeholder tokens"),
        ({"grid": [1, 16]}, "'grid' must be a list of 3"),
        ({"grid": [0, 16, 16]}, "'grid' must be in"),
        ({"key": "XYZ"}, "'key' must be"),
        ({"sid": "not-an-id"}, "'sid' must be"),
        ({"lease": "short"}, "'lease' must be"),
        ({"loc": "has space"}, "'loc' must be"),
        ({"tag": "00"}, "'tag' must be"),
        ({"mm": ""}, "'mm' must be"),
    ],
)
def test_invalid_fields_are_named_in_the_error(changes, fragment):
    error = error_of(lambda: parse_reference(edited(signed(), **changes), merge_size=2))
    assert error.code is ErrorCode.INVALID_ARG
    assert fragment in error.message


def test_missing_and_unknown_fields_are_listed():
    fields = json.loads(signed().to_bytes())
    del fields["grid"]
    fields["offset"] = 0
    error = error_of(lambda: parse_reference(json.dumps(fields).encode()))
    assert "missing ['grid'], unknown ['offset']" in error.message


@pytest.mark.parametrize(
    "data, fragment",
    [
        (b"", "empty"),
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b"{" + b" " * MAX_REFERENCE_BYTES + b"}", "at most 1024"),
        ("a string", "must be bytes"),
    ],
)
def test_malformed_input_is_invalid_arg(data, fragment):
    error = error_of(lambda: parse_reference(data))
    assert error.code is ErrorCode.INVALID_ARG
    assert fragment in error.message


def test_grid_is_optional_and_only_checked_against_a_known_merge_size():
    without_grid = signed(grid_thw=None)
    assert parse_reference(without_grid.to_bytes(), merge_size=2).grid_thw is None
    odd_grid = edited(signed(), grid=[1, 16, 14])
    assert parse_reference(odd_grid).grid_thw == (1, 16, 14)  # structure fine; layout needs the merge size


def test_signing_refuses_an_inconsistent_layout():
    error = error_of(lambda: signed(num_placeholders=65))
    assert error.code is ErrorCode.INVALID_ARG
    assert "placeholder count 65" in error.message

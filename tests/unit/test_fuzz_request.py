"""Hypothesis: the user request parser (``parse_generate_request`` + the header checks ``epd``
runs at its edge) and the Triton request parameters (``tenant``, ``encoder``) take any tensors
and any parameter JSON to a well-formed request or our INVALID_ARG, never another exception."""

from __future__ import annotations

import json
import unicodedata

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from python_backends.errors import EpdError, ErrorCode
from python_backends.request.generate import (
    IMAGE_PAD,
    MM_HASH_PREFIX,
    CachedImage,
    RequestLimits,
    check_image_headers,
    parse_generate_request,
)
from python_backends.request.images import ImageLimits
from python_backends.request.parameters import RequestParameters
from python_backends.request.sampling import SamplingLimits
from python_backends.request.tenants import MAX_TENANT_CHARS
from tests.images import synthetic_image
from tests.unit.fuzz_settings import FUZZ

LIMITS = RequestLimits(
    images=ImageLimits(max_images=3, max_image_bytes=1 << 16, max_image_pixels=128 * 128),
    sampling=SamplingLimits(max_tokens=32),
    max_prompt_chars=500,
    accept_mm_hash=True,
)
GOOD = synthetic_image(32, 24, seed=3)
TEXT = st.text(max_size=40) | st.sampled_from(["", IMAGE_PAD, IMAGE_PAD * 2 + "x", "a" * 501])
ITEM = (
    st.binary(max_size=64)
    | st.just(GOOD)
    | st.builds(lambda h: MM_HASH_PREFIX + h.encode(), st.text("0123456789abcdefABCDEF", min_size=60, max_size=66))
)
SCALAR_ARRAYS = st.one_of(
    st.builds(lambda v: np.array([v], dtype=np.object_), st.binary(max_size=40) | TEXT.map(str.encode)),
    st.builds(lambda v: np.array(v, dtype=np.object_), st.lists(st.binary(max_size=8), max_size=3)),
    st.builds(lambda v: np.array([v]), st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=True)),
    st.just(np.zeros((0,), dtype=np.object_)),
)
SAMPLING = st.one_of(
    st.dictionaries(
        st.sampled_from(["max_tokens", "temperature", "seed", "stop", "top_p", "bogus"]),
        st.none() | st.booleans() | st.integers(-100, 100) | st.floats() | st.text(max_size=4),
        max_size=3,
    ).map(lambda d: np.array([json.dumps(d).encode()], dtype=np.object_)),
    SCALAR_ARRAYS,
)


@st.composite
def requests(draw: st.DrawFn) -> dict[str, np.ndarray]:
    inputs: dict[str, np.ndarray] = {}
    if draw(st.integers(0, 9)):  # mostly present
        inputs["text_input"] = draw(SCALAR_ARRAYS | TEXT.map(lambda t: np.array([t.encode()], dtype=np.object_)))
    if draw(st.booleans()):
        items = draw(st.lists(ITEM, max_size=4))
        inputs["image"] = (
            np.array(items, dtype=np.object_) if draw(st.integers(0, 5)) else np.frombuffer(GOOD, np.uint8)
        )
    for name in ("stream", "exclude_input_in_output"):
        if draw(st.booleans()):
            inputs[name] = draw(st.builds(lambda v: np.array([v]), st.booleans()) | SCALAR_ARRAYS)
    if draw(st.booleans()):
        inputs["sampling_parameters"] = draw(SAMPLING)
    return inputs


@FUZZ
@given(requests())
def test_any_request_parses_well_formed_or_fails_with_invalid_arg(inputs):
    try:
        request = parse_generate_request(inputs, LIMITS)
        check_image_headers(request, LIMITS)
    except EpdError as exc:
        assert exc.code is ErrorCode.INVALID_ARG and exc.message
        return
    assert len(request.images) <= LIMITS.images.max_images
    assert request.prompt.count(IMAGE_PAD) == len(request.images)
    assert 1 <= request.sampling["max_tokens"] <= LIMITS.sampling.max_tokens
    assert not (request.stream and not request.exclude_input_in_output)
    for image in request.images:
        assert isinstance(image, CachedImage) and len(image.mm_hash) == 64 or isinstance(image, bytes) and image


PARAMETER_VALUES = (
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=300) | st.lists(st.integers())
)


@FUZZ
@given(
    st.dictionaries(st.sampled_from(["tenant", "encoder", "other"]), PARAMETER_VALUES, max_size=3)
    | st.text(max_size=30)
)
def test_any_request_parameters_give_a_checked_tenant_and_encoder_or_invalid_arg(parameters):
    raw = parameters if isinstance(parameters, str) else json.dumps(parameters)
    given_tenant = parameters.get("tenant") if isinstance(parameters, dict) else None
    try:
        parsed = RequestParameters.parse(raw)
        tenant, encoder = parsed.tenant, parsed.encoder
        assert encoder is None or isinstance(encoder, str) and encoder
        if tenant is not None:
            assert 1 <= len(tenant) <= MAX_TENANT_CHARS
            assert not any(unicodedata.category(char) == "Cc" for char in tenant)
    except EpdError as exc:
        assert exc.code is ErrorCode.INVALID_ARG
        if isinstance(given_tenant, str) and len(given_tenant) >= 8:
            assert given_tenant not in exc.message  # a tenant name never reaches a message

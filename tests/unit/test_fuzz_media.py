"""Hypothesis: the media checks (``image_bytes``, header check, full decode) answer any bytes --
random, or a real image of each format truncated, bit-flipped or with a forged size -- with a
decoded picture within the limits or our INVALID_ARG, never another exception."""

from __future__ import annotations

import base64
import struct

from hypothesis import given
from hypothesis import strategies as st

from python_backends.errors import EpdError, ErrorCode
from python_backends.request.images import ImageLimits, check_image_header, decode_rgb, image_bytes
from tests.images import synthetic_image
from tests.unit.fuzz_settings import FUZZ

LIMITS = ImageLimits(max_images=2, max_image_bytes=1 << 20, max_image_pixels=256 * 256)
FORMATS = ("JPEG", "PNG", "GIF", "BMP", "TIFF", "WEBP")
SAMPLES = {fmt: synthetic_image(40, 30, seed=i, fmt=fmt) for i, fmt in enumerate(FORMATS)}


@st.composite
def damaged_images(draw: st.DrawFn) -> bytes:
    data = bytearray(SAMPLES[draw(st.sampled_from(FORMATS))])
    for _ in range(draw(st.integers(0, 4))):  # flip bytes, biased towards the header
        where = draw(st.integers(0, min(len(data) - 1, draw(st.sampled_from((64, len(data) - 1))))))
        data[where] = draw(st.integers(0, 255))
    if draw(st.booleans()):  # a forged size field where PNG keeps it (width, height at 16..24)
        data[16:24] = struct.pack(">II", draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 2**32 - 1)))
    cut = draw(st.integers(0, len(data)))
    return bytes(data[:cut]) if draw(st.booleans()) else bytes(data)


ITEMS = st.binary(max_size=200) | damaged_images() | damaged_images().map(base64.b64encode)


@FUZZ
@given(ITEMS)
def test_any_bytes_decode_within_the_limits_or_fail_with_invalid_arg(item):
    try:
        data = image_bytes(item, 0)
        width, height = check_image_header(data, 0, LIMITS)
        picture = decode_rgb(data, 0, LIMITS)
    except EpdError as exc:
        assert exc.code is ErrorCode.INVALID_ARG and exc.message.startswith("image[0]"), exc.message
        return
    assert width * height <= LIMITS.max_image_pixels and picture.mode == "RGB"
    assert sorted(picture.size) == sorted((width, height))  # EXIF may swap them, never change them

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from python_backends.errors import EpdError, ErrorCode
from python_backends.request.generate import (
    IMAGE_PLACEHOLDER,
    CachedImage,
    RequestLimits,
    check_image_headers,
    parse_generate_request,
    with_image_placeholders,
)
from python_backends.request.images import ImageLimits, check_image_header, decode_images, image_bytes
from python_backends.request.sampling import DEFAULT_MAX_TOKENS, SamplingLimits, parse_sampling_parameters
from tests.images import header_only_png


def png(width: int = 32, height: int = 24, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height)).save(buf, format="PNG")
    return buf.getvalue()


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def images(*items: bytes) -> np.ndarray:
    return np.array(list(items), dtype=np.object_)


LIMITS = RequestLimits(images=ImageLimits(max_images=2, max_image_bytes=1 << 20, max_image_pixels=1000 * 1000))


def invalid(call) -> str:
    with pytest.raises(EpdError) as info:
        call()
    assert info.value.code is ErrorCode.INVALID_ARG
    return info.value.message


def test_plain_prompt_gets_one_placeholder_per_image_in_front():
    req = parse_generate_request({"text_input": text("hi"), "image": images(png(), png())}, LIMITS)
    assert req.prompt == IMAGE_PLACEHOLDER * 2 + "hi"
    assert len(req.images) == 2
    assert req.stream is False and req.exclude_input_in_output is False
    assert req.sampling == {"max_tokens": DEFAULT_MAX_TOKENS}


def test_placeholders_written_by_the_client_are_kept():
    prompt = f"a {IMAGE_PLACEHOLDER} b"
    assert with_image_placeholders(prompt, 1) == prompt
    assert "placeholders" in invalid(lambda: with_image_placeholders(prompt, 2))


def test_base64_image_is_accepted():
    req = parse_generate_request({"text_input": text("x"), "image": images(base64.b64encode(png()))}, LIMITS)
    assert req.images == [png()]


def test_streaming_defaults_to_deltas_and_rejects_prepending_input():
    req = parse_generate_request({"text_input": text("x"), "stream": np.array([True])}, LIMITS)
    assert req.stream and req.exclude_input_in_output
    msg = invalid(
        lambda: parse_generate_request(
            {"text_input": text("x"), "stream": np.array([True]), "exclude_input_in_output": np.array([False])}, LIMITS
        )
    )
    assert "streaming" in msg


@pytest.mark.parametrize(
    "inputs, fragment",
    [
        ({}, "missing required input 'text_input'"),
        ({"text_input": text("")}, "empty"),
        ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "exactly one element"),
        ({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}, "UTF-8"),
        ({"text_input": text("x"), "image": images(png(), png(), png())}, "above the limit of 2 (max_images)"),
        ({"text_input": text("x"), "image": images(b"")}, "image[0] is empty"),
        ({"text_input": text("x"), "image": images(b"not an image at all")}, "neither an encoded image"),
        ({"text_input": text("x"), "image": np.array([1.0])}, "must be BYTES"),
        ({"text_input": text("x"), "stream": np.array([1], dtype=np.int32)}, "'stream' must be BOOL"),
        ({"text_input": text("x"), "sampling_parameters": text("{bad json")}, "not valid JSON"),
    ],
)
def test_bad_requests_say_what_is_wrong(inputs, fragment):
    assert fragment in invalid(lambda: parse_generate_request(inputs, LIMITS))


@pytest.mark.parametrize(
    "params, fragment",
    [
        ({"temprature": 0.5}, "unknown sampling parameter 'temprature'"),
        ({"max_tokens": "8"}, "'max_tokens' must be a integer"),
        ({"max_tokens": 0}, "'max_tokens' must be >= 1"),
        ({"max_tokens": 10_000}, "above this model's limit"),
        ({"temperature": -1}, "'temperature' must be >= 0"),
        ({"top_p": 0}, "'top_p' must be in (0, 1]"),
        ({"ignore_eos": 1}, "'ignore_eos' must be a boolean"),
        ({"stop": [1, 2]}, "'stop' must be a string or list of strings"),
    ],
)
def test_bad_sampling_parameters(params, fragment):
    assert fragment in invalid(lambda: parse_sampling_parameters(json.dumps(params), SamplingLimits(4096)))


def test_sampling_parameters_pass_through():
    params = {"max_tokens": 8, "temperature": 0, "top_k": -1, "stop": ["x"], "ignore_eos": True, "seed": 3}
    assert parse_sampling_parameters(json.dumps(params), SamplingLimits(4096)) == params
    assert "JSON object" in invalid(lambda: parse_sampling_parameters("[1]", SamplingLimits(4096)))


def test_image_limits_are_checked_from_the_header():
    limits = ImageLimits(max_images=1, max_image_bytes=1 << 20, max_image_pixels=100 * 100)
    assert check_image_header(png(100, 100), 0, limits) == (100, 100)
    assert "max_image_pixels" in invalid(lambda: check_image_header(png(101, 100), 0, limits))
    assert "max_image_bytes" in invalid(lambda: check_image_header(png(), 0, ImageLimits(max_image_bytes=10)))


def test_decompression_bomb_is_rejected_without_decoding():
    # A 30000x30000 PNG header: PIL's lazy open reads only the header.
    bomb = header_only_png(30000, 30000)
    assert "max_image_pixels" in invalid(lambda: check_image_header(bomb, 0, ImageLimits()))


def test_truncated_and_corrupt_images_fail_at_decode():
    data = png(64, 64)
    assert "cannot" in invalid(lambda: decode_images([data[: len(data) // 2]], ImageLimits()))
    corrupt = b"\xff\xd8\xff" + b"\x00" * 100
    assert "cannot" in invalid(lambda: decode_images([corrupt], ImageLimits()))


def test_modes_are_converted_to_rgb():
    decoded = decode_images([png(8, 8, "L"), png(8, 8, "RGBA")], ImageLimits())
    assert [img.mode for img in decoded] == ["RGB", "RGB"]
    assert image_bytes(png(), 0) == png()


def test_exif_orientation_is_applied_like_the_dali_path():
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    exif = img.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    buf = io.BytesIO()
    img.save(buf, format="JPEG", exif=exif)
    (decoded,) = decode_images([buf.getvalue()], ImageLimits())
    assert decoded.size == (20, 40)


def test_mm_hash_items_only_where_accepted_and_well_formed():
    key = "ab" * 32
    inputs = {"text_input": text("hi"), "image": images(png(), f"mm_hash:{key}".encode())}
    assert "served by epd" in invalid(lambda: parse_generate_request(inputs, LIMITS))
    epd_limits = RequestLimits(images=LIMITS.images, accept_mm_hash=True)
    parsed = parse_generate_request(inputs, epd_limits)
    assert parsed.images[1] == CachedImage(key) and isinstance(parsed.images[0], bytes)
    bad = {"text_input": text("hi"), "image": images(b"mm_hash:XYZ")}
    assert "64 lowercase hex" in invalid(lambda: parse_generate_request(bad, epd_limits))


def test_edge_header_checks_name_the_bad_image_by_index():
    inputs = {"text_input": text("hi"), "image": images(png(), png(1000, 4))}
    parsed = parse_generate_request(inputs, LIMITS)
    assert invalid(lambda: check_image_headers(parsed, LIMITS)).startswith("image[1] is 1000x4: aspect ratio above 200")
    big = parse_generate_request({"text_input": text("hi"), "image": images(png(1200, 1000))}, LIMITS)
    assert "max_image_pixels" in invalid(lambda: check_image_headers(big, LIMITS))


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "kind": {"enum": ["a", "b"]}, "tags": {"type": "array"}},
    "required": ["name", "kind"],
}


@pytest.mark.parametrize(
    "params",
    [
        {"structured_outputs": {"json": SCHEMA}},
        {"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}},
        {"structured_outputs": {"regex": "[a-z]{3}-[0-9]+"}},
        {"structured_outputs": {"choice": ["yes", "no"]}},
        {"structured_outputs": {"json_object": True}},
        {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
        {"logprobs": 0, "prompt_logprobs": 20},
        {"n": 3, "seed": 7},
        {"logit_bias": {"17": -100, "3": 2.5}, "allowed_token_ids": [1, 2, 3], "bad_words": ["x y"]},
    ],
)
def test_generation_features_pass_through(params):
    assert parse_sampling_parameters(json.dumps(params), SamplingLimits(4096)) == {**params, "max_tokens": 16}


@pytest.mark.parametrize(
    "params, fragment",
    [
        ({"logprobs": 21}, "'logprobs' is 21, above this model's limit of 20 (max_logprobs)"),
        ({"prompt_logprobs": 50}, "'prompt_logprobs' is 50, above this model's limit of 20 (max_logprobs)"),
        ({"logprobs": -1}, "'logprobs' must be >= 0"),
        ({"n": 17}, "'n' is 17, above this model's limit of 16 (max_n)"),
        ({"n": 0}, "'n' must be >= 1"),
        ({"n": 2, "temperature": 0}, "'n' must be 1 when sampling greedily"),
        ({"logit_bias": {"x": 1}}, "'logit_bias' must be a object of token id -> number"),
        ({"logit_bias": {"5": 101}}, "within [-100, 100]"),
        ({"allowed_token_ids": []}, "'allowed_token_ids' must be non-empty"),
        (
            {"structured_outputs": {"regex": "(unclosed"}},
            "'structured_outputs.regex' is not a valid regular expression",
        ),
        ({"structured_outputs": {"json": {"type": 5}}}, "'structured_outputs.json' is not a valid JSON schema"),
        ({"structured_outputs": {"json": "{no"}}, "'structured_outputs.json' is not valid JSON"),
        ({"structured_outputs": {"choice": []}}, "'structured_outputs.choice' must be a non-empty list"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "must set exactly one of"),
        ({"structured_outputs": {}}, "must set exactly one of"),
        ({"structured_outputs": {"jsn": {}}}, "unknown field 'structured_outputs.jsn'"),
        ({"structured_outputs": "json"}, "'structured_outputs' must be an object"),
    ],
)
def test_generation_feature_limits_name_the_field(params, fragment):
    assert fragment in invalid(lambda: parse_sampling_parameters(json.dumps(params), SamplingLimits(4096)))


def test_checkpoint_defaults_apply_where_the_request_is_silent():
    defaults = {"top_k": 1, "temperature": 0.01, "max_tokens": 64}
    assert parse_sampling_parameters(None, SamplingLimits(), defaults) == defaults
    assert parse_sampling_parameters('{"temperature": 0.7}', SamplingLimits(), defaults) == {
        **defaults,
        "temperature": 0.7,
    }

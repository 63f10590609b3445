"""Embeddings by value (``image_embeds`` + ``image_grid_thw``): validated before vLLM sees them."""

from __future__ import annotations

import numpy as np
import pytest

from python_backends.errors import EpdError, ErrorCode
from python_backends.request.generate import (
    IMAGE_PLACEHOLDER,
    RequestLimits,
    parse_generate_request,
)
from python_backends.request.image_embeds import (
    EmbedsSpec,
    parse_image_embeds,
    tokens_per_image,
)
from python_backends.request.images import ImageLimits
from tests.images import synthetic_image

SPEC = EmbedsSpec(hidden_size=8, merge_size=2)
LIMITS = RequestLimits(images=ImageLimits(max_images=3), image_embeds=SPEC)


def grid(*rows: tuple[int, int, int]) -> np.ndarray:
    return np.array(rows, dtype=np.int64)


def embeds(tokens: int, hidden: int = 8, leading: int | None = 1) -> np.ndarray:
    values = np.arange(tokens * hidden, dtype=np.float32).reshape(tokens, hidden)
    return values if leading is None else values.reshape(leading, tokens // leading, hidden)


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def invalid(inputs: dict, spec: EmbedsSpec | None = SPEC, max_images: int = 3) -> str:
    with pytest.raises(EpdError) as info:
        parse_image_embeds(inputs, spec, max_images)
    assert info.value.code is ErrorCode.INVALID_ARG
    return info.value.message


def test_no_embeddings_is_none():
    assert parse_image_embeds({"text_input": text("x")}, SPEC, 3) is None
    assert parse_image_embeds({}, None, 3) is None  # a model without the spec ignores nothing sent


def test_embeddings_and_grid_without_rows_are_no_image():
    """What the ensemble's encode steps give llm for a request without an image: [1, 0, hidden]
    embeddings and a [0, 3] grid."""
    empty = {"image_embeds": np.zeros((1, 0, 8), np.float32), "image_grid_thw": np.zeros((0, 3), np.int64)}
    assert parse_image_embeds(empty, SPEC, 3) is None
    assert parse_image_embeds({**empty, "image_embeds": np.zeros((0, 8), np.float32)}, SPEC, 3) is None
    request = parse_generate_request({"text_input": text("hi"), **empty}, LIMITS)
    assert request.image_embeds is None and request.images == [] and request.prompt == "hi"
    with pytest.raises(EpdError, match="text_input is empty"):  # no text and no image: nothing to answer
        parse_generate_request({"text_input": text(""), **empty}, LIMITS)


def test_encode_output_is_taken_as_it_is():
    # encode returns [1, tokens, hidden] and [1, 3]; grid (1, 4, 6) -> 24 patches / 4 = 6 tokens.
    parsed = parse_image_embeds({"image_embeds": embeds(6), "image_grid_thw": grid((1, 4, 6))}, SPEC, 3)
    assert parsed.embeds.shape == (6, 8) and parsed.num_images == 1
    assert parsed.grid_thw.tolist() == [[1, 4, 6]]


def test_several_images_concatenated_or_stacked():
    g = grid((1, 4, 6), (1, 2, 2))  # 6 + 1 tokens
    assert tokens_per_image(g, 2) == [6, 1]
    for array in (embeds(7, leading=None), embeds(7, leading=1)):
        parsed = parse_image_embeds({"image_embeds": array, "image_grid_thw": g}, SPEC, 3)
        assert parsed.embeds.shape == (7, 8) and parsed.num_images == 2
    same = grid((1, 4, 4), (1, 4, 4))  # two images of 4 tokens as [2, 4, hidden]
    assert parse_image_embeds({"image_embeds": embeds(8, leading=2), "image_grid_thw": same}, SPEC, 3).num_images == 2
    # One grid as a flat [3] is one image.
    assert (
        parse_image_embeds({"image_embeds": embeds(6), "image_grid_thw": np.array([1, 4, 6])}, SPEC, 3).num_images == 1
    )


def test_multi_modal_data_is_vllms_embeds_form():
    parsed = parse_image_embeds({"image_embeds": embeds(7), "image_grid_thw": grid((1, 4, 6), (1, 2, 2))}, SPEC, 3)
    data = parsed.multi_modal_data()["image"]
    assert tuple(data["image_embeds"].shape) == (7, 8) and str(data["image_embeds"].dtype) == "torch.float32"
    assert data["image_grid_thw"].tolist() == [[1, 4, 6], [1, 2, 2]]


@pytest.mark.parametrize(
    "inputs, fragment",
    [
        (
            {"image_embeds": embeds(6, hidden=16), "image_grid_thw": grid((1, 4, 6))},
            "hidden size 16, the model expects 8",
        ),
        (
            {"image_embeds": embeds(5), "image_grid_thw": grid((1, 4, 6))},
            "has 5 tokens but image_grid_thw [[1, 4, 6]] needs 6",
        ),
        ({"image_embeds": embeds(7), "image_grid_thw": grid((1, 4, 6))}, "needs 6"),
        ({"image_embeds": embeds(6), "image_grid_thw": grid((1, 3, 8))}, "multiples of the merge size 2"),
        ({"image_embeds": embeds(6), "image_grid_thw": grid((0, 4, 6))}, "must be positive"),
        ({"image_embeds": embeds(6), "image_grid_thw": grid((1, -4, -6))}, "must be positive"),
        ({"image_embeds": embeds(6)}, "needs 'image_grid_thw' too"),
        ({"image_grid_thw": grid((1, 4, 6))}, "needs 'image_embeds' too"),
        (
            {"image_embeds": embeds(6), "image_grid_thw": grid((1, 4, 6)), "image": np.array([b"x"], dtype=np.object_)},
            "not both",
        ),
        ({"image_embeds": embeds(6).astype(np.float64), "image_grid_thw": grid((1, 4, 6))}, "must be FP32"),
        ({"image_embeds": embeds(6), "image_grid_thw": grid((1, 4, 6)).astype(np.int32)}, "must be INT64"),
        (
            {"image_embeds": np.zeros((1, 1, 6, 8), np.float32), "image_grid_thw": grid((1, 4, 6))},
            "[tokens, hidden] or [n, tokens, hidden]",
        ),
        ({"image_embeds": embeds(6), "image_grid_thw": np.zeros((1, 4), np.int64)}, "must be [images, 3]"),
        ({"image_embeds": embeds(6), "image_grid_thw": np.zeros((0, 3), np.int64)}, "has no rows (no image) but"),
        ({"image_embeds": np.zeros((1, 0, 6), np.float32), "image_grid_thw": np.zeros((0, 3), np.int64)}, "hidden"),
        (
            {"image_embeds": embeds(4, leading=None), "image_grid_thw": grid(*[(1, 2, 2)] * 4)},
            "above the limit of 3 (max_images)",
        ),
    ],
)
def test_bad_embeddings_say_what_is_wrong(inputs, fragment):
    assert fragment in invalid(inputs)


def test_non_finite_values_are_refused():
    for bad in (np.nan, np.inf):
        values = embeds(6)
        values[0, 3, 1] = bad
        assert "NaN or infinite" in invalid({"image_embeds": values, "image_grid_thw": grid((1, 4, 6))})


def test_a_model_without_the_spec_refuses_embeddings():
    assert "does not take image_embeds" in invalid(
        {"image_embeds": embeds(6), "image_grid_thw": grid((1, 4, 6))}, spec=None
    )


def test_generate_request_counts_embedded_images_for_placeholders():
    inputs = {"text_input": text("hi"), "image_embeds": embeds(7), "image_grid_thw": grid((1, 4, 6), (1, 2, 2))}
    request = parse_generate_request(inputs, LIMITS)
    assert request.prompt == IMAGE_PLACEHOLDER * 2 + "hi"
    assert request.images == [] and request.image_embeds.num_images == 2
    # Placeholders written by the client must match the embedded images.
    one = {**inputs, "text_input": text(f"a {IMAGE_PLACEHOLDER} b")}
    with pytest.raises(EpdError, match="1 <\\|image_pad\\|> placeholders but the request has 2 images"):
        parse_generate_request(one, LIMITS)
    # Embeddings alone (empty text) are a valid request.
    assert parse_generate_request({**inputs, "text_input": text("")}, LIMITS).image_embeds is not None


def test_raw_image_requests_are_unchanged():
    request = parse_generate_request(
        {"text_input": text("hi"), "image": np.array([synthetic_image(32, 32, 1)], dtype=np.object_)}, LIMITS
    )
    assert request.image_embeds is None and len(request.images) == 1
    assert request.prompt == IMAGE_PLACEHOLDER + "hi"


def test_embedding_errors_reach_triton_as_invalid_arg():
    import triton_python_backend_utils as pb_utils

    from python_backends.triton_edge.responses import triton_error

    with pytest.raises(EpdError) as info:
        parse_image_embeds({"image_embeds": embeds(5), "image_grid_thw": grid((1, 4, 6))}, SPEC, 3)
    error = triton_error(info.value)
    assert error.code() == pb_utils.TritonError.INVALID_ARG and "needs 6" in error.message()


def test_client_sends_images_as_bytes_and_one_uint8_image_to_the_gpu_ensemble():
    """The cpu target's ``ensemble`` takes 0..N images as BYTES, like ``llm``; the gpu target's
    takes exactly one as UINT8 [1, bytes], which the client learns from the model's metadata."""
    import tritonclient.grpc as grpcclient

    from client.epd_client import ClientError, build_inputs, check_images_for, takes_one_uint8_image

    image = synthetic_image(32, 32, 1)
    inputs = {i.name(): i for i in build_inputs(grpcclient, "hi", [image], True, None, None, one_image_uint8=True)}
    assert inputs["image"].datatype() == "UINT8" and inputs["image"].shape() == [1, len(image)]
    inputs = {i.name(): i for i in build_inputs(grpcclient, "hi", [image, image], True, None, None)}
    assert inputs["image"].datatype() == "BYTES" and inputs["image"].shape() == [2]
    assert "image" not in {i.name() for i in build_inputs(grpcclient, "hi", [], True, None, None)}
    gpu = {"inputs": [{"name": "text_input", "datatype": "BYTES"}, {"name": "image", "datatype": "UINT8"}]}
    cpu = {"inputs": [{"name": "text_input", "datatype": "BYTES"}, {"name": "image", "datatype": "BYTES"}]}
    assert takes_one_uint8_image(gpu) and not takes_one_uint8_image(cpu) and not takes_one_uint8_image({})
    check_images_for("ensemble", [image], one_image_uint8=True)
    for count in (0, 2, 4):
        check_images_for("ensemble", [image] * count, one_image_uint8=False)
    for count in (0, 2):
        with pytest.raises(ClientError, match="exactly one image"):
            check_images_for("ensemble", [image] * count, one_image_uint8=True)

"""`ensemble` (preprocess -> vit_encoder -> llm, embeddings by value) and `llm` fed with
embeddings, over the wire (cpu target).

Greedy tokens must be the same whichever way the images reach the LM: raw images into ``llm``
(vLLM's own processor + vision tower), ``ensemble`` (torchvision + ONNX Runtime, streamed through
the ensemble; 0 to max_images images per request, as ``llm`` takes them), or ``encode``'s
embeddings sent to ``llm`` by the client.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from builders.repository import TARGETS
from builders.tritonserver import TritonServer
from client.epd_client import ClientError, GenerateResult, GrpcClient, HttpClient, chat_prompt
from tests.images import synthetic_image

pytestmark = pytest.mark.server

GREEDY = {"max_tokens": 12, "temperature": 0.0}
EXACT = {**GREEDY, "ignore_eos": True}  # exactly 12 tokens, whatever the random model's greedy choices
HIDDEN = 128  # the tiny default model's LM hidden size (== encode's image_embeds width)
OUTPUTS = ("text_output", "output_token_ids", "num_input_tokens", "num_output_tokens", "finish_reason")
# One image each: sizes, aspect ratios and formats vary.
CASES = [
    ("What is in this picture?", synthetic_image(640, 480, 21)),
    ("Describe the scene.", synthetic_image(64, 64, 22)),
    ("Read the tall image.", synthetic_image(300, 1000, 23)),
    ("Is this wide?", synthetic_image(1920, 1080, 24)),
    ("Tiny one.", synthetic_image(28, 28, 25, "PNG")),
]


@pytest.fixture(scope="module")
def llm(server: TritonServer):
    client = GrpcClient(server.grpc_url, "llm")
    yield client
    client.close()


@pytest.fixture(scope="module")
def ensemble(server: TritonServer):
    client = GrpcClient(server.grpc_url, "ensemble")
    yield client
    client.close()


@pytest.fixture(scope="module")
def raw(server: TritonServer):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def llm_tokens(llm: GrpcClient) -> list[list[int]]:
    """The baseline: ``llm`` with the raw image (test_llm.py proves it equals offline vLLM)."""
    return [llm.generate(chat_prompt(text, 1), [image], GREEDY).token_ids for text, image in CASES]


def _tensor(name: str, array: np.ndarray, dtype: str) -> grpcclient.InferInput:
    item = grpcclient.InferInput(name, list(array.shape), dtype)
    item.set_data_from_numpy(array)
    return item


def _images(images: Sequence[bytes]) -> grpcclient.InferInput:
    """``image`` as the cpu target's ``encode`` and ``ensemble`` take it: BYTES [n] (n may be 0)."""
    return _tensor("image", np.array(list(images), dtype=np.object_).reshape(len(images)), "BYTES")


def _encode(raw: grpcclient.InferenceServerClient, image: bytes) -> tuple[np.ndarray, np.ndarray]:
    result = raw.infer("encode", [_images([image])])
    return result.as_numpy("image_embeds"), result.as_numpy("image_grid_thw")


def _stream(raw: grpcclient.InferenceServerClient, model: str, inputs: Sequence[Any]) -> GenerateResult:
    """One streaming request with arbitrary inputs; raises ClientError with the server's message."""
    responses: queue.Queue = queue.Queue()
    result = GenerateResult()
    raw.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        raw.async_stream_infer(
            model, list(inputs), outputs=[grpcclient.InferRequestedOutput(n) for n in OUTPUTS],
            enable_empty_final_response=True,
        )
        while True:
            response, error = responses.get(timeout=300)
            if error is not None:
                raise ClientError(error.message(), error.status())
            outputs = {n: response.as_numpy(n) for n in OUTPUTS if response.as_numpy(n) is not None}
            if outputs:
                result.add(outputs)
            final = response.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return result
    finally:
        raw.stop_stream()


def _llm_inputs(prompt: str, embeds: np.ndarray | None, grid: np.ndarray | None, image: bytes | None = None) -> list:
    inputs = [
        _tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
        _tensor("stream", np.array([True]), "BOOL"),
        _tensor("sampling_parameters", np.array([json.dumps(GREEDY).encode()], dtype=np.object_), "BYTES"),
    ]
    if embeds is not None:
        inputs.append(_tensor("image_embeds", embeds, "FP32"))
    if grid is not None:
        inputs.append(_tensor("image_grid_thw", grid, "INT64"))
    if image is not None:
        inputs.append(_tensor("image", np.array([image], dtype=np.object_), "BYTES"))
    return inputs


def test_ensemble_streams_the_same_tokens_as_llm_with_the_raw_image(ensemble, llm_tokens):
    for (text, image), expected in zip(CASES, llm_tokens, strict=True):
        pieces: list[str] = []
        result = ensemble.generate(chat_prompt(text, 1), [image], GREEDY, on_text=pieces.append)
        assert result.token_ids == expected, text
        assert 1 < len(result.chunk_times) <= len(expected)  # streamed through the ensemble
        assert result.num_output_tokens == len(expected)
        assert "".join(pieces) == result.text
        assert result.finish_reason in ("length", "stop")


def test_llm_with_encode_embeddings_matches_the_raw_image(raw, llm_tokens):
    for (text, image), expected in zip(CASES, llm_tokens, strict=True):
        embeds, grid = _encode(raw, image)
        t, h, w = grid[0]
        tokens = t * h * w // 4
        assert embeds.shape == (1, tokens, HIDDEN) and embeds.dtype == np.float32
        # By value: what crosses Triton between encode and llm per image is the embeddings
        # themselves (+ 24 bytes of grid), growing with the image, unlike epd's references.
        assert embeds.nbytes == tokens * HIDDEN * 4
        result = _stream(raw, "llm", _llm_inputs(chat_prompt(text, 1), embeds, grid))
        assert result.token_ids == expected, text


def test_llm_takes_several_images_as_embeddings(raw, llm):
    images = [synthetic_image(640, 480, 31), synthetic_image(200, 300, 32)]
    prompt = chat_prompt("Compare these two images.", 2)
    expected = llm.generate(prompt, images, GREEDY).token_ids
    encoded = [_encode(raw, image) for image in images]
    embeds = np.concatenate([e for e, _ in encoded], axis=1)  # [1, tokens_a + tokens_b, hidden]
    grid = np.concatenate([g for _, g in encoded], axis=0)  # [2, 3]
    assert _stream(raw, "llm", _llm_inputs(prompt, embeds, grid)).token_ids == expected


def _bad_embeddings(raw) -> list[tuple[str, list, str]]:
    embeds, grid = _encode(raw, synthetic_image(64, 64, 40))
    prompt = chat_prompt("hello", 1)
    wrong_grid = grid.copy()
    wrong_grid[0, 1] += 2
    nan = embeds.copy()
    nan[0, 0, 0] = np.nan
    image = synthetic_image(64, 64, 41)
    return [
        ("wrong hidden size", _llm_inputs(prompt, np.zeros((1, embeds.shape[1], 64), np.float32), grid),
         "unexpected shape for input 'image_embeds'"),
        ("grid mismatch", _llm_inputs(prompt, embeds, wrong_grid), "needs"),
        ("image and embeddings", _llm_inputs(prompt, embeds, grid, image=image), "not both"),
        ("embeddings without grid", _llm_inputs(prompt, embeds, None), "needs 'image_grid_thw' too"),
        ("grid without embeddings", _llm_inputs(prompt, None, grid), "needs 'image_embeds' too"),
        ("non-finite", _llm_inputs(prompt, nan, grid), "NaN or infinite"),
        ("more placeholders than images", _llm_inputs(chat_prompt("hello", 2), embeds, grid), "placeholders"),
        ("embeddings without grid rows", _llm_inputs(prompt, embeds, np.zeros((0, 3), np.int64)), "has no rows"),
    ]


def test_bad_embeddings_are_coded_errors_and_the_server_keeps_serving(raw, llm):
    for name, inputs, fragment in _bad_embeddings(raw):
        with pytest.raises(ClientError) as info:
            _stream(raw, "llm", inputs)
        assert fragment in str(info.value), name
        assert "Traceback" not in str(info.value)
    assert llm.generate(chat_prompt("still there?", 0), [], EXACT).num_output_tokens == 12


MAX_IMAGES = TARGETS["cpu"].limits["max_images"]
# 0, 1, 2 and max_images images per request; the images of a request differ in size, aspect
# ratio and format (their rows are concatenated, so one request's images need not share a grid).
IMAGE_COUNTS = [
    ("Say something about nothing.", []),
    ("What is in this picture?", [synthetic_image(640, 480, 51)]),
    ("Compare these two images.", [synthetic_image(64, 64, 52), synthetic_image(300, 1000, 53, "PNG")]),
    (
        "Four of them.",
        [
            synthetic_image(1280, 720, 54),
            synthetic_image(28, 28, 55, "PNG"),
            synthetic_image(200, 300, 56),
            synthetic_image(333, 217, 57, "PNG"),
        ],
    ),
]
CORRUPT = b"\xff\xd8\xff" + b"\x13" * 500  # a JPEG header and garbage: refused in preprocess


def test_ensemble_takes_0_to_max_images_images_as_llm_does(raw, llm, ensemble):
    assert [len(images) for _, images in IMAGE_COUNTS] == [0, 1, 2, MAX_IMAGES] and MAX_IMAGES == 4
    for text, images in IMAGE_COUNTS:
        prompt = chat_prompt(text, len(images))
        expected = llm.generate(prompt, images, EXACT).token_ids
        pieces: list[str] = []
        result = ensemble.generate(prompt, images, EXACT, on_text=pieces.append)
        assert result.token_ids == expected, f"{len(images)} images"
        assert len(result.chunk_times) > 1 and len(expected) == 12  # streamed through the ensemble
        assert "".join(pieces) == result.text
    # No image: ``image`` absent (above: the client sends none) or of shape [0], the same answer.
    prompt = chat_prompt(IMAGE_COUNTS[0][0], 0)
    expected = llm.generate(prompt, [], GREEDY).token_ids
    assert _stream(raw, "ensemble", [*_llm_inputs(prompt, None, None), _images([])]).token_ids == expected
    # What the ensemble's encode steps hand llm for no image: embeddings and grid without rows.
    empty = _llm_inputs(prompt, np.zeros((1, 0, HIDDEN), np.float32), np.zeros((0, 3), np.int64))
    assert _stream(raw, "llm", empty).token_ids == expected


def test_ensemble_refuses_bad_images_with_invalid_arg(server, raw, ensemble):
    good = [synthetic_image(64, 64, 61), synthetic_image(96, 48, 62, "PNG")]
    too_many = [synthetic_image(32 + 8 * i, 32, 70 + i) for i in range(MAX_IMAGES + 1)]
    cases = [
        ("corrupt image", [CORRUPT], "image[0] cannot be read"),
        ("corrupt image among good ones", [good[0], CORRUPT, good[1]], "image[1] cannot be read"),
        ("not an image", [good[0], b"hello world"], "image[1] is neither"),
        ("empty image", [b""], "image[0] is empty"),
        # llm's own limit, on the embeddings it receives (preprocess takes up to 64 per request).
        ("more than max_images", too_many, f"above the limit of {MAX_IMAGES} (max_images)"),
        # Placeholders are llm's to check, as for raw images.
        ("more images than placeholders", None, "placeholders"),
    ]
    http = HttpClient(server.http_url, "ensemble")
    try:
        for name, images, fragment in cases:
            if images is None:
                prompt, images = chat_prompt("hello", 1), good
            else:
                prompt = chat_prompt("hello", len(images))
            with pytest.raises(ClientError) as info:  # gRPC streaming: the message
                ensemble.generate(prompt, images, GREEDY)
            assert fragment in str(info.value), (name, str(info.value))
            assert "Traceback" not in str(info.value)
            with pytest.raises(ClientError) as info:  # HTTP generate: the message and its code
                http.generate(prompt, images, GREEDY)
            assert fragment in str(info.value) and info.value.status == "400", (name, info.value.status, info.value)
    finally:
        http.close()
    prompt = chat_prompt("hello", 1)
    with pytest.raises(ClientError) as info:  # the gpu target's wire format: Triton's type check
        image = np.frombuffer(good[0], np.uint8).reshape(1, -1)
        _stream(raw, "ensemble", [*_llm_inputs(prompt, None, None), _tensor("image", image, "UINT8")])
    assert "image" in str(info.value)
    with pytest.raises(ClientError) as info:  # llm's own checks still apply
        ensemble.generate(prompt, [good[0]], {"temprature": 0.1})
    assert "unknown sampling parameter" in str(info.value)
    assert len(ensemble.generate(prompt, [synthetic_image(64, 64, 3)], EXACT).token_ids) == 12

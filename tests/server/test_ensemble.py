"""`ensemble` (preprocess -> vit_encoder -> llm, embeddings by value) and `llm` fed with
embeddings, over the wire (cpu target).

Greedy tokens must be the same whichever way the image reaches the LM: raw image into ``llm``
(vLLM's own processor + vision tower), ``ensemble`` (DALI + ONNX Runtime, streamed through the
ensemble), or ``encode``'s embeddings sent to ``llm`` by the client.
"""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from builders.tritonserver import TritonServer
from client.epd_client import ClientError, GenerateResult, GrpcClient, chat_prompt
from tests.images import synthetic_image

pytestmark = pytest.mark.server

GREEDY = {"max_tokens": 12, "temperature": 0.0}
EXACT = {**GREEDY, "ignore_eos": True}  # exactly 12 tokens, whatever the random model's greedy choices
HIDDEN = 128  # the tiny default model's LM hidden size (== encode's image_embeds width)
OUTPUTS = ("text_output", "output_token_ids", "num_input_tokens", "num_output_tokens", "finish_reason")
# One image each (the ensemble's contract): sizes, aspect ratios and formats vary.
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


def _encode(raw: grpcclient.InferenceServerClient, image: bytes) -> tuple[np.ndarray, np.ndarray]:
    result = raw.infer("encode", [_tensor("image", np.frombuffer(image, np.uint8).reshape(1, -1), "UINT8")])
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
    ]


def test_bad_embeddings_are_coded_errors_and_the_server_keeps_serving(raw, llm):
    for name, inputs, fragment in _bad_embeddings(raw):
        with pytest.raises(ClientError) as info:
            _stream(raw, "llm", inputs)
        assert fragment in str(info.value), name
        assert "Traceback" not in str(info.value)
    assert llm.generate(chat_prompt("still there?", 0), [], EXACT).num_output_tokens == 12


def _http_generate_error(server: TritonServer, model: str, body: dict[str, Any]) -> tuple[int, str]:
    """POST ``body`` to ``model``'s generate endpoint, which must refuse it: (HTTP status, error)."""
    url = f"http://{server.http_url}/v2/models/{model}/generate"
    request = urllib.request.Request(url, data=json.dumps(body).encode())
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    return info.value.code, json.loads(info.value.read().decode())["error"]


# Triton's own check of a request against the model's inputs, before any step of the DAG runs.
MISSING_IMAGE = "but missing required input(s) ['image']"


def test_ensemble_refuses_anything_but_one_good_image(server, raw, ensemble):
    prompt = chat_prompt("hello", 1)
    text = _tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES")
    two = np.frombuffer(synthetic_image(32, 32, 1) * 2, np.uint8)
    with pytest.raises(ClientError) as info:  # two rows: Triton's shape check, INVALID_ARG
        _stream(raw, "ensemble", [text, _tensor("image", two.reshape(2, -1), "UINT8")])
    assert "unexpected shape for input 'image'" in str(info.value)
    with pytest.raises(ClientError) as info:  # no image: a required input of the DAG
        _stream(raw, "ensemble", [text])
    assert MISSING_IMAGE in str(info.value) and "for model 'ensemble'" in str(info.value)
    # Over HTTP the same refusal carries its code: 400 (INVALID_ARG).
    status, message = _http_generate_error(server, "ensemble", {"text_input": prompt})
    assert status == 400 and MISSING_IMAGE in message, message
    with pytest.raises(ClientError) as info:  # the client says it before sending
        ensemble.generate(prompt, [], GREEDY)
    assert "exactly one image" in str(info.value)
    with pytest.raises(ClientError) as info:  # a corrupt image fails in preprocess, reported once
        ensemble.generate(prompt, [b"\xff\xd8\xff" + b"\x13" * 500], GREEDY)
    assert "image[0] cannot be read" in str(info.value)
    with pytest.raises(ClientError) as info:  # llm's own checks still apply
        ensemble.generate(prompt, [synthetic_image(64, 64, 2)], {"temprature": 0.1})
    assert "unknown sampling parameter" in str(info.value)
    assert len(ensemble.generate(prompt, [synthetic_image(64, 64, 3)], EXACT).token_ids) == 12

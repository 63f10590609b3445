"""`llm` over the wire: exact parity with offline vLLM, bad inputs, cancellation."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from builders.tritonserver import REPO_ROOT, TritonServer
from client.epd_client import ClientError, GrpcClient, chat_prompt
from tests.images import flat_png, synthetic_image

pytestmark = pytest.mark.server

GREEDY = {"max_tokens": 12, "temperature": 0.0}
EXACT = {**GREEDY, "ignore_eos": True}  # exactly 12 tokens, whatever the random model's greedy choices
# (prompt, image sizes): 0, 1 and 2 images of several sizes and aspect ratios.
CASES = [
    ("Say something about nothing.", []),
    ("What is in this picture?", [(640, 480)]),
    ("Describe the scene.", [(64, 64)]),
    ("Read the tall image.", [(300, 1000)]),
    ("Is this wide?", [(1920, 1080)]),
    ("Compare these two images.", [(640, 480), (200, 300)]),
]


@pytest.fixture(scope="module")
def parity_cases(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    folder = tmp_path_factory.mktemp("parity")
    cases = []
    for i, (text, sizes) in enumerate(CASES):
        paths = []
        for j, (w, h) in enumerate(sizes):
            path = folder / f"case{i}_{j}.jpg"
            path.write_bytes(synthetic_image(w, h, seed=10 * i + j))
            paths.append(str(path))
        cases.append({"prompt": chat_prompt(text, len(sizes)), "images": paths, "sampling": GREEDY})
    return cases


@pytest.fixture(scope="module")
def offline_tokens(parity_cases: list[dict], tmp_path_factory: pytest.TempPathFactory, server) -> list[list[int]]:
    # After the server fixture: one vLLM start at a time on a 2-core machine.
    folder = tmp_path_factory.mktemp("offline")
    cases_path, out_path = folder / "cases.json", folder / "out.json"
    cases_path.write_text(json.dumps(parity_cases))
    subprocess.run(
        [sys.executable, str(Path(__file__).with_name("offline_vllm.py")), str(cases_path), str(out_path)],
        check=True,
        cwd=REPO_ROOT,
        timeout=900,
    )
    return json.loads(out_path.read_text())


def _images(case: dict) -> list[bytes]:
    return [Path(p).read_bytes() for p in case["images"]]


def test_grpc_streaming_matches_offline_vllm(grpc_client, parity_cases, offline_tokens):
    for case, expected in zip(parity_cases, offline_tokens, strict=True):
        pieces: list[str] = []
        result = grpc_client.generate(case["prompt"], _images(case), GREEDY, on_text=pieces.append)
        assert result.token_ids == expected, case["prompt"]
        # Streamed: several responses. vLLM may put two tokens in one delta when the
        # engine runs ahead of the output loop (a loaded machine), so not always one each.
        assert 1 < len(result.chunk_times) <= len(expected)
        assert result.num_output_tokens == len(expected)
        assert "".join(pieces) == result.text
        assert result.finish_reason in ("length", "stop")


def test_http_matches_offline_vllm(http_client, parity_cases, offline_tokens):
    for case, expected in zip(parity_cases, offline_tokens, strict=True):
        result = http_client.generate(case["prompt"], _images(case), GREEDY)
        assert result.token_ids == expected, case["prompt"]


def test_http_can_prepend_the_prompt(http_client, parity_cases):
    case = parity_cases[1]
    full = http_client.generate(case["prompt"], _images(case), GREEDY, exclude_input_in_output=False)
    only = http_client.generate(case["prompt"], _images(case), GREEDY, exclude_input_in_output=True)
    assert full.text == case["prompt"] + only.text


def _expect_error(call, fragment: str) -> None:
    # A decoupled model's errors reach a gRPC *stream* as a message only: Triton's
    # ModelStreamInferResponse has no status field. HTTP carries the code (400 = INVALID_ARG).
    with pytest.raises(ClientError) as info:
        call()
    assert fragment in str(info.value)


BAD_INPUTS = [
    ("corrupt image", [b"\xff\xd8\xff" + b"\x13" * 500], {}, "image[0] cannot"),
    ("empty image", [b""], {}, "image[0] is empty"),
    ("not an image", [b"hello world"], {}, "neither an encoded image"),
    ("truncated image", [synthetic_image(256, 256, 1)[:700]], {}, "image[0] cannot"),
    ("above pixel limit", [flat_png(5000, 4000)], {}, "max_image_pixels"),
    ("too many images", [synthetic_image(32, 32, 2)] * 5, {}, "max_images"),
    ("unknown sampling parameter", [], {"temprature": 0.1}, "unknown sampling parameter 'temprature'"),
    ("ill-typed sampling parameter", [], {"max_tokens": "ten"}, "'max_tokens' must be a integer"),
    ("out-of-range sampling parameter", [], {"top_p": 3}, "'top_p' must be in (0, 1]"),
]


@pytest.mark.parametrize("name, images, sampling, fragment", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_a_coded_error_and_the_server_keeps_serving(
    grpc_client, http_client, name, images, sampling, fragment
):
    prompt = chat_prompt("hello", len(images))
    _expect_error(lambda: grpc_client.generate(prompt, images, sampling or None), fragment)
    with pytest.raises(ClientError) as info:
        http_client.generate(prompt, images, sampling or None)
    assert fragment in str(info.value) and info.value.status == "400"
    assert grpc_client.generate(chat_prompt("still there?", 0), [], EXACT).num_output_tokens == 12


def test_missing_text_input_is_rejected(server: TritonServer):
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    errors: list = []
    client.start_stream(callback=lambda result, error: errors.append(error))
    stream = grpcclient.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    client.async_stream_infer("llm", [stream])
    client.stop_stream()
    assert errors and errors[0] is not None
    assert "text_input" in errors[0].message()
    # Over HTTP the same request carries the code: 400 (INVALID_ARG).
    body = json.dumps({"stream": False}).encode()
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate", data=body)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 400
    assert "text_input" in info.value.read().decode()


def _unfinished(server: TritonServer) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    match = re.search(r'^epd_llm_unfinished_requests\{model="llm"\} (\S+)$', text, re.M)
    assert match, "llm model must export epd_llm_unfinished_requests"
    return float(match.group(1))


def test_cancel_mid_stream_aborts_the_vllm_request(server: TritonServer, grpc_client: GrpcClient):
    long_run = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0.0}
    partial = grpc_client.generate(chat_prompt("Go on forever.", 0), [], long_run, cancel_after_chunks=3)
    assert 3 <= len(partial.token_ids) < 1500
    # The engine drops the request once it notices the cancellation: a bounded wait.
    deadline = time.monotonic() + 60
    while _unfinished(server) != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _unfinished(server) == 0
    after = grpc_client.generate(chat_prompt("Next one.", 0), [], EXACT)
    assert after.num_output_tokens == 12


def test_every_engine_starts_with_the_targets_engine_environment(server: TritonServer):
    """The cpu target's engine environment reaches every vLLM-serving stub before its engine core
    starts; each says what it applied. (The engine core's own environment cannot be read back:
    vLLM's process title overwrites it.)"""
    log = server.log_path.read_text(errors="replace")
    for model in ("llm", "epd", "prefill", "decode"):
        said = f"{model} python_backends.engines.llm: vLLM engine environment:"
        lines = [line for line in log.splitlines() if said in line]
        assert lines and all("VLLM_ENABLE_V1_MULTIPROCESSING=0" in line.split() for line in lines), (model, lines)

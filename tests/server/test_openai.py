"""The OpenAI-compatible API against a real server, called with the official ``openai`` client.

The app runs as ``python -m client.openai_server`` (its own process, as ``triton-epd-serve
--openai-port`` starts it) in front of the session's tritonserver. Chats with 0, 1 and 3 images,
streamed and not, and with one video (a ``video_url`` part), streamed, to ``llm`` and ``epd``, must
give exactly the greedy tokens of a direct ``llm`` call on the same prompt (the chat template
renders the prompt ``chat_prompt`` builds, with the video's placeholder for a video), with
Triton's token counts as usage; a client that goes away mid-stream leaves nothing running; bad
requests get OpenAI-shaped errors with their status and the server keeps serving.
"""

from __future__ import annotations

import base64
import json
import re
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from bench.generation_features import whitespace_tokens
from builders.processes import ProcessGroup, http_ok, wait_until_ready
from builders.tritonserver import TritonServer, free_port
from client.epd_client import GrpcClient, chat_prompt
from python_backends.request.generate import VIDEO_PLACEHOLDER
from tests.images import flat_png, synthetic_image
from tests.server.conftest import LOG_DIR, open_node_store, openai_api
from tests.videos import ClipSpec, corrupt_clip, make_clip

pytestmark = pytest.mark.server

GREEDY = {"max_tokens": 12, "temperature": 0.0}
IMAGE_SETS = {
    0: [],
    1: [synthetic_image(320, 240, seed=501)],
    3: [synthetic_image(64, 64, seed=502), synthetic_image(200, 300, seed=503), synthetic_image(96, 128, seed=504)],
}


@pytest.fixture(scope="module")
def api_url(server: TritonServer, model_dir: Path) -> Iterator[str]:
    with openai_api(server.grpc_url, model_dir, LOG_DIR / "openai-server.log") as url:
        yield url


@pytest.fixture
def client(api_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{api_url}/v1", api_key="unused", max_retries=0, timeout=300) as api:
        yield api


def user_turn(text: str, images: list[bytes]) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(i).decode()}}
        for i in images
    ]
    content.append({"type": "text", "text": text})
    return [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": content}]


def _metric(server: TritonServer, name: str) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    values = [float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)]
    assert values, f"metric {name} is not exported"
    return sum(values)


@pytest.mark.parametrize("model", ["llm", "epd"])
@pytest.mark.parametrize("count", sorted(IMAGE_SETS))
def test_chat_gives_llms_greedy_tokens_and_tritons_counts(
    server: TritonServer, client, llm: GrpcClient, model: str, count: int
):
    images, text = IMAGE_SETS[count], f"Describe {count} things."
    expected = llm.generate(chat_prompt(text, count), images, GREEDY)
    assert expected.num_output_tokens == len(expected.token_ids) > 0
    if model != "llm":  # the same tokens as llm; the text as the model itself sends it (see below)
        direct = GrpcClient(server.grpc_url, model)
        try:
            same_model = direct.generate(chat_prompt(text, count), images, GREEDY)
        finally:
            direct.close()
        assert same_model.token_ids == expected.token_ids
        expected.text = same_model.text
    extra = {"return_token_ids": True}
    whole = client.chat.completions.create(
        model=model, messages=user_turn(text, images), max_tokens=12, temperature=0, extra_body=extra
    )
    choice = whole.choices[0]
    assert (choice.model_extra or {})["token_ids"] == expected.token_ids
    assert choice.message.content == expected.text and choice.finish_reason == expected.finish_reason
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        expected.num_input_tokens,
        expected.num_output_tokens,
    )
    stream = client.chat.completions.create(
        model=model, messages=user_turn(text, images), max_completion_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra,
    )  # fmt: skip
    assert_stream_is(stream, expected)


def assert_stream_is(stream: Any, expected: Any) -> None:
    """A streamed chat (``return_token_ids``, ``include_usage``) gave ``expected``'s tokens, text and counts."""
    chunks = list(stream)
    token_ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
    assert token_ids == expected.token_ids
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (expected.num_input_tokens, expected.num_output_tokens)


CLIP = make_clip(ClipSpec("vp8", 96, 64, 10, 2.0, seed=601))
OTHER_CLIP = make_clip(ClipSpec("vp8", 96, 64, 10, 2.0, seed=602))


def _video_uri(data: bytes) -> str:
    return "data:video/webm;base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize("model", ["llm", "epd"])
def test_a_chat_with_a_video_gives_llms_greedy_tokens(server: TritonServer, client, llm: GrpcClient, model: str):
    text = "What happens in the clip?"
    prompt = chat_prompt(text, 0).replace("<|im_start|>user\n", f"<|im_start|>user\n{VIDEO_PLACEHOLDER}")
    expected = llm.generate(prompt, [], GREEDY, videos=[CLIP])
    assert expected.num_output_tokens == len(expected.token_ids) > 0
    # The tokens depend on the video: an API that sent another one would be caught.
    assert llm.generate(prompt, [], GREEDY, videos=[OTHER_CLIP]).token_ids != expected.token_ids
    if model != "llm":  # the text as the model itself sends it (test_chat_gives_llms_greedy_tokens...)
        direct = GrpcClient(server.grpc_url, model)
        try:
            same_model = direct.generate(prompt, [], GREEDY, videos=[CLIP])
        finally:
            direct.close()
        assert same_model.token_ids == expected.token_ids
        expected.text = same_model.text
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": _video_uri(CLIP)}},
                                     {"type": "text", "text": text}]},
    ]  # fmt: skip
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert_stream_is(stream, expected)


def test_epd_text_is_llms_text(llm: GrpcClient, epd: GrpcClient):
    # Prefill's token here ends inside a character: decode's detokenizer, primed with its prompt,
    # used to put the prompt's text before the character (tests/unit/test_decode_text.py).
    prompt = chat_prompt("Describe 0 things.", 0)
    assert epd.generate(prompt, [], GREEDY).text == llm.generate(prompt, [], GREEDY).text


def test_models_are_the_triton_chat_models(client):
    assert sorted(model.id for model in client.models.list()) == ["epd", "llm"]


@pytest.mark.parametrize("model", ["llm", "epd"])
def test_a_client_gone_mid_stream_leaves_no_request_running(api_url, server, client, model: str):
    body = {
        "model": model, "messages": user_turn("Go on forever.", [synthetic_image(200, 200, seed=505)]),
        "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True,
    }  # fmt: skip
    with (
        httpx.Client(timeout=120) as http,
        http.stream("POST", f"{api_url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        contents = 0
        for line in response.iter_lines():
            contents += '"content":"' in line and '"content":""' not in line
            if contents >= 3:
                break  # leaving the block closes the connection: the client is gone
    gauges = ["epd_llm_unfinished_requests"] if model == "llm" else ["epd_decode_unfinished_requests"]
    deadline = time.monotonic() + 60
    if model == "epd":
        gauges.append("epd_store_active_leases")
        with open_node_store() as store:  # the store's own count (all processes) is authoritative
            while store.metrics()["active_leases"] != 0 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert store.metrics()["active_leases"] == 0
    for gauge in gauges:
        while _metric(server, gauge) != 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _metric(server, gauge) == 0, gauge
    answer = client.chat.completions.create(model=model, messages=user_turn("Next.", []), max_tokens=4)
    assert answer.usage.completion_tokens >= 1


def _with_image(url: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}


def _with_video(url: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}]}]}


def _png_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


BAD_REQUESTS = [
    ("no messages", {"messages": []}, 400, "messages"),
    ("unknown model", {"model": "gpt-4o"}, 404, "does not exist"),
    ("broken data URI", _with_image("data:image/jpeg;base64,@@@"), 400, "not valid base64"),
    ("not an image", _with_image(_png_uri(b"hello world")), 400, "neither an encoded image"),
    ("image over the pixel limit", _with_image(_png_uri(flat_png(5000, 4000))), 400, "max_image_pixels"),
    ("unknown parameter", {"temprature": 0.5}, 400, "unknown parameter 'temprature'"),
    ("ill-typed parameter", {"max_tokens": "ten"}, 400, "max_tokens"),
    ("out-of-range for the model", {"max_tokens": 10**6}, 400, "max_tokens"),
    ("remote image URL", _with_image("http://127.0.0.1:9/cat.jpg"), 400, "remote image URLs are not fetched"),
    ("corrupt video", _with_video(_video_uri(corrupt_clip(ClipSpec("vp8", 64, 64, 5, 1.0)))), 400, "cannot be opened"),
    ("remote video URL", _with_video("https://127.0.0.1:9/a.webm"), 400, "remote video URLs are not fetched"),
    ("n above max_n", {"n": 17}, 400, "max_n"),
    ("top_logprobs without logprobs", {"top_logprobs": 3}, 400, "top_logprobs"),
    (
        "invalid JSON schema",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
        400,
        "not a valid JSON schema",
    ),
    ("invalid regex", {"structured_outputs": {"regex": "(a"}}, 400, "not a valid regular expression"),
]


@pytest.mark.parametrize("name, fields, status, fragment", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(api_url, client, name, fields, status, fragment,
                                                                      stream):  # fmt: skip
    body = {"model": "epd", "messages": [{"role": "user", "content": "hi"}], "stream": stream, **fields}
    response = httpx.post(f"{api_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and fragment in error["message"], error
    assert "Traceback" not in error["message"]
    # The official client raises its own error class for the status.
    expected = openai.NotFoundError if status == 404 else openai.BadRequestError
    with pytest.raises(expected):
        others = {key: value for key, value in body.items() if key not in ("model", "messages")}
        client.chat.completions.create(model=body["model"], messages=body["messages"], extra_body=others)
    answer = client.chat.completions.create(model="epd", messages=user_turn("Still there?", []), max_tokens=4)
    assert answer.usage.completion_tokens >= 1


def test_503_when_triton_is_not_reachable(model_dir: Path):
    port = free_port()
    app = ProcessGroup(
        "openai-server-no-triton",
        [
            sys.executable,
            "-m",
            "client.openai_server",
            "--triton-grpc-url",
            f"127.0.0.1:{free_port()}",
            "--model-dir",
            str(model_dir),
            "--port",
            str(port),
        ],  # fmt: skip
        log_path=LOG_DIR / "openai-server-no-triton.log",
    ).start()
    try:
        # /health answers 503 (no model ready): the app itself is up once /openapi.json answers.
        wait_until_ready(lambda: http_ok(f"http://127.0.0.1:{port}/openapi.json"), [app], 120, "the OpenAI server")
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
            body = {"model": "llm", "messages": [{"role": "user", "content": "hi"}]}
            response = httpx.request(method, f"http://127.0.0.1:{port}{path}", json=body, timeout=60)
            assert response.status_code == 503, response.text
            assert response.json()["error"]["type"] == "service_unavailable"
    finally:
        app.stop(timeout_s=30)


class Place(BaseModel):
    """What ``chat.completions.parse`` asks for: the package sends its JSON schema as ``response_format``."""

    name: str = Field(max_length=8)
    kind: Literal["city", "lake", "hill"]


@pytest.mark.parametrize("model", ["llm", "epd"])
def test_the_openai_packages_response_format_logprobs_and_n_calls(client, llm, model_dir: Path, model: str):
    images, text = IMAGE_SETS[1], "Where is this?"
    messages = user_turn(text, images)
    # response_format with a schema, parsed by the package (whitespace biased away: a random-weight
    # model otherwise fills JSON with it until max_tokens)
    bias = whitespace_tokens(model_dir)
    closing = whitespace_tokens(model_dir, closing=True)
    parsed = client.chat.completions.parse(
        model=model, messages=messages, max_tokens=64, temperature=0, response_format=Place, logit_bias=bias
    )
    place = parsed.choices[0].message.parsed
    assert isinstance(place, Place) and place.kind in ("city", "lake", "hill")
    # json_object, then logprobs with 5 alternatives and 3 choices, whole and streamed
    whole = client.chat.completions.create(
        model=model, messages=messages, max_tokens=64, temperature=0, response_format={"type": "json_object"},
        logit_bias=closing,
    )  # fmt: skip
    assert isinstance(json.loads(whole.choices[0].message.content, strict=False), dict)
    sampled = {"max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 3, "logprobs": True, "top_logprobs": 5}
    exactly = {"ignore_eos": True}  # 6 tokens each, whatever the random model samples
    answer = client.chat.completions.create(model=model, messages=messages, **sampled, extra_body=exactly)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert answer.usage.completion_tokens == sum(len(c.logprobs.content) for c in answer.choices) == 18
    for choice in answer.choices:
        assert all(len(t.top_logprobs) == 5 and t.logprob <= 0 for t in choice.logprobs.content)
    chunks = list(client.chat.completions.create(model=model, messages=messages, **sampled, extra_body=exactly,
                                                 stream=True))  # fmt: skip
    streamed = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)}  # fmt: skip
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1, 2}
    # llm: choice 0 is the seeded sample of n = 1, and the stream the same three. epd: its adaptive
    # path may differ between two requests, and the split samples its own (docs/generation.md).
    if model == "llm":
        expected = llm.generate(chat_prompt(text, 1), images, {"max_tokens": 6, "temperature": 1.0, "seed": 3,
                                                               "ignore_eos": True})  # fmt: skip
        assert answer.choices[0].message.content == expected.text
        assert streamed == {c.index: c.message.content for c in answer.choices}

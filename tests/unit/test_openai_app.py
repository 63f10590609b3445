"""The OpenAI app against a scripted Triton backend: request translation (prompt, images,
sampling parameters), the answer's shape streamed and not, usage from Triton's counts, errors
with their status, and cancellation of the Triton request when the SSE stream is closed early.
The official ``openai`` client talks to the app in-process (FastAPI's TestClient is an httpx client)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from bench.audio_clips import tone, wav
from builders.default_model import DEFAULT_AUDIO_MODEL_DIR, build_default_model
from client.epd_client import chat_prompt
from client.openai_server.app import _sse, create_app
from client.openai_server.errors import from_triton_message
from client.openai_server.prompt import ChatRenderer, MediaPolicy
from client.openai_server.triton_backend import ChatRequest, Chunk
from python_backends.request.generate import AUDIO_PLACEHOLDER, VIDEO_PLACEHOLDER
from tests.images import synthetic_image
from tests.videos import ClipSpec, make_clip

# What the fake answers for ``prompt_logprobs``: vllm_backend's layout, the first entry null.
PROMPT_LOGPROBS = [None, {"9707": {"logprob": -2.5, "rank": 3, "decoded_token": "hi"}}]


def fake_logprobs(token: int, text: str, top: int) -> dict[str, Any]:
    """One token's entry as Triton answers it (vllm_backend's layout): the sampled token first
    (rank 2, so outside a top-1 answer), then the alternatives of ranks 1..``top``."""
    entry = {str(token): {"logprob": -0.5, "rank": 2, "decoded_token": text}}
    for rank in range(1, top + 1):
        if rank != 2:
            entry[str(900 + rank)] = {"logprob": -0.1 * rank, "rank": rank, "decoded_token": f"alt{rank}"}
    return entry


@dataclass
class FakeBackend:
    """Answers every chat with ``pieces`` (one Triton response each), counts on the last; or fails
    with ``error`` (a Triton stream message) after ``fail_after`` responses. With ``n`` > 1 in
    the sampling parameters, sequence ``i`` answers each piece with ``i`` appended, the last
    sequence first in each step, and counts ``len(pieces) + i`` tokens; with ``logprobs``, each
    response carries its token's entry (:func:`fake_logprobs`)."""

    pieces: Sequence[str] = ("Hel", "lo", "!")
    ready: dict[str, bool] = field(default_factory=lambda: {"epd": True, "llm": True})
    error: str | None = None
    fail_after: int = 0
    finish_reason: str = "length"
    calls: list[ChatRequest] = field(default_factory=list)
    finished: int = 0
    closed_early: int = 0

    serve_any_model: bool = False  # the fuzzer's random model names reach the renderer too

    async def model_state(self, model: str) -> bool | None:
        return True if self.serve_any_model else self.ready.get(model)

    async def ready_models(self) -> list[str]:
        return [model for model, ready in self.ready.items() if ready]

    async def generate(self, request: ChatRequest) -> AsyncIterator[Chunk]:
        self.calls.append(request)
        n, top = int(request.sampling.get("n", 1)), request.sampling.get("logprobs")
        done = False
        try:
            for step, piece in enumerate(self.pieces):
                if self.error is not None and step == self.fail_after:
                    done = True
                    raise from_triton_message(self.error)
                last = step == len(self.pieces) - 1
                for index in reversed(range(n)):
                    token, text = 100 + step + 10 * index, piece + (str(index) if index else "")
                    first = step == 0 and index == n - 1
                    yield Chunk(
                        text=text,
                        token_ids=[token],
                        num_input_tokens=40 if last else None,
                        num_output_tokens=len(self.pieces) + index if last else None,
                        finish_reason=self.finish_reason if last else None,
                        index=index,
                        logprobs=None if top is None else [fake_logprobs(token, text, top)],
                        prompt_logprobs=PROMPT_LOGPROBS if first and "prompt_logprobs" in request.sampling else None,
                    )
                    await asyncio.sleep(0)
            done = True
            self.finished += 1
        finally:
            if not done:
                self.closed_early += 1

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer.from_checkpoint(build_default_model(), MediaPolicy())


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def http(backend: FakeBackend, renderer: ChatRenderer):
    with TestClient(create_app(backend, renderer), raise_server_exceptions=False) as client:
        yield client


@pytest.fixture
def client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


IMAGE = synthetic_image(48, 32, 7)
IMAGE_URI = "data:image/jpeg;base64," + base64.b64encode(IMAGE).decode()
USER_WITH_IMAGE = {
    "role": "user",
    "content": [{"type": "image_url", "image_url": {"url": IMAGE_URI}}, {"type": "text", "text": "What?"}],
}


def test_a_chat_becomes_one_triton_request(client: openai.OpenAI, backend: FakeBackend):
    answer = client.chat.completions.create(
        model="epd",
        messages=[{"role": "system", "content": "You are a helpful assistant."}, USER_WITH_IMAGE],
        max_completion_tokens=7,
        temperature=0,
        top_p=0.5,
        seed=3,
        stop=["\n"],
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    (call,) = backend.calls
    assert (call.model, call.prompt, call.images) == ("epd", chat_prompt("What?", 1), [IMAGE])
    assert call.sampling == {"max_tokens": 7, "temperature": 0.0, "top_p": 0.5, "seed": 3, "stop": ["\n"],
                             "ignore_eos": True}  # fmt: skip
    assert answer.choices[0].message.content == "Hello!" and answer.choices[0].finish_reason == "length"
    assert answer.choices[0].token_ids == [100, 101, 102]  # Triton's output_token_ids, on request
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (40, 3, 43)
    assert answer.model == "epd" and answer.id.startswith("chatcmpl-")


CLIP = make_clip(ClipSpec("vp8", 64, 48, 5, 1.0, seed=8))
CLIP_PART = {"type": "video_url", "video_url": {"url": "data:video/webm;base64," + base64.b64encode(CLIP).decode()}}


def test_a_video_part_reaches_triton_as_a_video(client: openai.OpenAI, backend: FakeBackend):
    user = {"role": "user", "content": [CLIP_PART, *USER_WITH_IMAGE["content"]]}
    client.chat.completions.create(model="epd", messages=[user], max_tokens=3)  # type: ignore[list-item]
    (call,) = backend.calls
    assert call.prompt == chat_prompt("What?", 1).replace("user\n", f"user\n{VIDEO_PLACEHOLDER}")
    assert (call.images, call.videos) == ([IMAGE], [CLIP])


AUDIO = wav(tone(0.5, 440.0, seed=9))
AUDIO_PART = {"type": "input_audio", "input_audio": {"data": base64.b64encode(AUDIO).decode(), "format": "wav"}}


def test_audio_parts_reach_triton_as_audio(backend: FakeBackend):
    renderer = ChatRenderer.from_checkpoint(
        build_default_model(DEFAULT_AUDIO_MODEL_DIR, recipe="qwen2-audio"), MediaPolicy()
    )
    with TestClient(create_app(backend, renderer)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        url_part = {
            "type": "audio_url",
            "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(b"x" + AUDIO).decode()},
        }
        user = {"role": "user", "content": [AUDIO_PART, url_part, {"type": "text", "text": "What?"}]}
        client.chat.completions.create(model="llm", messages=[user], max_tokens=3)  # type: ignore[list-item]
    (call,) = backend.calls
    assert call.prompt == chat_prompt("What?", 0, 2) and call.prompt.count(AUDIO_PLACEHOLDER) == 2
    assert (call.images, call.videos, call.audios) == ([], [], [AUDIO, b"x" + AUDIO])


def test_the_triton_request_carries_the_videos_and_audios_as_their_inputs():
    from client.openai_server.triton_backend import TritonChatBackend

    sent: list[dict[str, Any]] = []

    class FakeStream:
        def __aiter__(self):
            return self

        async def __anext__(self):
            raise StopAsyncIteration

    class FakeClient:
        def stream_infer(self, requests: AsyncIterator[dict[str, Any]]) -> FakeStream:
            async def take() -> None:
                sent.extend([request async for request in requests])

            self.task = asyncio.ensure_future(take())
            return FakeStream()

    async def run() -> None:
        backend = TritonChatBackend("unused:1")
        backend._client = FakeClient()
        request = ChatRequest("llm", "p", [IMAGE], {}, "id", videos=[CLIP, b"second"], audios=[AUDIO])
        assert [chunk async for chunk in backend.generate(request)] == []
        await backend._client.task

    asyncio.run(run())
    (request,) = sent
    inputs = {item.name(): item for item in request["inputs"]}
    assert {"text_input", "image", "video", "audio"} <= set(inputs)
    assert inputs["video"].datatype() == "BYTES" and inputs["video"].shape() == [2]
    assert CLIP in bytes(inputs["video"]._raw_content) and IMAGE not in bytes(inputs["video"]._raw_content)
    assert inputs["audio"].datatype() == "BYTES" and inputs["audio"].shape() == [1]
    assert AUDIO in bytes(inputs["audio"]._raw_content) and CLIP not in bytes(inputs["audio"]._raw_content)


def test_max_tokens_is_taken_too(client: openai.OpenAI, backend: FakeBackend):
    client.chat.completions.create(model="llm", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert backend.calls[0].sampling == {"max_tokens": 5}


def test_streaming_with_usage(client: openai.OpenAI):
    stream = client.chat.completions.create(
        model="llm",
        messages=[USER_WITH_IMAGE],
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    token_ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
    assert token_ids == [100, 101, 102]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello!"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 40
    assert chunks[-1].usage.completion_tokens == 3


def test_streaming_without_usage_sends_none(http: TestClient):
    body = {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    assert all("usage" not in json.loads(event) for event in events[:-1])


def test_models_lists_the_ready_chat_models(client: openai.OpenAI, backend: FakeBackend):
    backend.ready["llm"] = False
    assert [model.id for model in client.models.list()] == ["epd"]


def _error(http: TestClient, body: Any, status: int) -> dict[str, Any]:
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "llm", "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        (chat(messages=[]), "messages", "at least 1 item"),
        ({"model": "llm"}, "messages", "Field required"),
        (chat(temprature=0.1), "temprature", "unknown parameter 'temprature'"),
        (chat(max_tokens="ten"), "max_tokens", "valid integer"),
        (chat(max_tokens=0), "max_tokens", "greater than or equal to 1"),
        (chat(top_p=3), "top_p", "less than or equal to 1"),
        (chat(stream="maybe"), "stream", "valid boolean"),
        (chat(n=0), "n", "greater than or equal to 1"),
        (chat(seed=2**70), "seed", "less than or equal to"),
        (chat(messages=[{"role": "robot", "content": "hi"}]), "messages.0.role", "Input should be"),
        (chat(messages=[{"role": "user", "content": [{"type": "audio", "x": 1}]}]), "messages.0.content", ""),
        (
            chat(
                messages=[
                    USER_WITH_IMAGE
                    | {"content": [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,%%%"}}]}
                ]
            ),
            "messages[0].content[0].image_url",
            "not valid base64",
        ),  # fmt: skip
        (
            chat(
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]
            ),
            "messages[0].content[0].image_url",
            "remote image URLs are not fetched",
        ),  # fmt: skip
        (
            chat(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "x"},
                            {"type": "video_url", "video_url": {"url": "http://x/a.mp4"}},
                        ],
                    }
                ]
            ),
            "messages[0].content[1].video_url",
            "remote video URLs are not fetched",
        ),  # fmt: skip
        (
            chat(
                messages=[
                    {"role": "user", "content": [AUDIO_PART | {"input_audio": {"data": "AAAA", "format": "aac"}}]}
                ]
            ),
            "messages[0].content[0].input_audio.format",
            "not one of wav, mp3, flac, ogg, opus",
        ),
        (
            chat(
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}],
                    }
                ]
            ),
            "messages[0].content[0].input_audio",
            "not valid base64",
        ),
        (
            chat(
                messages=[{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "http://x/a.wav"}}]}]
            ),
            "messages[0].content[0].audio_url",
            "remote audio URLs are not fetched",
        ),
    ],
)
def test_bad_requests_are_400_and_nothing_reaches_triton(http, backend, body, param, fragment):
    error = _error(http, body, 400)
    assert (
        error["type"] == "invalid_request_error" and error["param"].startswith(param) and fragment in error["message"]
    )
    assert backend.calls == []
    assert http.post("/v1/chat/completions", json=chat()).status_code == 200  # still serving


def test_a_body_that_is_not_json_is_400(http: TestClient):
    response = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_unknown_model_is_404_and_unready_model_503(http: TestClient, backend: FakeBackend):
    error = _error(http, chat(model="gpt-4"), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model" and "epd, llm" in error["message"]
    backend.ready["llm"] = False
    assert _error(http, chat(), 503)["type"] == "service_unavailable"
    backend.ready["epd"] = False
    assert http.get("/v1/models").status_code == 503 and http.get("/health").status_code == 503


@pytest.mark.parametrize(
    "message, status",
    [
        ("image[0] has 30000000 bytes, above the limit of 20971520 (max_image_bytes)", 400),
        ("sampling parameter 'max_tokens' is 9999, above this model's limit of 512", 400),
        ("internal error: RuntimeError", 500),
        ("Request for unknown model: 'epd' is not found", 404),
        ("Request for unknown model: 'epd' version 1 is not at ready state", 503),
    ],
)
def test_triton_errors_before_the_first_token_keep_their_status(http, backend, message, status):
    backend.error = message
    error = _error(http, chat(), status)
    assert error["message"] == message
    stream = _error(http, chat(stream=True), status)  # streamed too: the HTTP status, not an SSE event
    assert stream["message"] == message


def test_a_triton_error_mid_stream_ends_the_stream_with_an_error_event(http, backend):
    backend.error, backend.fail_after = "internal error: RuntimeError", 2
    with http.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert response.status_code == 200
    assert json.loads(events[-2])["error"]["message"] == "internal error: RuntimeError" and events[-1] == "[DONE]"


def test_closing_the_stream_early_closes_the_triton_request():
    # What Starlette does when the HTTP client disconnects: the response generator is closed.
    backend = FakeBackend(pieces=["a"] * 10)

    async def run() -> None:
        chunks = backend.generate(ChatRequest("llm", "p", [], {}, "id"))
        first = await chunks.__anext__()
        events = _sse(chunks, first, "id", "llm", include_usage=True)
        assert "assistant" in await events.__anext__()
        await events.__anext__()
        await events.aclose()

    asyncio.run(run())
    assert (backend.closed_early, backend.finished) == (1, 0)


def test_the_openapi_schema_documents_the_errors(http: TestClient):
    schema = http.get("/openapi.json").json()
    responses = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "404", "503"} <= set(responses)


def test_file_urls_under_the_media_folder(tmp_path: Path, backend: FakeBackend):
    (tmp_path / "a.jpg").write_bytes(IMAGE)
    renderer = ChatRenderer.from_checkpoint(build_default_model(), MediaPolicy(file_root=tmp_path))
    with TestClient(create_app(backend, renderer)) as http:
        part = {"type": "image_url", "image_url": {"url": (tmp_path / "a.jpg").as_uri()}}
        body = chat(messages=[{"role": "user", "content": [part]}])
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert backend.calls[0].images == [IMAGE]


def test_an_unreachable_triton_is_503(renderer: ChatRenderer):
    from builders.tritonserver import free_port
    from client.openai_server.triton_backend import TritonChatBackend

    backend = TritonChatBackend(f"127.0.0.1:{free_port()}")  # nothing listens there
    with TestClient(create_app(backend, renderer)) as http:
        for response in (http.get("/v1/models"), http.post("/v1/chat/completions", json=chat())):
            assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
        assert http.post("/v1/chat/completions", json=chat(model="nope")).status_code == 404

"""Structured outputs, log probabilities and ``n`` on the OpenAI app (issue 49), against the
scripted Triton backend of ``test_openai_app``: how each request field becomes a Triton sampling
parameter, the checks across fields (400s naming the field, as ``vllm serve`` makes them), the
``n`` choices streamed and not, OpenAI's logprobs shape from vllm_backend's layout, and the
official ``openai`` client parsing all of it."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import openai
import pydantic
import pytest
from fastapi.testclient import TestClient

from client.openai_server.app import _openai_logprobs
from client.openai_server.schemas import ChatCompletionRequest
from client.openai_server.triton_backend import chunk_of
from tests.unit import test_openai_app
from tests.unit.test_openai_app import PROMPT_LOGPROBS, FakeBackend, chat

# The app tests' fixtures: the app on a fake backend, its HTTP test client, the openai client on it.
renderer, backend, http, client = (test_openai_app.renderer, test_openai_app.backend, test_openai_app.http,
                                   test_openai_app.client)  # fmt: skip
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _events(http: TestClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


@pytest.mark.parametrize(
    "fields, sampling",
    [
        ({"response_format": {"type": "text"}}, {}),
        ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": SCHEMA, "strict": True},
                }
            },
            {"structured_outputs": {"json": SCHEMA}},
        ),
        ({"structured_outputs": {"json": SCHEMA}}, {"structured_outputs": {"json": SCHEMA}}),
        (
            {"structured_outputs": {"json": '{"type": "integer"}'}},
            {"structured_outputs": {"json": '{"type": "integer"}'}},
        ),
        (
            {"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": True}},
            {"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": True}},
        ),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, {"structured_outputs": {"choice": ["yes", "no"]}}),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, {"structured_outputs": {"grammar": 'root ::= "a"'}}),
        (
            {
                "structured_outputs": {
                    "json_object": True,
                    "disable_additional_properties": True,
                    "whitespace_pattern": " ?",
                }
            },
            {
                "structured_outputs": {
                    "json_object": True,
                    "disable_additional_properties": True,
                    "whitespace_pattern": " ?",
                }
            },
        ),
        (
            {"response_format": {"type": "text"}, "structured_outputs": {"regex": "a"}},
            {"structured_outputs": {"regex": "a"}},
        ),
        ({"logprobs": True}, {"logprobs": 0}),
        ({"logprobs": True, "top_logprobs": 5}, {"logprobs": 5}),
        ({"logprobs": True, "top_logprobs": None}, {"logprobs": 0}),
        ({"logprobs": False, "top_logprobs": 0}, {}),
        ({"logprobs": None}, {}),
        ({"n": 3}, {"n": 3}),
        ({"n": 1}, {}),
        ({"prompt_logprobs": 2}, {"prompt_logprobs": 2}),
        ({"prompt_logprobs": 0}, {"prompt_logprobs": 0}),
        ({"logit_bias": {"50256": -200, "7": 3.5, "08": 101}}, {"logit_bias": {"50256": -100.0, "7": 3.5, "8": 100.0}}),
        ({"allowed_token_ids": [1, 2]}, {"allowed_token_ids": [1, 2]}),
        ({"bad_words": ["darn"]}, {"bad_words": ["darn"]}),
    ],
)
def test_each_new_field_becomes_its_sampling_parameter(http, backend, fields, sampling):
    request = ChatCompletionRequest.model_validate(chat(**fields))
    request.check()
    assert request.sampling_parameters() == sampling
    assert http.post("/v1/chat/completions", json=chat(**fields)).status_code == 200
    assert backend.calls[0].sampling == sampling


@pytest.mark.parametrize(
    "fields, param, fragment",
    [
        ({"top_logprobs": 3}, "top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true."),
        ({"top_logprobs": 3, "logprobs": False}, "top_logprobs", "`logprobs` must be set to true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "greater than or equal to 0"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "greater than or equal to 0"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available when `stream=True`"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"n": 129}, "n", "less than or equal to 128"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "'json_schema' field must be provided"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "c"}}},
            "response_format.json_schema.schema",
            "'json_schema.schema' must be provided",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", "Input should be"),
        ({"response_format": {"type": "json_object", "strict": True}}, "response_format.strict", "unknown parameter"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "one of 'response_format' and 'structured_outputs'",
        ),
        (
            {
                "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
                "structured_outputs": {"json": SCHEMA},
            },
            "structured_outputs",
            "not both",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "multiple are specified"),
        ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs", "none are specified"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "unknown parameter"),
        ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice", "valid list"),
        ({"logit_bias": {"hello": 1.0}}, "logit_bias", "cannot be converted to integer token IDs: ['hello']"),
        ({"logit_bias": {"7": "much"}}, "logit_bias.7", "valid number"),
        ({"allowed_token_ids": ["a"]}, "allowed_token_ids.0", "valid integer"),
        ({"bad_words": "darn"}, "bad_words", "valid list"),
    ],
)
def test_bad_combinations_are_400s_naming_the_field(http, backend, fields, param, fragment):
    response = http.post("/v1/chat/completions", json=chat(**fields))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and fragment in error["message"]
    assert backend.calls == []


def test_n_choices_in_index_order_with_their_own_counts(http, backend):
    body = http.post("/v1/chat/completions", json=chat(n=3, return_token_ids=True)).json()
    assert backend.calls[0].sampling == {"n": 3}
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["message"]["content"] for c in choices] == ["Hello!", "Hel1lo1!1", "Hel2lo2!2"]
    assert [c["token_ids"] for c in choices] == [[100, 101, 102], [110, 111, 112], [120, 121, 122]]
    assert [c["finish_reason"] for c in choices] == ["length"] * 3
    assert all(c["logprobs"] is None for c in choices) and body["prompt_logprobs"] is None
    assert body["usage"] == {"prompt_tokens": 40, "completion_tokens": 3 + 4 + 5, "total_tokens": 52}


def test_n_choices_streamed(http):
    events = _events(http, chat(n=3, stream=True, stream_options={"include_usage": True}))
    choices = [event["choices"][0] for event in events if event["choices"]]
    assert [c["delta"] for c in choices[:3]] == [{"role": "assistant", "content": ""}] * 3  # a role delta each, first
    assert [c["index"] for c in choices[:3]] == [0, 1, 2]
    texts = {i: "".join(c["delta"].get("content", "") for c in choices[3:] if c["index"] == i) for i in range(3)}
    assert texts == {0: "Hello!", 1: "Hel1lo1!1", 2: "Hel2lo2!2"}
    finishes = [(position, c["index"]) for position, c in enumerate(choices) if c["finish_reason"]]
    assert [index for _, index in finishes] == [2, 1, 0]  # each as its sequence ends (the fake's last is first)
    last_content_of_0 = max(p for p, c in enumerate(choices) if c["index"] == 0 and c["delta"].get("content"))
    assert finishes[0][0] < last_content_of_0
    assert all(c["delta"] == {} for c in choices if c["finish_reason"])
    assert all("logprobs" not in c for c in choices)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12


TOP_TOKENS = {0: [], 1: ["alt1"], 5: ["alt1", "<sampled>", "alt3", "alt4", "alt5"]}


def _expected_top(top: int, sampled: str) -> list[str]:
    return [sampled if token == "<sampled>" else token for token in TOP_TOKENS[top]]


@pytest.mark.parametrize("top", [0, 1, 5])
def test_logprobs_in_openai_shape(http, backend, top):
    body = http.post("/v1/chat/completions", json=chat(logprobs=True, top_logprobs=top)).json()
    assert backend.calls[0].sampling == {"logprobs": top}
    content = body["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == ["Hel", "lo", "!"]
    assert content[0]["logprob"] == -0.5 and content[0]["bytes"] == list(b"Hel")
    for entry in content:
        assert [alt["token"] for alt in entry["top_logprobs"]] == _expected_top(top, entry["token"])
        assert all(set(alt) == {"token", "logprob", "bytes"} for alt in entry["top_logprobs"])
        assert all(alt["bytes"] == list(alt["token"].encode()) for alt in entry["top_logprobs"])
    if top == 5:
        assert [alt["logprob"] for alt in content[0]["top_logprobs"]] == pytest.approx([-0.1, -0.5, -0.3, -0.4, -0.5])


@pytest.mark.parametrize("top", [0, 1, 5])
def test_logprobs_streamed_with_each_delta(http, top):
    events = _events(http, chat(n=2, logprobs=True, top_logprobs=top, stream=True))
    deltas = [event["choices"][0] for event in events if event["choices"][0]["delta"].get("content")]
    assert len(deltas) == 6
    for delta in deltas:
        (entry,) = delta["logprobs"]["content"]
        assert entry["token"] == delta["delta"]["content"]
        assert [alt["token"] for alt in entry["top_logprobs"]] == _expected_top(top, entry["token"])


def test_prompt_logprobs_are_vllms_top_level_field(http, backend):
    body = http.post("/v1/chat/completions", json=chat(prompt_logprobs=1, n=2)).json()
    assert backend.calls[0].sampling == {"prompt_logprobs": 1, "n": 2}
    assert body["prompt_logprobs"] == PROMPT_LOGPROBS
    assert all(choice["logprobs"] is None for choice in body["choices"])


def test_openai_logprobs_from_vllm_backends_layout():
    entries = json.loads(
        '[{"5": {"logprob": -Infinity, "rank": 7, "decoded_token": "\\u00e9"},'
        ' "6": {"logprob": -0.1, "rank": 1, "decoded_token": null}}, {"8": {"logprob": -1.0, "rank": 1}}]'
    )
    first, second = _openai_logprobs(entries, [5, 8], 1)
    assert first == {
        "token": "é",
        "logprob": -9999.0,  # vLLM's floor: -inf is not JSON
        "bytes": [0xC3, 0xA9],
        "top_logprobs": [{"token": "token_id:6", "logprob": -0.1, "bytes": None}],  # vLLM's name, no text
    }
    assert second["token"] == "token_id:8" and second["top_logprobs"][0]["logprob"] == -1.0
    # Without the token ids, the sampled token is the entry's first (vllm_backend puts it first).
    assert [entry["token"] for entry in _openai_logprobs(entries, [], 0)] == ["é", "token_id:8"]
    assert _openai_logprobs(None, [5], 3) == []


class _Output:
    def __init__(self, name: str) -> None:
        self.name = name


class _Final:
    bool_param = True


class _Response:
    def __init__(self, names: list[str], final: bool) -> None:
        self.outputs = [_Output(name) for name in names]
        self.parameters = {"triton_final_response": _Final()} if final else {}


class _Result:
    """What tritonclient's InferResult answers for one streamed response."""

    def __init__(self, outputs: dict[str, np.ndarray], final: bool = False) -> None:
        self.outputs = outputs
        self.final = final

    def get_response(self) -> _Response:
        return _Response(list(self.outputs), self.final)

    def as_numpy(self, name: str) -> np.ndarray | None:
        return self.outputs.get(name)


def _bytes(text: str) -> np.ndarray:
    return np.array([text.encode()], dtype=np.object_)


def test_chunk_of_reads_the_index_and_the_logprobs():
    logprobs = [{"11": {"logprob": -0.2, "rank": 1, "decoded_token": "é"}}]
    result = _Result(
        {
            "text_output": _bytes("é"),
            "output_token_ids": np.array([11], dtype=np.int32),
            "num_output_tokens": np.array([4], dtype=np.uint32),
            "finish_reason": _bytes("stop"),
            "output_index": np.array([2], dtype=np.uint32),
            "logprobs": _bytes(json.dumps(logprobs)),
            "prompt_logprobs": _bytes(json.dumps(PROMPT_LOGPROBS)),
        },
        final=True,
    )
    chunk, final = chunk_of(result)
    assert final and (chunk.text, chunk.token_ids, chunk.index, chunk.finish_reason) == ("é", [11], 2, "stop")
    assert chunk.logprobs == logprobs and chunk.prompt_logprobs == PROMPT_LOGPROBS
    plain, final = chunk_of(_Result({"text_output": _bytes("a"), "finish_reason": _bytes("")}))
    assert not final and (plain.index, plain.finish_reason) == (0, None)
    assert (plain.logprobs, plain.prompt_logprobs) == (None, None)


def test_the_openai_client_parses_n_choices_with_logprobs(client: openai.OpenAI, backend: FakeBackend):
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    answer = client.chat.completions.create(
        model="llm",
        messages=[{"role": "user", "content": "Where?"}],
        response_format=response_format,
        logprobs=True,
        top_logprobs=5,
        n=3,
        logit_bias={"7": 5},
        extra_body={"prompt_logprobs": 1, "bad_words": ["no"]},
    )
    assert backend.calls[0].sampling == {
        "n": 3,
        "logprobs": 5,
        "prompt_logprobs": 1,
        "bad_words": ["no"],
        "logit_bias": {"7": 5.0},
        "structured_outputs": {"json": SCHEMA},
    }
    assert [choice.index for choice in answer.choices] == [0, 1, 2]
    assert answer.choices[2].message.content == "Hel2lo2!2"
    content = answer.choices[1].logprobs.content  # type: ignore[union-attr]
    assert [entry.token for entry in content] == ["Hel1", "lo1", "!1"]  # type: ignore[union-attr]
    assert [alt.token for alt in content[0].top_logprobs] == ["alt1", "Hel1", "alt3", "alt4", "alt5"]  # type: ignore[index]
    assert content[0].top_logprobs[1].bytes == list(b"Hel1")  # type: ignore[index]
    assert answer.usage.completion_tokens == 12  # type: ignore[union-attr]
    assert (answer.model_extra or {})["prompt_logprobs"] == PROMPT_LOGPROBS

    stream = client.chat.completions.create(
        model="llm",
        messages=[{"role": "user", "content": "Where?"}],
        response_format={"type": "json_object"},
        logprobs=True,
        top_logprobs=1,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert backend.calls[1].sampling == {"n": 3, "logprobs": 1, "structured_outputs": {"json_object": True}}
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(3)]  # fmt: skip
    assert texts == ["Hello!", "Hel1lo1!1", "Hel2lo2!2"]
    with_logprobs = [c.choices[0] for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(with_logprobs) == 9
    assert all([alt.token for alt in choice.logprobs.content[0].top_logprobs] == ["alt1"] for choice in with_logprobs)  # type: ignore[union-attr,index]
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1, 2]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


class City(pydantic.BaseModel):
    city: str


def test_the_openai_clients_parse_sends_the_models_schema(client: openai.OpenAI, backend: FakeBackend):
    backend.pieces, backend.finish_reason = ('{"city": ', '"Paris"', "}"), "stop"
    answer = client.chat.completions.parse(model="llm", messages=[{"role": "user", "content": "Where?"}],
                                           response_format=City)  # fmt: skip
    assert answer.choices[0].message.parsed == City(city="Paris")
    constraint = backend.calls[0].sampling["structured_outputs"]
    assert list(constraint) == ["json"] and constraint["json"]["properties"]["city"]["type"] == "string"
    assert constraint["json"]["additionalProperties"] is False  # the client's strict schema, as it sent it

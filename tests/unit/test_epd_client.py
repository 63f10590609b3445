"""The direct Triton client's media inputs (client/epd_client.py, client/cli.py): ``video`` and
``audio`` go as BYTES inputs over gRPC and as base64 strings over HTTP's generate endpoint, and
``triton-epd-client --audio`` sends each file with the audio lines in its chat prompt."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from bench.audio_clips import tone, wav
from client import cli
from client.epd_client import GenerateResult, HttpClient, build_inputs, chat_prompt
from python_backends import contract
from python_backends.request.generate import AUDIO_PLACEHOLDER

AUDIOS = [wav(tone(0.5, 440.0, seed=1)), wav(tone(0.25, 220.0, seed=2))]


def test_build_inputs_sends_the_audio_input_only_when_given():
    import tritonclient.grpc as grpcclient

    inputs = {i.name(): i for i in build_inputs(grpcclient, "hi", [], True, None, None, audios=AUDIOS)}
    assert inputs[contract.AUDIO].datatype() == "BYTES" and inputs[contract.AUDIO].shape() == [2]
    assert all(audio in bytes(inputs[contract.AUDIO]._raw_content) for audio in AUDIOS)
    assert contract.IMAGE not in inputs and contract.VIDEO not in inputs
    plain = {i.name() for i in build_inputs(grpcclient, "hi", [b"img"], True, None, None, videos=[b"v"])}
    assert contract.AUDIO not in plain and {contract.IMAGE, contract.VIDEO} <= plain


def test_http_sends_audio_as_base64_strings(monkeypatch: pytest.MonkeyPatch):
    sent: dict[str, Any] = {}

    class Response:
        status_code = 200

        def json(self) -> dict[str, Any]:
            return {"text_output": "ok", "num_input_tokens": 3, "num_output_tokens": 1, "finish_reason": "stop"}

    def post(url: str, json: dict[str, Any], **_: Any) -> Response:
        sent.update(url=url, body=json)
        return Response()

    client = HttpClient("host:1", "llm")
    monkeypatch.setattr(client._session, "post", post)
    result = client.generate("p", audios=AUDIOS, videos=[b"v"])
    assert result.text == "ok" and sent["url"] == "http://host:1/v2/models/llm/generate"
    assert [base64.b64decode(item) for item in sent["body"][contract.AUDIO]] == AUDIOS
    assert sent["body"][contract.VIDEO] == [base64.b64encode(b"v").decode()] and contract.IMAGE not in sent["body"]
    client.generate("p")
    assert contract.AUDIO not in sent["body"]


def test_chat_prompt_writes_the_audio_lines_of_qwen2_audio():
    prompt = chat_prompt("What?", 0, 2)
    assert f"user\nAudio 1: {AUDIO_PLACEHOLDER}\nAudio 2: {AUDIO_PLACEHOLDER}\nWhat?<|im_end|>" in prompt
    assert chat_prompt("x", 1) == chat_prompt("x", 1, 0) and AUDIO_PLACEHOLDER not in chat_prompt("x", 1)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_cli_sends_each_audio_file(protocol: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    calls: list[dict[str, Any]] = []

    class FakeClient:
        def __init__(self, url: str, model: str) -> None:
            pass

        def check_ready(self) -> None:
            pass

        def generate(self, prompt: str, images: Any, sampling: Any, **kwargs: Any) -> GenerateResult:
            calls.append({"prompt": prompt, "images": images, **kwargs})
            return GenerateResult(text="ok")

    monkeypatch.setattr(cli, "GrpcClient", FakeClient)
    monkeypatch.setattr(cli, "HttpClient", FakeClient)
    paths = [tmp_path / "a.wav", tmp_path / "b.flac"]
    for path, audio in zip(paths, AUDIOS, strict=True):
        path.write_bytes(audio)
    assert cli.main(["What?", "--protocol", protocol, "--audio", str(paths[0]), "--audio", str(paths[1])]) == 0
    (call,) = calls
    assert call["audios"] == AUDIOS and call["images"] == []
    assert call["prompt"] == chat_prompt("What?", 0, 2)
    assert cli.main(["x", "--audio", str(tmp_path / "missing.wav")]) == 2
    assert "missing.wav" in capsys.readouterr().err

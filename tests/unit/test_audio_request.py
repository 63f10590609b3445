"""The ``audio`` input of ``llm`` (issue 34), Triton-free: how a request's clips are counted and
placed in the prompt, how raw or base64 bytes are read, and where the limits come from."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from bench.audio_clips import CLIP, pcm16, wav
from python_backends import contract
from python_backends.errors import EpdError
from python_backends.request.audios import AudioInput, AudioLimits, audio_bytes
from python_backends.request.generate import AUDIO_PLACEHOLDER, RequestLimits, parse_generate_request
from python_backends.request.images import ImageLimits
from python_backends.runtime.model_params import ModelParameters

AUDIO_LIMITS = RequestLimits(images=ImageLimits(max_images=0), max_audios=2)  # an audio checkpoint's llm


def request(text: str, clips: list[bytes], limits: RequestLimits = AUDIO_LIMITS):
    inputs = {contract.TEXT_INPUT: np.array([text.encode()], dtype=object)}
    if clips:
        inputs[contract.AUDIO] = np.array(clips, dtype=object)
    return parse_generate_request(inputs, limits)


def test_placeholders_are_prepended_or_kept_as_the_client_wrote_them() -> None:
    assert request("What is it?", [b"a", b"b"]).prompt == AUDIO_PLACEHOLDER * 2 + "What is it?"
    written = f"Audio 1: {AUDIO_PLACEHOLDER}\nWhat is it?"
    parsed = request(written, [b"a"])
    assert parsed.prompt == written and parsed.audios == [b"a"]
    with pytest.raises(EpdError, match=r"1 <\|AUDIO\|> placeholders but the request has 2 audios"):
        request(written, [b"a", b"b"])


def test_audio_is_counted_against_max_audios() -> None:
    with pytest.raises(EpdError, match="request has 3 audios, above the limit of 2"):
        request("x", [b"a"] * 3)
    with pytest.raises(EpdError, match="this model takes no audio"):
        request("x", [b"a"], RequestLimits())
    assert request("", [b"a"]).audios == [b"a"]  # a clip alone is a request
    with pytest.raises(EpdError, match="text_input is empty and no audio was given"):
        request("", [])


def test_raw_and_base64_clips_decode_to_the_same_samples() -> None:
    data = wav(CLIP)
    assert audio_bytes(data) == data and audio_bytes(base64.b64encode(data)) == data
    audio = AudioInput(2, AudioLimits(), 16_000)
    raw, encoded = audio.decode([data, base64.b64encode(data)])
    np.testing.assert_array_equal(raw, pcm16(CLIP))
    np.testing.assert_array_equal(encoded, raw)


def test_epd_keys_the_file_bytes_and_refuses_empty_or_oversized_clips_first() -> None:
    data = wav(CLIP)
    audio = AudioInput(2, AudioLimits(max_bytes=len(data)), 16_000)
    assert audio.raw([data, base64.b64encode(data)]) == [data, data]
    with pytest.raises(EpdError, match=r"audio\[1\]: empty"):
        audio.raw([data, b""])
    with pytest.raises(EpdError, match=rf"audio\[0\]: {len(data) + 1} bytes, above the limit of {len(data)}"):
        audio.raw([data + b"x"])


def test_limits_come_from_the_config_and_default_to_the_contracts() -> None:
    assert AudioInput.from_params(ModelParameters("llm", {})) is None  # max_audios 0: image checkpoints
    params = ModelParameters("llm", {contract.MAX_AUDIOS: "3", contract.MAX_AUDIO_SECONDS: "12.5",
                                     contract.AUDIO_SAMPLING_RATE: "24000"})  # fmt: skip
    assert AudioInput.from_params(params) == AudioInput(3, AudioLimits(max_seconds=12.5), 24_000)
    defaults = contract.audio_limit_defaults()
    assert AudioLimits() == AudioLimits(defaults[contract.MAX_AUDIO_SECONDS], defaults[contract.MAX_AUDIO_BYTES])

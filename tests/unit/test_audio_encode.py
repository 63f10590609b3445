"""An audio checkpoint's encoder side (issue 34), Triton-free: the ``audio`` input of an
``encoder_<i>``, and one clip through FFmpeg, the DALI features and the audio encoder (faked here:
the real one runs in tests/server/test_llm_audio.py) into what the store keeps."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

from bench.audio_clips import CLIP, wav
from python_backends import contract
from python_backends.encode.audios import AudioEncode
from python_backends.encode.cached import parse_encoder_audios
from python_backends.errors import EpdError, ErrorCode
from python_backends.preprocess.audio import DaliAudioFeatures
from python_backends.preprocess.audio_pipeline import AudioFeatureConfig
from python_backends.request.audios import AudioInput, AudioLimits

AUDIO = AudioInput(2, AudioLimits(), 16_000)
FEATURES = DaliAudioFeatures.of_config(AudioFeatureConfig(), max_batch_size=1, num_threads=1)


def audio_inputs(*clips: bytes) -> dict[str, np.ndarray]:
    return {contract.AUDIO: np.array(clips, dtype=np.object_)}


def test_an_encoder_takes_raw_or_base64_clips_up_to_max_audios() -> None:
    data = wav(CLIP)
    assert parse_encoder_audios(audio_inputs(data, base64.b64encode(data)), 2) == [data, data]
    with pytest.raises(EpdError, match="request has 3 audios, above the limit of 2"):
        parse_encoder_audios(audio_inputs(data, data, data), 2)
    with pytest.raises(EpdError, match="input 'audio' needs at least one encoded audio file"):
        parse_encoder_audios({}, 2)


def encoder_of(padded_tokens: int, seen: list[tuple[np.ndarray, np.ndarray]]) -> AudioEncode:
    async def embed(features: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        seen.append((features, lengths))
        tokens = (((lengths - 1) // 2 + 1) - 2) // 2 + 1  # the audio encoder's count (builders/audio_encoder.py)
        rows = np.arange(padded_tokens * 8, dtype=np.float32).reshape(1, padded_tokens, 8)
        return rows, tokens

    return AudioEncode(AUDIO, FEATURES, embed)


def test_a_clip_becomes_its_tokens_rows_of_the_encoders_output() -> None:
    seen: list[tuple[np.ndarray, np.ndarray]] = []
    encoded = asyncio.run(encoder_of(750, seen)(wav(CLIP)))
    (features, lengths), = seen
    assert features.shape == (1, 128, 3000) and lengths.tolist() == [300]  # 3 s: 300 of Whisper's 3000 frames
    assert encoded.grid_thw is None and encoded.embeds.shape == (75, 8)  # 25 tokens a second
    np.testing.assert_array_equal(encoded.embeds, np.arange(750 * 8, dtype=np.float32).reshape(750, 8)[:75])


def test_bad_audio_is_refused_before_the_encoder_and_a_short_answer_is_internal() -> None:
    seen: list[tuple[np.ndarray, np.ndarray]] = []
    with pytest.raises(EpdError) as caught:
        asyncio.run(encoder_of(750, seen)(b"not audio at all"))
    assert caught.value.code is ErrorCode.INVALID_ARG and caught.value.message.startswith("audio[0]: ")
    assert not seen
    with pytest.raises(EpdError) as caught:
        asyncio.run(encoder_of(10, seen)(wav(CLIP)))  # fewer rows than the clip's 75 tokens
    assert caught.value.code is ErrorCode.INTERNAL


def test_a_tensor_from_the_gpu_plan_is_stored_as_a_tensor() -> None:
    """On gpu the TensorRT plan's outputs come back as torch CUDA tensors (BLS, DLPack): the clip's
    rows stay a tensor, contiguous, for the GPU store's one device copy (a CPU tensor stands in)."""
    import torch

    async def embed(features: np.ndarray, lengths: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(750 * 8, dtype=torch.float32).reshape(1, 8, 750).transpose(1, 2)  # not contiguous
        return rows, torch.tensor([75])

    encoded = asyncio.run(AudioEncode(AUDIO, FEATURES, embed)(wav(CLIP)))
    assert isinstance(encoded.embeds, torch.Tensor) and encoded.embeds.is_contiguous()
    expected = torch.arange(750 * 8, dtype=torch.float32).reshape(8, 750).T[:75]
    assert encoded.embeds.shape == (75, 8) and torch.equal(encoded.embeds, expected)

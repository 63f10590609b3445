"""Audio from request bytes to Whisper features (issue 34): FFmpeg decodes, DALI makes features.
Every container gives transformers' features on the same samples within 1e-4, and every kind of
bad audio is one INVALID_ARG naming the problem, found in bounded memory."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from bench.audio_clips import BAD_AUDIO, CLIP, TOO_MANY_BYTES_LIMIT, claims_hours, encoded, pcm16, tone, wav
from python_backends.errors import EpdError, ErrorCode
from python_backends.preprocess.audio import DaliAudioFeatures
from python_backends.preprocess.audio_pipeline import AudioFeatureConfig
from python_backends.request.audios import AudioLimits, decode_audio

RATE = 16_000
LIMITS = AudioLimits()


GOOD = {
    "wav": lambda: wav(CLIP),
    "wav stereo": lambda: wav(CLIP, channels=2),
    "flac": lambda: encoded(CLIP, "flac", "flac"),
    "ogg vorbis": lambda: encoded(CLIP, "ogg", "libvorbis"),
    "ogg opus 48 kHz": lambda: encoded(tone(3.0, 440.0, seed=11, rate=48_000), "ogg", "libopus", 48_000),
    "mp3": lambda: encoded(CLIP, "mp3", "libmp3lame"),
    "wav 44.1 kHz": lambda: wav(tone(3.0, 440.0, seed=11, rate=44_100), rate=44_100),
}


@pytest.mark.parametrize("name", list(BAD_AUDIO))
def test_bad_audio_is_invalid_arg_naming_the_problem(name: str) -> None:
    make, says = BAD_AUDIO[name]
    limits = AudioLimits(max_bytes=TOO_MANY_BYTES_LIMIT) if name == "too many bytes" else LIMITS
    with pytest.raises(EpdError) as caught:
        decode_audio(make(), 2, limits, RATE)
    assert caught.value.code is ErrorCode.INVALID_ARG
    assert caught.value.message.startswith("audio[2]: ") and says in caught.value.message, caught.value.message


def test_a_header_claiming_hours_is_refused_before_decoding() -> None:
    data = claims_hours(wav(CLIP))
    tracemalloc.start()
    try:
        with pytest.raises(EpdError):
            decode_audio(data, 0, LIMITS, RATE)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(data)  # nothing near 37 hours of samples (8.6 GB)


def test_lossless_16_khz_decodes_to_the_files_samples() -> None:
    np.testing.assert_array_equal(decode_audio(wav(CLIP), 0, LIMITS, RATE), pcm16(CLIP))
    np.testing.assert_array_equal(decode_audio(encoded(CLIP, "flac", "flac"), 0, LIMITS, RATE), pcm16(CLIP))
    # equal channels average to the same mono clip (FFmpeg's own downmix would scale it by 1.41)
    np.testing.assert_array_equal(decode_audio(wav(CLIP, channels=2), 0, LIMITS, RATE), pcm16(CLIP))


def test_every_container_gives_whispers_features_on_the_same_samples() -> None:
    from transformers import WhisperFeatureExtractor

    config = AudioFeatureConfig()
    extractor = WhisperFeatureExtractor(feature_size=config.feature_size)
    clips = [decode_audio(make(), i, LIMITS, RATE) for i, make in enumerate(GOOD.values())]
    assert all(abs(c.size - CLIP.size) <= 1200 for c in clips), [c.size for c in clips]  # codec padding at most
    got = DaliAudioFeatures.of_config(config, max_batch_size=4, num_threads=1).features(clips)  # two batches
    for name, samples, features in zip(GOOD, clips, got, strict=True):
        expected = extractor(samples, sampling_rate=RATE, padding="max_length", return_attention_mask=True)
        assert np.abs(features.features - expected["input_features"][0]).max() < 1e-4, name
        assert features.length == int(np.sum(expected["attention_mask"])), name

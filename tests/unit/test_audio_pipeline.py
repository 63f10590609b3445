"""The DALI audio pipeline against transformers' WhisperFeatureExtractor on the same samples
(issue 34): lossless files at the extractor's rate give the same features within 1e-4."""

from __future__ import annotations

import numpy as np
import pytest

from bench.audio_clips import encoded, pcm16, tone, wav
from python_backends.preprocess.audio_pipeline import (
    AudioFeatureConfig,
    feature_length,
    serialize_audio_pipeline,
)
from python_backends.preprocess.processor import PreprocessConfigError
from python_backends.preprocess.runner import DaliCpuRunner

CONFIG = AudioFeatureConfig()


@pytest.fixture(scope="module")
def runner() -> DaliCpuRunner:
    return DaliCpuRunner(serialize_audio_pipeline(CONFIG, max_batch_size=4), max_batch_size=4, num_threads=1)


@pytest.fixture(scope="module")
def extractor():
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=CONFIG.feature_size)


def reference(extractor, samples: np.ndarray) -> tuple[np.ndarray, int]:
    out = extractor(samples, sampling_rate=16_000, padding="max_length", return_attention_mask=True,
                    return_tensors="np")  # fmt: skip
    return out["input_features"][0], int(out["attention_mask"].sum())


CLIPS = {  # name: (file bytes, the samples in it)
    "wav 1 s": (wav(tone(1.0, 440.0)), pcm16(tone(1.0, 440.0))),
    "wav 3.5 s": (wav(tone(3.5, 880.0, seed=1)), pcm16(tone(3.5, 880.0, seed=1))),
    "wav 0.3 s stereo": (wav(tone(0.3, 200.0, seed=2), channels=2), pcm16(tone(0.3, 200.0, seed=2))),
    "flac 12.25 s": (encoded(tone(12.25, 300.0, seed=3), "flac", "flac"), pcm16(tone(12.25, 300.0, seed=3))),
    "wav 30 s": (wav(tone(30.0, 1000.0, seed=4)), pcm16(tone(30.0, 1000.0, seed=4))),
    "wav 41 s (cut to the window)": (wav(tone(41.0, 500.0, seed=5)), pcm16(tone(41.0, 500.0, seed=5))),
}


def test_lossless_clips_give_whispers_features_in_one_batch(runner: DaliCpuRunner, extractor) -> None:
    names = list(CLIPS)[:4]
    features, samples = runner._run_feeds({"audio": [np.frombuffer(CLIPS[n][0], np.uint8) for n in names]})
    for i, name in enumerate(names):
        expected, expected_length = reference(extractor, CLIPS[name][1])
        got = np.array(features[i])
        assert got.shape == (128, 3000), name
        assert np.abs(got - expected).max() < 1e-4, name
        count = int(np.array(samples[i])[0])
        assert count == CLIPS[name][1].size and feature_length(count, CONFIG) == expected_length, name


@pytest.mark.parametrize("name", ["wav 30 s", "wav 41 s (cut to the window)"])
def test_a_full_window_and_a_longer_clip(runner: DaliCpuRunner, extractor, name: str) -> None:
    features, samples = runner._run_feeds({"audio": [np.frombuffer(CLIPS[name][0], np.uint8)]})
    expected, expected_length = reference(extractor, CLIPS[name][1])
    assert np.abs(np.array(features[0]) - expected).max() < 1e-4
    assert feature_length(int(np.array(samples[0])[0]), CONFIG) == expected_length == 3000


def test_the_config_is_read_from_the_checkpoints_preprocessor_config() -> None:
    raw = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 80, "sampling_rate": 16000,
           "hop_length": 160, "n_fft": 400, "n_samples": 480000, "chunk_length": 30}  # fmt: skip
    assert AudioFeatureConfig.from_dict(raw) == AudioFeatureConfig(feature_size=80)
    with pytest.raises(PreprocessConfigError, match="WhisperFeatureExtractor"):
        AudioFeatureConfig.from_dict({**raw, "feature_extractor_type": "SeamlessM4TFeatureExtractor"})
    with pytest.raises(PreprocessConfigError, match="positive"):
        AudioFeatureConfig.from_dict({**raw, "hop_length": 0})

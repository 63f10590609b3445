"""The DALI pipeline that turns encoded audio into Whisper log-mel features (issue 34).

What transformers' ``WhisperFeatureExtractor`` does for Qwen2-Audio, in DALI: decode (WAV, FLAC,
Ogg Vorbis/Opus: DALI's libsndfile decoder), downmix to mono, resample to the extractor's rate,
pad or cut to its window (30 s), a centred, reflect-padded STFT with a periodic Hann window
(power 2), Slaney mel filters, ``log10`` floored at 1e-10, every value raised to at least the
clip's maximum minus 8, then ``(x + 4) / 4``; the STFT's last frame is dropped, as Whisper drops
it. Measured against transformers on the same samples: within 5e-5 (tests/unit/test_audio_pipeline.py).

Input: ``audio`` (uint8 bytes of one encoded file per sample), or, where the file is decoded
outside DALI (``decode=False``), ``samples`` (float32 mono at the extractor's rate). Outputs: ``input_features``
float32 ``[mel bins, frames]`` and ``samples`` int64 ``[1]``, the decoded length at the
extractor's rate before padding (the caller turns it into the feature length the encoder masks
by, :func:`feature_length`, and checks the clip's duration against its limit).

One definition, run on the CPU by :class:`python_backends.preprocess.runner.DaliCpuRunner` from
its serialized bytes (DALI's audio decoder is a CPU operator on every target).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nvidia.dali import fn, types
from nvidia.dali import math as dali_math
from nvidia.dali.data_node import DataNode

from python_backends.preprocess.image_pipeline import DEFAULT_NUM_THREADS, pipeline_of, serialized
from python_backends.preprocess.processor import PreprocessConfigError

AUDIO_INPUT = "audio"
SAMPLES_INPUT = "samples"
FEATURES_OUTPUT = "input_features"
SAMPLES_OUTPUT = "samples"
DEFAULT_AUDIO_BATCH_SIZE = 4
LOG_FLOOR = 1e-10  # Whisper's mel floor
DYNAMIC_RANGE = 8.0  # log10 units kept below the clip's maximum


@dataclass(frozen=True)
class AudioFeatureConfig:
    """The parts of a Whisper ``preprocessor_config.json`` that define the features."""

    feature_size: int = 128
    sampling_rate: int = 16_000
    n_fft: int = 400
    hop_length: int = 160
    n_samples: int = 480_000

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> AudioFeatureConfig:
        kind = raw.get("feature_extractor_type")
        if kind != "WhisperFeatureExtractor":
            raise PreprocessConfigError(f"feature_extractor_type {kind!r}: only WhisperFeatureExtractor is supported")
        fields = {name: raw[name] for name in ("feature_size", "sampling_rate", "n_fft", "hop_length", "n_samples")
                  if name in raw}  # fmt: skip
        config = cls(**{name: int(value) for name, value in fields.items()})
        if min(config.feature_size, config.sampling_rate, config.n_fft, config.hop_length, config.n_samples) <= 0:
            raise PreprocessConfigError(f"feature extractor sizes must be positive: {config}")
        return config

    @property
    def frames(self) -> int:
        """Feature frames of one window (Whisper's 3000)."""
        return self.n_samples // self.hop_length


def feature_length(samples: int, config: AudioFeatureConfig) -> int:
    """The frames a clip of ``samples`` fills, as the extractor's attention mask counts them
    (every ``hop_length``-th sample of the unpadded clip)."""
    return min(math.ceil(samples / config.hop_length), config.frames)


def periodic_hann(length: int) -> list[float]:
    return [0.5 - 0.5 * math.cos(2 * math.pi * i / length) for i in range(length)]


def define_audio_graph(config: AudioFeatureConfig, decode: bool = True) -> Sequence[DataNode]:
    """``decode``: from encoded files (``audio``, DALI's decoder and resampler); else from mono
    float32 samples at the extractor's rate (``samples``, decoded outside: :mod:`python_backends.preprocess.audio`)."""
    if decode:
        encoded = fn.external_source(name=AUDIO_INPUT, dtype=types.UINT8, ndim=1)
        audio, _rate = fn.decoders.audio(encoded, sample_rate=config.sampling_rate, downmix=True, dtype=types.FLOAT)
    else:
        audio = fn.external_source(name=SAMPLES_INPUT, dtype=types.FLOAT, ndim=1)
    samples = fn.cast(audio.shape(), dtype=types.INT64)
    window = fn.slice(fn.pad(audio, axes=(0,), shape=(config.n_samples,), fill_value=0.0), 0, config.n_samples,
                      axes=(0,))  # fmt: skip
    power = fn.spectrogram(
        window, nfft=config.n_fft, window_length=config.n_fft, window_step=config.hop_length,
        window_fn=periodic_hann(config.n_fft), center_windows=True, reflect_padding=True, power=2, layout="ft",
    )  # fmt: skip
    mel = fn.mel_filter_bank(
        power, sample_rate=config.sampling_rate, nfilter=config.feature_size, freq_low=0.0,
        freq_high=config.sampling_rate / 2, normalize=True, mel_formula="slaney",
    )  # fmt: skip
    # to_decibels with multiplier 1 is log10, its cutoff (in those units) Whisper's floor.
    log_mel = fn.to_decibels(mel, multiplier=1.0, reference=1.0, cutoff_db=math.log10(LOG_FLOOR))
    log_mel = log_mel[:, : config.frames]
    log_mel = dali_math.max(log_mel, fn.reductions.max(log_mel) - DYNAMIC_RANGE)
    return (log_mel + 4.0) / 4.0, samples


def serialize_audio_pipeline(
    config: AudioFeatureConfig,
    max_batch_size: int = DEFAULT_AUDIO_BATCH_SIZE,
    num_threads: int = DEFAULT_NUM_THREADS,
    decode: bool = True,
) -> bytes:
    return serialized(pipeline_of(lambda: define_audio_graph(config, decode), max_batch_size, num_threads))

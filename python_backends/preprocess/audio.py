"""Audio from request bytes to Whisper features (issue 34): decode with FFmpeg, features in DALI.

Why FFmpeg (PyAV) decodes and not DALI's decoder (docs/benchmarks/audio-parity.md): DALI 2.4's
libsndfile refuses MP3 and returns 7,296 of 56,064 samples of an Ogg Vorbis file FFmpeg wrote,
while FFmpeg reads every container and codec it bundles. vLLM's own fallback loader (PyAV too)
leaves integer PCM unscaled, so ``llm`` uses :func:`decode_audio` as well: both paths see the
same samples.

:func:`decode_audio` works in bounded memory: the byte limit first, then the duration the
container declares (a header claiming hours is refused before any decoding), then the samples
counted as they are decoded. Channels are averaged (as ``librosa.load(mono=True)`` and vLLM do;
FFmpeg's own downmix keeps power instead). A file whose decoded length falls well short of what
its header declares is truncated and refused.

Plain Python: no Triton import.
"""

from __future__ import annotations

import io
import itertools
import wave
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from python_backends.errors import invalid_arg
from python_backends.preprocess.audio_pipeline import (
    DEFAULT_AUDIO_BATCH_SIZE,
    SAMPLES_INPUT,
    AudioFeatureConfig,
    feature_length,
    serialize_audio_pipeline,
)
from python_backends.preprocess.image_pipeline import DEFAULT_NUM_THREADS
from python_backends.preprocess.runner import DaliCpuRunner

# A decoded clip shorter than this share of its header's duration is truncated (codec padding and
# rounding stay well above it).
TRUNCATED_BELOW = 0.9


@dataclass(frozen=True)
class AudioLimits:
    """Per request; config parameters of the models that take audio."""

    max_seconds: float = 30.0  # one Whisper window
    max_bytes: int = 25 << 20  # vLLM's VLLM_MAX_AUDIO_CLIP_FILESIZE_MB default


def wav_header_seconds(data: bytes) -> float | None:
    """A WAV file's data chunk size over its byte rate: FFmpeg's WAV demuxer reports the size of
    the file instead, so neither a truncated file nor a header claiming hours would show there."""
    if not (data[:4] == b"RIFF" and data[8:12] == b"WAVE"):
        return None
    try:
        with wave.open(io.BytesIO(data)) as reader:
            return reader.getnframes() / reader.getframerate()
    except (wave.Error, EOFError, ZeroDivisionError):
        return None  # a WAV the stdlib does not parse (float samples, ...): FFmpeg's word stands


def declared_seconds(container: object, stream: object) -> float | None:
    """What the file's header says the audio lasts, if it says."""
    duration, time_base = getattr(stream, "duration", None), getattr(stream, "time_base", None)
    if duration and time_base:
        return float(duration * time_base)
    total = getattr(container, "duration", None)  # microseconds
    return total / 1_000_000 if total else None


def decode_audio(data: bytes, index: int, limits: AudioLimits, rate: int) -> np.ndarray:
    """Mono float32 samples in [-1, 1] at ``rate``; :class:`EpdError` (INVALID_ARG) naming the
    problem for anything else."""
    import av

    name = f"audio[{index}]"
    if len(data) == 0:
        raise invalid_arg(f"{name}: empty")
    if len(data) > limits.max_bytes:
        raise invalid_arg(f"{name}: {len(data)} bytes, above the limit of {limits.max_bytes} (max_audio_bytes)")
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError) as exc:
        raise invalid_arg(f"{name}: not an audio file FFmpeg can read ({exc})") from None
    with container:
        if not container.streams.audio:
            raise invalid_arg(f"{name}: the file has no audio stream")
        stream = container.streams.audio[0]
        declared = wav_header_seconds(data) or declared_seconds(container, stream)
        if declared is not None and declared > limits.max_seconds:
            raise invalid_arg(
                f"{name}: {declared:.1f} s long, above the limit of {limits.max_seconds:g} s (max_audio_seconds)"
            )
        max_samples = int(limits.max_seconds * rate)
        chunks: list[np.ndarray] = []
        decoded = 0
        try:
            resampler = av.AudioResampler(format="fltp", layout=stream.layout.name, rate=rate)
            for frame in itertools.chain(container.decode(stream), [None]):  # None: flush the resampler
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().mean(axis=0, dtype=np.float32))
                    decoded += chunks[-1].size
                if decoded > max_samples:  # counted as it decodes: memory stays bounded
                    raise invalid_arg(f"{name}: longer than the limit of {limits.max_seconds:g} s (max_audio_seconds)")
        except (av.error.FFmpegError, ValueError) as exc:
            raise invalid_arg(f"{name}: corrupt audio ({exc})") from None
    samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    if samples.size == 0:
        raise invalid_arg(f"{name}: no audio samples in the file")
    if declared is not None and samples.size < TRUNCATED_BELOW * declared * rate:
        held = samples.size / rate
        raise invalid_arg(f"{name}: truncated: the header says {declared:.2f} s, the file holds {held:.2f} s")
    return samples


@dataclass(frozen=True)
class AudioFeatures:
    """One clip's Whisper features (``[mel bins, frames]``, padded to the window) and the frames
    its audio fills (the length the encoder masks by)."""

    features: np.ndarray
    length: int


class DaliAudioFeatures(DaliCpuRunner):
    """The features pipeline (from samples) on the CPU, in batches of at most ``max_batch_size``."""

    def __init__(
        self,
        config: AudioFeatureConfig,
        max_batch_size: int = DEFAULT_AUDIO_BATCH_SIZE,
        num_threads: int = DEFAULT_NUM_THREADS,
    ) -> None:
        self.config = config
        super().__init__(serialize_audio_pipeline(config, max_batch_size, num_threads, decode=False),
                         max_batch_size, num_threads)  # fmt: skip

    def features(self, clips: Sequence[np.ndarray]) -> list[AudioFeatures]:
        out: list[AudioFeatures] = []
        for _, chunk in self._chunks(clips):
            features, samples = self._run_feeds({SAMPLES_INPUT: [np.ascontiguousarray(c, np.float32) for c in chunk]})
            out += [
                AudioFeatures(np.array(features[i]), feature_length(int(np.array(samples[i])[0]), self.config))
                for i in range(len(chunk))
            ]
        return out

"""Audio items of a request (issue 34): raw or base64 bytes, decoded with FFmpeg (PyAV) to mono
float32 samples at the model's rate, in bounded memory.

Why FFmpeg and not DALI's decoder: docs/benchmarks/audio-parity.md. vLLM's own fallback loader
(PyAV too) leaves integer PCM unscaled, so ``llm`` decodes here as well: the encoders (DALI
features, python_backends/preprocess/audio.py) and ``llm`` see the same samples.

:func:`decode_audio` works in bounded memory: the byte limit first, then the duration the
container declares (a header claiming hours is refused before any decoding), then the samples
counted as they are decoded. Channels are averaged (as ``librosa.load(mono=True)`` and vLLM do;
FFmpeg's own downmix keeps power instead). A file whose decoded length falls well short of what
its header declares is truncated and refused.

Plain Python: no Triton, DALI or torch import.
"""

from __future__ import annotations

import base64
import binascii
import io
import itertools
import wave
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from python_backends import contract
from python_backends.errors import invalid_arg
from python_backends.runtime.model_params import ModelParameters

# A decoded clip shorter than this share of its header's duration is truncated (codec padding and
# rounding stay well above it).
TRUNCATED_BELOW = 0.9


@dataclass(frozen=True)
class AudioLimits:
    """Per clip; config parameters of the models that take audio (contract.AUDIO_LIMITS, whose
    defaults these are: tests/unit/test_audio_decode.py keeps them equal)."""

    max_seconds: float = 30.0  # one Whisper window
    max_bytes: int = 25 << 20  # vLLM's VLLM_MAX_AUDIO_CLIP_FILESIZE_MB default


@dataclass(frozen=True)
class AudioInput:
    """A model's audio input: how many clips a request may carry, each clip's limits, and the
    rate clips are decoded to (the checkpoint feature extractor's)."""

    max_audios: int
    limits: AudioLimits
    sampling_rate: int

    @classmethod
    def from_params(cls, params: ModelParameters) -> AudioInput | None:
        """None when the model takes no audio (``max_audios`` 0)."""
        max_audios = params.integer(contract.MAX_AUDIOS)
        if max_audios == 0:
            return None
        limits = AudioLimits(params.number(contract.MAX_AUDIO_SECONDS), params.integer(contract.MAX_AUDIO_BYTES))
        return cls(max_audios, limits, params.integer(contract.AUDIO_SAMPLING_RATE))

    def decode(self, items: Sequence[bytes]) -> list[np.ndarray]:
        """Every clip of a request, decoded (raw or base64 bytes)."""
        return [decode_audio(audio_bytes(item), i, self.limits, self.sampling_rate) for i, item in enumerate(items)]

    def raw(self, items: Sequence[bytes]) -> list[bytes]:
        """Every clip of a request as file bytes (base64 decoded), empty or oversized ones refused
        (``epd``: content keys are taken over these bytes; its encoders decode them)."""
        clips = [audio_bytes(item) for item in items]
        for index, clip in enumerate(clips):
            if not clip:
                raise invalid_arg(f"audio[{index}]: empty")
            if len(clip) > self.limits.max_bytes:
                raise invalid_arg(
                    f"audio[{index}]: {len(clip)} bytes, above the limit of {self.limits.max_bytes} (max_audio_bytes)"
                )
        return clips


def audio_bytes(item: bytes) -> bytes:
    """The encoded audio in ``item``: base64 decoded when it is base64 (an audio file's bytes
    are not: they hold bytes outside its alphabet), else as it is."""
    try:
        decoded = base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError):
        return item
    return decoded or item


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



"""Generated audio clips for tests and benchmarks: a tone under seeded noise, encoded as WAV (stdlib)
or through FFmpeg (PyAV, which bundles it): FLAC, Ogg Vorbis, Ogg Opus, MP3."""

from __future__ import annotations

import io
import wave

import numpy as np

SAMPLING_RATE = 16_000


def tone(seconds: float, hz: float, seed: int = 0, rate: int = SAMPLING_RATE) -> np.ndarray:
    """float32 mono samples in [-0.35, 0.35]."""
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).standard_normal(t.size)
    return (0.3 * np.sin(2 * np.pi * hz * t) + 0.05 * np.clip(noise, -1, 1)).astype(np.float32)


def pcm16(samples: np.ndarray) -> np.ndarray:
    """The int16 samples a 16-bit file stores, back as float32 (what a decoder gives)."""
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").astype(np.float32) / 32768


def wav(samples: np.ndarray, rate: int = SAMPLING_RATE, channels: int = 1) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(channels)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        frames = np.repeat(samples[:, None], channels, axis=1) if channels > 1 else samples
        writer.writeframes((np.clip(frames, -1, 1) * 32767).astype("<i2").tobytes())
    return out.getvalue()


def encoded(samples: np.ndarray, container: str, codec: str, rate: int = SAMPLING_RATE) -> bytes:
    """``samples`` through FFmpeg's ``codec`` into ``container`` (e.g. flac/flac, ogg/libvorbis,
    ogg/libopus at 48 kHz)."""
    import av

    out = io.BytesIO()
    with av.open(out, "w", format=container) as muxer:
        stream = muxer.add_stream(codec, rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray((np.clip(samples, -1, 1) * 32767).astype(np.int16)[None], format="s16",
                                           layout="mono")  # fmt: skip
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            muxer.mux(packet)
        for packet in stream.encode(None):
            muxer.mux(packet)
    return out.getvalue()

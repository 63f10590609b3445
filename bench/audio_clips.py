"""Generated audio clips for tests and benchmarks: a tone under seeded noise, encoded as WAV (stdlib)
or through FFmpeg (PyAV, which bundles it): FLAC, Ogg Vorbis, Ogg Opus, MP3; and every kind of bad
audio with what its INVALID_ARG message says (unit tests decode them, server tests send them)."""

from __future__ import annotations

import io
import struct
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


CLIP = tone(3.0, 440.0, seed=11)
# The ``max_audio_bytes`` the "too many bytes" case is sent against.
TOO_MANY_BYTES_LIMIT = 1000


def claims_hours(data: bytes) -> bytes:
    """A WAV whose RIFF and data chunk sizes say ~37 hours."""
    out = bytearray(data)
    at = out.find(b"data")
    out[at + 4 : at + 8] = struct.pack("<I", 0xFFFFFF00)
    out[4:8] = struct.pack("<I", 0xFFFFFF00 + 36)
    return bytes(out)


BAD_AUDIO = {  # name: (bytes, what the message says)
    "empty": (lambda: b"", "empty"),
    "not audio": (lambda: b"\x00\x01nonsense" * 100, "not an audio file"),
    "an image": (lambda: b"\x89PNG\r\n\x1a\n" + b"\0" * 100, "no audio stream"),
    "header only": (lambda: wav(CLIP)[:44], "no audio samples"),
    "truncated wav": (lambda: wav(CLIP)[: len(wav(CLIP)) // 3], "truncated: the header says 3.00 s"),
    "truncated mp3": (lambda: encoded(CLIP, "mp3", "libmp3lame")[:2000], "truncated"),
    "truncated flac": (lambda: encoded(CLIP, "flac", "flac")[:20000], "corrupt audio"),
    "too long": (lambda: wav(tone(31.0, 440.0)), "31.0 s long, above the limit of 30 s (max_audio_seconds)"),
    "header claims hours": (lambda: claims_hours(wav(CLIP)), "134217.7 s long, above the limit"),
    # FFmpeg's Ogg demuxer says 3.9 s for this 31 s file: caught by counting samples as they decode
    "longer than its header says": (lambda: encoded(tone(31.0, 440.0), "ogg", "libvorbis"), "longer than the limit"),
    "too many bytes": (lambda: wav(tone(1.0, 440.0)), f"above the limit of {TOO_MANY_BYTES_LIMIT} (max_audio_bytes)"),
}



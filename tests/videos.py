"""Video clips the tests make with PyAV (its wheel bundles FFmpeg): good clips and broken files.

Every frame differs from its neighbours (a bar moves one step per frame and the frame number is
drawn as a binary strip), so a test that picks the wrong frame index sees it in the pixels.
Clips are deterministic for a given :class:`ClipSpec` (same encoder, same settings, same bytes).

Codecs by target (DESIGN.md): DALI's CPU decoder reads VP8, VP9 and MJPEG; H.264, HEVC and AV1
need the GPU (NVDEC) decoder.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import av
import numpy as np

# codec -> (PyAV encoder name, container format, pixel format)
CODECS: dict[str, tuple[str, str, str]] = {
    "vp8": ("libvpx", "webm", "yuv420p"),
    "vp9": ("libvpx-vp9", "webm", "yuv420p"),
    "mjpeg": ("mjpeg", "avi", "yuvj420p"),
    "h264": ("libx264", "mp4", "yuv420p"),
    "hevc": ("libx265", "mp4", "yuv420p"),
    "av1": ("libsvtav1", "mp4", "yuv420p"),
}
CPU_CODECS = ("vp8", "vp9", "mjpeg")
GPU_ONLY_CODECS = ("h264", "hevc", "av1")

# Fast, deterministic encoder settings (2-core machines): quality is not what the tests measure.
_ENCODER_OPTIONS: dict[str, dict[str, str]] = {
    "libvpx": {"deadline": "realtime", "cpu-used": "8", "threads": "1", "crf": "10", "b": "0"},
    "libvpx-vp9": {"deadline": "realtime", "cpu-used": "8", "threads": "1", "crf": "20", "b": "0", "row-mt": "0"},
    "mjpeg": {},
    "libx264": {"preset": "ultrafast", "threads": "1"},
    "libx265": {"preset": "ultrafast", "x265-params": "log-level=none:pools=1:frame-threads=1"},
    "libsvtav1": {"preset": "12"},
}


@dataclass(frozen=True)
class ClipSpec:
    """One generated clip. ``seconds * fps`` frames are encoded."""

    codec: str = "vp9"
    width: int = 160
    height: int = 120
    fps: int = 10
    seconds: float = 2.0
    seed: int = 0
    container: str | None = None  # default: the codec's usual container
    options: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    @property
    def num_frames(self) -> int:
        return max(1, round(self.seconds * self.fps))

    @property
    def name(self) -> str:
        return f"{self.codec}-{self.width}x{self.height}-{self.fps}fps-{self.seconds:g}s"


def frame_pixels(width: int, height: int, index: int, seed: int = 0) -> np.ndarray:
    """Frame ``index`` of a clip as uint8 RGB [H, W, 3]: smooth gradients (so chroma
    subsampling and lossy codecs keep it recognisable), a bar that moves one step per frame and
    the frame number as a strip of 12 black/white cells at the top."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = seed * 0.7
    red = 128 + 100 * np.sin(x / max(width, 1) * 6.28 + phase)
    green = 128 + 100 * np.cos(y / max(height, 1) * 6.28 + phase)
    blue = (x + y) / max(width + height, 1) * 200 + 20
    pixels = np.stack([red, green, blue], axis=-1)
    bar_width = max(2, width // 16)
    start = (index * max(1, width // 40)) % max(1, width - bar_width)
    pixels[:, start : start + bar_width] = 235  # neutral (luma-only) edges: see chroma_edges
    cell = max(1, width // 12)
    strip = max(2, height // 10)
    for bit in range(12):
        on = (index >> bit) & 1
        pixels[:strip, bit * cell : (bit + 1) * cell] = 255 if on else 0
    return np.clip(pixels, 0, 255).astype(np.uint8)


def make_clip(spec: ClipSpec) -> bytes:
    """Encode ``spec`` in memory; returns the container bytes."""
    encoder, default_container, pix_fmt = CODECS[spec.codec]
    container_format = spec.container or default_container
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container_format) as output:
        stream = output.add_stream(encoder, rate=Fraction(spec.fps))
        stream.width, stream.height = spec.width, spec.height
        stream.pix_fmt = pix_fmt
        stream.options = {**_ENCODER_OPTIONS.get(encoder, {}), **spec.options}
        if spec.codec == "mjpeg":
            stream.codec_context.qmin = stream.codec_context.qmax = 2  # near-lossless JPEG frames
        for index in range(spec.num_frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(spec.width, spec.height, index, spec.seed), format="rgb24")
            frame.pts = index
            frame.time_base = Fraction(1, spec.fps)
            for packet in stream.encode(frame):
                output.mux(packet)
        for packet in stream.encode(None):
            output.mux(packet)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# Broken videos
# ---------------------------------------------------------------------------------------------


def corrupt_clip(spec: ClipSpec | None = None, seed: int = 1) -> bytes:
    """A real clip with its payload overwritten by noise after the first 64 bytes (the container
    signature survives, nothing behind it makes sense)."""
    data = bytearray(make_clip(spec or ClipSpec()))
    rng = np.random.default_rng(seed)
    data[64:] = rng.integers(0, 256, size=len(data) - 64, dtype=np.uint8).tobytes()
    return bytes(data)


def truncated_clip(spec: ClipSpec | None = None, keep: float = 0.3) -> bytes:
    """The first ``keep`` share of a clip's bytes. The default (30 % of a 3 s 160x120 VP9 WebM)
    is refused by both ``llm`` and ``epd``: its 2 sampled frames are not in the stream. Other cuts
    keep whole frames and are served by both (docs/video.md, truncated files)."""
    data = make_clip(spec or ClipSpec(seconds=3))
    return data[: max(16, int(len(data) * keep))]


def zero_frame_clip(codec: str = "vp9") -> bytes:
    """A valid container with a video stream and no frame in it."""
    encoder, container_format, pix_fmt = CODECS[codec]
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container_format) as output:
        stream = output.add_stream(encoder, rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 64, pix_fmt
        stream.options = _ENCODER_OPTIONS.get(encoder, {})
        output.start_encoding()  # writes the container header; a muxer writes it at the first packet otherwise
        for packet in stream.encode(None):
            output.mux(packet)
    return buffer.getvalue()


def huge_frame_header_clip(width: int = 30000, height: int = 30000) -> bytes:
    """An MJPEG AVI whose headers (AVI stream header and the JPEG SOF marker) promise a
    ``width`` x ``height`` frame: a decoder that trusted it would allocate width*height*3 bytes
    per frame. Made from a real 64x64 clip with the sizes patched in place."""
    data = bytearray(make_clip(ClipSpec(codec="mjpeg", width=64, height=64, fps=5, seconds=1)))
    # AVI: 'avih' main header (dwWidth, dwHeight at +40/+44 from the chunk data) and 'strf'
    # BITMAPINFOHEADER (biWidth, biHeight at +4/+8).
    avih = data.find(b"avih")
    if avih >= 0:
        struct.pack_into("<II", data, avih + 8 + 32, width, height)
    strf = data.find(b"strf")
    if strf >= 0:
        struct.pack_into("<ii", data, strf + 8 + 4, width, height)
    # Every JPEG SOF0 marker: FF C0, length (2), precision (1), height (2), width (2), big-endian.
    position = data.find(b"\xff\xc0")
    while position >= 0:
        struct.pack_into(">HH", data, position + 5, height, width)
        position = data.find(b"\xff\xc0", position + 2)
    return bytes(data)


def bad_videos() -> dict[str, tuple[Callable[[], bytes], str]]:
    """Name -> (maker, words the error message must contain) for every kind of bad video."""
    return {
        "corrupt bytes": (corrupt_clip, "cannot be opened"),
        "truncated file": (truncated_clip, "corrupt or truncated"),
        "zero frames": (lambda: zero_frame_clip("mjpeg"), "has no frames"),
        "unsupported codec (H.264 on cpu)": (lambda: make_clip(ClipSpec("h264")), "codec h264"),
        "over max_video_seconds (12 s > 10 s)": (
            lambda: make_clip(ClipSpec("vp8", 64, 64, 5, 12)),
            "max_video_seconds",
        ),
        "30000x30000 frame header": (huge_frame_header_clip, "frame too large"),
        "one frame": (lambda: make_clip(ClipSpec("vp9", 64, 64, 5, 0.2)), "needs at least 2"),
        "not a video": (lambda: b"GIF89a not a video", "neither an encoded video"),
    }

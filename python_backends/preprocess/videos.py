"""CPU runner of the serialized DALI video pipeline (:mod:`python_backends.preprocess.video_pipeline`).

The ``cpu`` target's video preprocessing: it takes a batch of encoded videos (raw bytes or
base64), checks each from its container before any frame is decoded (size, codec, frame size,
duration, decoded bytes), picks the frame indices vLLM's Qwen2-VL loader picks
(:func:`python_backends.request.videos.sample_frame_indices`), decodes exactly those frames with OpenCV
the way vLLM's loader does (:func:`python_backends.request.videos.read_sampled_frames`; why not DALI's
CPU decoder: :mod:`python_backends.preprocess.video_pipeline`), refuses a video that did not yield
every sampled frame as ``llm`` does (:func:`python_backends.request.videos.checked_decode`, the one
check both use), runs the pipeline (resize, normalize), and
returns what vLLM's loader + transformers' ``Qwen2VLVideoProcessor`` return:
``pixel_values_videos`` ``[sum(t*h*w), C*T*P*P]`` float32 and ``video_grid_thw``
``[num_videos, 3]`` int64.

:func:`prepare_video` is the part without DALI: the GPU target's caller (the BLS in front of
Triton's DALI backend) uses it to build the pipeline's ``frame_indices`` and ``resize_hw``
inputs. Plain Python: no Triton import. Not thread-safe (one DALI pipeline, one batch at a time).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from python_backends.errors import EpdError, ErrorCode, invalid_arg
from python_backends.preprocess.image_pipeline import DEFAULT_NUM_THREADS
from python_backends.preprocess.runner import DaliCpuRunner
from python_backends.preprocess.video_pipeline import (
    DECODED_FRAMES_INPUT,
    DEFAULT_VIDEO_BATCH_SIZE,
    RESIZE_INPUT,
    VideoTransformConfig,
    serialize_video_pipeline,
)
from python_backends.request.videos import (
    CPU_CODECS,
    VideoLimits,
    VideoProbe,
    VideoSamplingConfig,
    checked_decode,
    checked_video,
    read_sampled_frames,
)

LOGGER = logging.getLogger(__name__)

# Decoded RGB bytes one video may hold in DALI before the resize (frames x W x H x 3).
DEFAULT_MAX_DECODED_BYTES = 1 << 30


@dataclass(frozen=True)
class PreparedVideo:
    """One checked video and the pipeline inputs for it."""

    data: bytes
    probe: VideoProbe
    frame_indices: list[int]
    out_height: int
    out_width: int
    grid_thw: tuple[int, int, int] = field(default=(0, 0, 0))

    def resize_input(self) -> np.ndarray:
        return np.array([self.probe.height, self.out_height, self.out_width], dtype=np.int64)


def prepare_video(
    item: bytes,
    index: int,
    transform: VideoTransformConfig,
    sampling: VideoSamplingConfig,
    limits: VideoLimits,
    codecs: tuple[str, ...] = CPU_CODECS,
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
) -> PreparedVideo:
    """Validate ``item`` from its container and compute the frames and size to produce."""
    data, probe, indices = checked_video(item, index, sampling, limits, codecs, max_decoded_bytes)
    out_height, out_width = transform.frame_size(probe.height, probe.width, len(indices))
    grid = transform.grid_thw(len(indices), out_height, out_width)
    return PreparedVideo(data, probe, indices, out_height, out_width, grid)


def patchify_video(frames: np.ndarray, transform: VideoTransformConfig) -> np.ndarray:
    """``[F, C, H, W]`` -> ``[grid_t * grid_h * grid_w, C * T * P * P]`` in
    ``Qwen2VLVideoProcessor.patchify``'s order (frames padded with the last one to a multiple
    of the temporal patch size)."""
    p, m, t = transform.image.patch_size, transform.image.merge_size, transform.image.temporal_patch_size
    if pad := -frames.shape[0] % t:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    num_frames, channels, height, width = frames.shape
    grid_t, grid_h, grid_w = num_frames // t, height // p, width // p
    blocks = frames.reshape(grid_t, t, channels, grid_h // m, m, p, grid_w // m, m, p)
    ordered = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return ordered.reshape(grid_t * grid_h * grid_w, channels * t * p * p)


@dataclass(frozen=True)
class PreprocessedVideos:
    """The processor's outputs for a batch, videos in request order."""

    pixel_values_videos: np.ndarray  # [sum(t*h*w), C*T*P*P] float32
    video_grid_thw: np.ndarray  # [num_videos, 3] int64
    frame_indices: list[list[int]]  # the source frames each video's rows come from

    def patch_counts(self) -> list[int]:
        return [int(t * h * w) for t, h, w in self.video_grid_thw]


def _decode(video: PreparedVideo, index: int) -> np.ndarray:
    """The sampled frames of ``video``, decoded as vLLM's loader decodes them and checked as
    ``llm`` checks what that loader returns (one function: ``checked_decode``)."""
    return checked_decode(
        lambda: read_sampled_frames(video.data, video.frame_indices, index), len, len(video.frame_indices), index
    )


class DaliVideoPreprocessor(DaliCpuRunner):
    """The ``cpu`` target's video preprocessing: OpenCV decodes the sampled frames as vLLM's
    loader does (:func:`python_backends.request.videos.read_sampled_frames`), the serialized pipeline
    resizes and normalizes them, at most ``max_batch_size`` videos a run."""

    def __init__(
        self,
        serialized_pipeline: bytes,
        transform: VideoTransformConfig,
        sampling: VideoSamplingConfig | None = None,
        limits: VideoLimits | None = None,
        max_batch_size: int = DEFAULT_VIDEO_BATCH_SIZE,
        num_threads: int = DEFAULT_NUM_THREADS,
        max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
    ) -> None:
        """``transform`` must be the one the pipeline was serialized from."""
        self._transform = transform
        self._sampling = sampling or VideoSamplingConfig(temporal_patch_size=transform.image.temporal_patch_size)
        self._sampling.validate()
        if self._sampling.temporal_patch_size != transform.image.temporal_patch_size:
            raise ValueError("the sampler's temporal_patch_size must equal the processor's")
        self._limits = limits or VideoLimits()
        self._max_decoded_bytes = max_decoded_bytes
        super().__init__(serialized_pipeline, max_batch_size, num_threads)

    @classmethod
    def for_config(
        cls,
        transform: VideoTransformConfig,
        sampling: VideoSamplingConfig | None = None,
        limits: VideoLimits | None = None,
        max_batch_size: int = DEFAULT_VIDEO_BATCH_SIZE,
        num_threads: int = DEFAULT_NUM_THREADS,
        max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
    ) -> DaliVideoPreprocessor:
        """Serialize the CPU pipeline in process (tests, benchmarks, no model repository)."""
        serialized = serialize_video_pipeline(transform, "cpu", max_batch_size=max_batch_size)
        return cls(serialized, transform, sampling, limits, max_batch_size, num_threads, max_decoded_bytes)

    @property
    def limits(self) -> VideoLimits:
        return self._limits

    @property
    def sampling(self) -> VideoSamplingConfig:
        return self._sampling

    @property
    def merge_size(self) -> int:
        return self._transform.image.merge_size

    def prepare(self, items: Sequence[bytes]) -> list[PreparedVideo]:
        if len(items) == 0:
            raise invalid_arg("no video given")
        if len(items) > self._limits.max_videos:
            raise invalid_arg(f"{len(items)} videos given, above the limit of {self._limits.max_videos} (max_videos)")
        return [
            prepare_video(item, i, self._transform, self._sampling, self._limits, CPU_CODECS, self._max_decoded_bytes)
            for i, item in enumerate(items)
        ]

    def preprocess(self, items: Sequence[bytes]) -> PreprocessedVideos:
        """Validate, then decode + transform every video; all-or-nothing for the batch."""
        prepared = self.prepare(items)
        chunks: list[np.ndarray] = []
        for start, chunk in self._chunks(prepared):
            # Decoded one chunk at a time: at most max_batch_size videos' frames held at once.
            frames = [_decode(v, start + i) for i, v in enumerate(chunk)]
            chunks.extend(self._run_chunk(list(chunk), frames))
        return PreprocessedVideos(
            pixel_values_videos=chunks[0] if len(chunks) == 1 else np.concatenate(chunks),
            video_grid_thw=np.array([video.grid_thw for video in prepared], dtype=np.int64).reshape(-1, 3),
            frame_indices=[video.frame_indices for video in prepared],
        )

    def _run_chunk(self, chunk: list[PreparedVideo], frames: list[np.ndarray]) -> list[np.ndarray]:
        try:
            (normalized,) = self._run_feeds(
                {DECODED_FRAMES_INPUT: frames, RESIZE_INPUT: [video.resize_input() for video in chunk]}
            )
            outputs = []
            for i, video in enumerate(chunk):
                sample = np.asarray(normalized[i])
                expected = (len(video.frame_indices), 3, video.out_height, video.out_width)
                if sample.shape != expected:
                    raise RuntimeError(f"video {i}: got frames of shape {sample.shape}, expected {expected}")
                outputs.append(patchify_video(sample, self._transform))  # a copy, out of DALI's buffer
            return outputs
        except RuntimeError:
            # The frames were decoded and checked already: a failure here is ours, not the client's.
            self._rebuild()
            LOGGER.exception("DALI failed on a batch of decoded video frames")
            raise EpdError("video preprocessing failed", ErrorCode.INTERNAL) from None

"""CPU runner of the serialized DALI video pipeline (:mod:`python_backends.dali_video`).

The ``cpu`` target's video preprocessing: it takes a batch of encoded videos (raw bytes or
base64), checks each from its container before any frame is decoded (size, codec, frame size,
duration, decoded bytes), picks the frame indices vLLM's Qwen2-VL loader picks
(:func:`python_backends.video.sample_frame_indices`), runs the pipeline, and returns what
vLLM's loader + transformers' ``Qwen2VLVideoProcessor`` return: ``pixel_values_videos``
``[sum(t*h*w), C*T*P*P]`` float32 and ``video_grid_thw`` ``[num_videos, 3]`` int64.

:func:`prepare_video` is the part without DALI: the GPU target's caller (the BLS in front of
Triton's DALI backend) uses it to build the pipeline's ``frame_indices`` and ``resize_hw``
inputs. Plain Python: no Triton import. Not thread-safe (one DALI pipeline, one batch at a time).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from nvidia.dali.pipeline import Pipeline

from python_backends.dali_pipeline import DEFAULT_NUM_THREADS
from python_backends.dali_video import (
    DEFAULT_VIDEO_BATCH_SIZE,
    FRAME_INDICES_INPUT,
    RESIZE_INPUT,
    VIDEO_INPUT,
    VideoTransformConfig,
    serialize_video_pipeline,
)
from python_backends.errors import EpdError, ErrorCode, invalid_arg
from python_backends.video import (
    CPU_CODECS,
    VideoLimits,
    VideoProbe,
    VideoSamplingConfig,
    checked_video,
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


class DaliVideoPreprocessor:
    """Runs the serialized video pipeline on the CPU, at most ``max_batch_size`` videos a run."""

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
        if max_batch_size <= 0 or num_threads <= 0:
            raise ValueError("max_batch_size and num_threads must be positive")
        self._serialized = serialized_pipeline
        self._transform = transform
        self._sampling = sampling or VideoSamplingConfig(temporal_patch_size=transform.image.temporal_patch_size)
        self._sampling.validate()
        if self._sampling.temporal_patch_size != transform.image.temporal_patch_size:
            raise ValueError("the sampler's temporal_patch_size must equal the processor's")
        self._limits = limits or VideoLimits()
        self._max_batch_size = max_batch_size
        self._num_threads = num_threads
        self._max_decoded_bytes = max_decoded_bytes
        self._pipeline = self._build()

    @classmethod
    def from_file(cls, path: str | Path, transform: VideoTransformConfig, **kwargs: object) -> DaliVideoPreprocessor:
        return cls(Path(path).read_bytes(), transform, **kwargs)  # type: ignore[arg-type]

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

    def _build(self) -> Pipeline:
        pipeline = Pipeline.deserialize(
            serialized_pipeline=self._serialized,
            batch_size=self._max_batch_size,
            num_threads=self._num_threads,
            device_id=None,
            prefetch_queue_depth=1,
        )
        pipeline.build()
        return pipeline

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
        for start in range(0, len(prepared), self._max_batch_size):
            chunks.extend(self._run_chunk(prepared[start : start + self._max_batch_size], start))
        return PreprocessedVideos(
            pixel_values_videos=chunks[0] if len(chunks) == 1 else np.concatenate(chunks),
            video_grid_thw=np.array([video.grid_thw for video in prepared], dtype=np.int64).reshape(-1, 3),
            frame_indices=[video.frame_indices for video in prepared],
        )

    def _run_chunk(self, chunk: list[PreparedVideo], first_index: int) -> list[np.ndarray]:
        try:
            return self._run(chunk)
        except RuntimeError:
            self._pipeline = self._build()
            bad = self._find_undecodable(chunk)
            if bad is None:
                LOGGER.exception("DALI failed on a video batch whose videos decode one by one")
                raise EpdError("video preprocessing failed", ErrorCode.INTERNAL) from None
            raise invalid_arg(f"video[{first_index + bad}] cannot be decoded: corrupt or truncated data") from None

    def _run(self, chunk: list[PreparedVideo]) -> list[np.ndarray]:
        self._pipeline.feed_input(VIDEO_INPUT, [np.frombuffer(video.data, dtype=np.uint8) for video in chunk])
        self._pipeline.feed_input(
            FRAME_INDICES_INPUT, [np.asarray(video.frame_indices, dtype=np.int32) for video in chunk]
        )
        self._pipeline.feed_input(RESIZE_INPUT, [video.resize_input() for video in chunk])
        (frames,) = self._pipeline.run()
        outputs = []
        for i, video in enumerate(chunk):
            sample = np.asarray(frames[i])
            expected = (len(video.frame_indices), 3, video.out_height, video.out_width)
            if sample.shape != expected:  # DALI returned fewer frames than asked: broken stream
                raise RuntimeError(f"video {i}: got frames of shape {sample.shape}, expected {expected}")
            outputs.append(patchify_video(sample, self._transform))  # a copy, out of DALI's buffer
        return outputs

    def _find_undecodable(self, chunk: list[PreparedVideo]) -> int | None:
        for index, video in enumerate(chunk):
            try:
                self._run([video])
            except RuntimeError:
                self._pipeline = self._build()
                return index
        return None

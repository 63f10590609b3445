"""Videos on ``llm``: checked from the container, then read by vLLM's own loader.

``llm`` is the baseline ("raw media through vLLM's own loading"): for video that is the loader
vLLM registers for Qwen2-VL's video processor, ``Qwen2VLVideoBackend`` (OpenCV decode, the
fps sampler; :mod:`python_backends.request.videos` says what it does). Before it sees a byte, every
video passes the same header checks as ``preprocess`` (:func:`python_backends.request.videos.checked_video`:
corrupt, truncated header, zero frames, unsupported codec on this target, too long, a frame
too large), so a bad video is a clear INVALID_ARG and costs no decode. The loader gets the
same sampling values (``max_frames`` from the config) as the checks, so it picks the frames
the checks counted.

Plain Python, no Triton import; vLLM is imported when a video is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from python_backends import contract
from python_backends.errors import EpdError, invalid_arg
from python_backends.request.videos import VideoLimits, VideoSamplingConfig, checked_video
from python_backends.runtime.model_params import ModelParameters

# Decoded RGB bytes one video may need before the processor resizes it (frames x W x H x 3):
# vLLM's loader holds the sampled frames at full size.
DEFAULT_MAX_DECODED_BYTES = 1 << 30


@dataclass(frozen=True)
class VideoInputLimits:
    """What ``llm`` accepts as video, from its config parameters (contract.VIDEO_LIMITS)."""

    limits: VideoLimits = field(default_factory=VideoLimits)
    sampling: VideoSamplingConfig = field(default_factory=VideoSamplingConfig)
    codecs: tuple[str, ...] = ("vp8", "vp9", "mjpeg")
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES

    @classmethod
    def from_params(cls, params: ModelParameters) -> VideoInputLimits | None:
        """None when the model takes no video (``max_videos`` 0)."""
        max_videos = params.integer(contract.MAX_VIDEOS)
        if max_videos == 0:
            return None
        limits = VideoLimits(
            max_videos=max_videos,
            max_video_bytes=params.integer(contract.MAX_VIDEO_BYTES),
            max_video_seconds=params.number(contract.MAX_VIDEO_SECONDS),
        )
        sampling = VideoSamplingConfig(max_frames=params.integer(contract.MAX_FRAMES))
        try:
            sampling.validate()
        except ValueError as exc:
            raise contract.ContractError(f"parameter '{contract.MAX_FRAMES}': {exc}") from None
        codecs = tuple(c.strip() for c in params.string(contract.VIDEO_CODECS).split(",") if c.strip())
        if not codecs:
            raise contract.ContractError(f"parameter '{contract.VIDEO_CODECS}' names no codec")
        return cls(limits, sampling, codecs)


# vLLM's video item for Qwen2-VL: the sampled frames [F, H, W, 3] uint8 and the loader's metadata.
LoadedVideo = tuple[np.ndarray, dict[str, Any]]


def load_video(item: bytes, index: int, limits: VideoInputLimits) -> LoadedVideo:
    """Check one video from its container, then decode and sample it with vLLM's loader."""
    data, _probe, indices = checked_video(
        item, index, limits.sampling, limits.limits, limits.codecs, limits.max_decoded_bytes
    )
    from vllm.multimodal.video import Qwen2VLVideoBackend

    loader_kwargs: dict[str, Any] = dict(limits.sampling.loader_kwargs())
    try:
        frames, metadata = Qwen2VLVideoBackend.load_bytes(data, **loader_kwargs)
    except EpdError:
        raise
    except Exception as exc:  # OpenCV/vLLM refuse a stream the header check let through
        raise invalid_arg(f"video[{index}] cannot be decoded: {type(exc).__name__}: {exc}") from None
    if len(frames) != len(indices):
        # The header promised frames the stream does not hold (a cut file): vLLM would serve
        # fewer frames than the sampler picked; refuse it like preprocess does.
        raise invalid_arg(
            f"video[{index}] cannot be decoded: corrupt or truncated data "
            f"({len(frames)} of {len(indices)} sampled frames read)"
        )
    return frames, metadata


def load_videos(items: Sequence[bytes], limits: VideoInputLimits | None) -> list[LoadedVideo]:
    if not items:
        return []
    if limits is None:
        raise invalid_arg("this model takes no video (max_videos is 0)")
    if len(items) > limits.limits.max_videos:
        raise invalid_arg(
            f"request has {len(items)} videos, above the limit of {limits.limits.max_videos} (max_videos)"
        )
    return [load_video(item, i, limits) for i, item in enumerate(items)]

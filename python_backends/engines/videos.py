"""Videos on ``llm``: checked from the container, then read by vLLM's own loader.

``llm`` is the baseline ("raw media through vLLM's own loading"): for video that is the loader
vLLM registers for Qwen2-VL's video processor, ``Qwen2VLVideoBackend`` (OpenCV decode, the
fps sampler; :mod:`python_backends.request.videos` says what it does). Before it sees a byte, every
video passes the same header checks as ``preprocess`` (:func:`python_backends.request.videos.checked_video`:
corrupt, truncated header, zero frames, unsupported codec on this target, too long, a frame
too large), so a bad video is a clear INVALID_ARG and costs no decode. The loader gets the
same sampling values (``max_frames`` from the config) as the checks, so it picks the frames
the checks counted; what it returns passes the same check as ``epd``'s decode
(:func:`python_backends.request.videos.checked_decode`: every sampled frame read, else
INVALID_ARG), so both decide alike on a truncated file.

Plain Python, no Triton import; vLLM is imported when a video is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from python_backends import contract
from python_backends.errors import invalid_arg
from python_backends.request.videos import VideoLimits, VideoSamplingConfig, checked_decode, checked_video
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
    """Check one video from its container, decode and sample it with vLLM's loader, check what
    the loader returned: the same two checks as ``epd``'s encoders make around their decode
    (:func:`python_backends.request.videos.checked_video`, :func:`~python_backends.request.videos.checked_decode`)."""
    data, _probe, indices = checked_video(
        item, index, limits.sampling, limits.limits, limits.codecs, limits.max_decoded_bytes
    )
    from vllm.multimodal.video import Qwen2VLVideoBackend

    loader_kwargs: dict[str, Any] = dict(limits.sampling.loader_kwargs())
    # The check after decoding is epd's too (its encoders pass read_sampled_frames): a stream
    # the loader cannot read, or one that holds fewer of the sampled frames than the header
    # promised (a cut file), is refused with the same words on both.
    return checked_decode(
        lambda: Qwen2VLVideoBackend.load_bytes(data, **loader_kwargs), lambda video: len(video[0]), len(indices), index
    )


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

"""The one DALI pipeline that turns videos into Qwen2-VL ``pixel_values_videos``.

Same rules as the image pipeline (:mod:`python_backends.preprocess.image_pipeline`): one definition,
serialized for the ``cpu`` target (run with ``device_id=None`` by
:mod:`python_backends.preprocess.videos`) and for ``gpu`` (Triton's DALI backend).

Per video it reproduces what vLLM does for Qwen2-VL (:mod:`python_backends.request.videos`): the frames
the sampler picked (``frame_indices``: the sampler needs the container's frame count and fps,
which the caller reads with the same OpenCV probe as vLLM), resized to the video processor's
``smart_resize`` size (``resize_hw``: with ``cap_pixels_per_frame`` the pixel budget depends on
the number of sampled frames), bicubic with the processor's pass order
(:func:`python_backends.preprocess.image_pipeline.pil_compatible_bicubic`), rescaled + normalized to
``[F, C, H, W]``. The temporal patch layout (``[grid_t * grid_h * grid_w, C * T * P * P]``) is
made in numpy (:func:`python_backends.preprocess.videos.patchify_video`).

Where the frames are decoded differs by target, and that is deliberate:

- ``cpu``: **not in DALI**. The caller decodes the sampled frames with OpenCV exactly as vLLM's
  loader does (:func:`python_backends.request.videos.read_sampled_frames`) and feeds them as
  ``decoded_frames``. DALI's CPU decoder converts YUV to RGB differently from OpenCV (up to
  ~46 levels at sharp edges), enough to flip greedy tokens against ``llm``, which reads raw
  video through vLLM's own OpenCV loader (docs/benchmarks/video.md).
- ``gpu``: the ``mixed`` (NVDEC) decoder in the graph, from the encoded ``video`` and
  ``frame_indices`` (H.264/HEVC/AV1 need it; its colour conversion is NVDEC's, not OpenCV's).

Inputs (external sources, a contract with the DALI backend's config and the runner):
``cpu``: ``decoded_frames`` (uint8 ``[F, H, W, 3]``, RGB); ``gpu``: ``video`` (uint8 bytes) and
``frame_indices`` (int32 [F]); both: ``resize_hw`` (int64 [3]: source height, output height,
output width). Output: ``frames`` float32 ``[F, C, H, W]``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode
from nvidia.dali.pipeline import Pipeline

from python_backends.preprocess.image_pipeline import (
    DEFAULT_NUM_THREADS,
    Device,
    check_device,
    pil_compatible_bicubic,
    pipeline_of,
    serialized,
    write_serialized,
)
from python_backends.preprocess.processor import ImageTransformConfig, PreprocessConfigError, smart_resize

VIDEO_INPUT = "video"  # gpu
DECODED_FRAMES_INPUT = "decoded_frames"  # cpu
FRAME_INDICES_INPUT = "frame_indices"
RESIZE_INPUT = "resize_hw"
VIDEO_OUTPUT = "frames"
DEFAULT_VIDEO_BATCH_SIZE = 2

# transformers' Qwen2VLVideoProcessor class defaults, used where the config file is silent.
_VIDEO_MIN_PIXELS = 128 * 28 * 28
_VIDEO_MAX_PIXELS = 28 * 28 * 768
_VIDEO_MAX_TOKENS = 128000


@dataclass(frozen=True)
class VideoTransformConfig:
    """The parts of a Qwen2-VL ``video_preprocessor_config.json`` that define the transform."""

    image: ImageTransformConfig  # patch sizes, pixel bounds (size), mean/std, rescale
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = _VIDEO_MAX_TOKENS

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> VideoTransformConfig:
        raw = dict(raw)
        if "size" not in raw and "min_pixels" not in raw and "max_pixels" not in raw:
            raw["size"] = {"shortest_edge": _VIDEO_MIN_PIXELS, "longest_edge": _VIDEO_MAX_PIXELS}
        config = cls(
            image=ImageTransformConfig.from_dict(raw),
            # transformers 5.19 treats a missing value as False (with a warning).
            cap_pixels_per_frame=bool(raw.get("cap_pixels_per_frame") or False),
            max_video_tokens=int(raw.get("max_video_tokens", _VIDEO_MAX_TOKENS)),
        )
        if config.max_video_tokens <= 0:
            raise PreprocessConfigError(f"max_video_tokens must be positive, got {config.max_video_tokens}")
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> VideoTransformConfig:
        """From a checkpoint directory (``video_preprocessor_config.json``, else the image
        processor's file, as transformers falls back) or a file."""
        path = Path(path)
        if path.is_dir():
            video_file = path / "video_preprocessor_config.json"
            path = video_file if video_file.is_file() else path / "preprocessor_config.json"
        if not path.is_file():
            raise PreprocessConfigError(f"{path} not found: point at a Qwen2-VL checkpoint directory")
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))

    def frame_size(self, height: int, width: int, num_frames: int) -> tuple[int, int]:
        """The processor's output frame size for ``num_frames`` sampled frames of
        ``height`` x ``width`` (``Qwen2VLVideoProcessor.resize``)."""
        image = self.image
        factor = image.resize_factor
        max_pixels = image.max_pixels
        if self.cap_pixels_per_frame:
            total_pixels = int(self.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(
                min(max_pixels, total_pixels * image.temporal_patch_size // num_frames),
                int(image.min_pixels * 1.05),
            )
        bounded = ImageTransformConfig(
            patch_size=image.patch_size,
            merge_size=image.merge_size,
            temporal_patch_size=image.temporal_patch_size,
            min_pixels=image.min_pixels,
            max_pixels=max_pixels,
        )
        return smart_resize(height, width, bounded)

    def grid_thw(self, num_frames: int, out_height: int, out_width: int) -> tuple[int, int, int]:
        t = self.image.temporal_patch_size
        padded = num_frames + (-num_frames % t)
        return padded // t, out_height // self.image.patch_size, out_width // self.image.patch_size

    def tokens(self, num_frames: int, out_height: int, out_width: int) -> int:
        grid_t, grid_h, grid_w = self.grid_thw(num_frames, out_height, out_width)
        return grid_t * grid_h * grid_w // (self.image.merge_size**2)


def define_video_graph(config: VideoTransformConfig, device: Device) -> DataNode:
    """The graph, to be called inside ``with pipeline:``; returns the normalized frames."""
    image = config.image
    sizes = fn.external_source(name=RESIZE_INPUT, dtype=types.INT64, ndim=1, device="cpu")
    in_height, out_height, out_width = sizes[0], sizes[1], sizes[2]
    if device == "gpu":
        encoded = fn.external_source(name=VIDEO_INPUT, dtype=types.UINT8, ndim=1, device="cpu")
        frame_indices = fn.external_source(name=FRAME_INDICES_INPUT, dtype=types.INT32, ndim=1, device="cpu")
        # DALI 2 has the decoder as fn.decoders.video; DALI 1.x (the gpu image's dali backend
        # runs 1.51.2, which serializes this graph there) as fn.experimental.decoders.video, same
        # arguments. (2.4.0's stubs no longer list the experimental one.)
        video_decoder = getattr(fn.decoders, "video", None) or fn.experimental.decoders.video  # type: ignore[attr-defined]
        decoded = video_decoder(encoded, frames=frame_indices, device="mixed", name="decode_video")
    else:  # decoded by OpenCV as vLLM decodes (module docstring)
        decoded = fn.external_source(
            name=DECODED_FRAMES_INPUT, dtype=types.UINT8, ndim=4, layout="FHWC", device="cpu"
        )
    resized = pil_compatible_bicubic(decoded, in_height, out_height, out_width)
    return fn.crop_mirror_normalize(
        resized,
        dtype=types.FLOAT,
        output_layout="FCHW",
        mean=[m / image.rescale_factor for m in image.image_mean],
        std=[s / image.rescale_factor for s in image.image_std],
        name="normalize_video",
    )


def build_video_pipeline(
    config: VideoTransformConfig,
    device: Device = "cpu",
    max_batch_size: int = DEFAULT_VIDEO_BATCH_SIZE,
    num_threads: int = DEFAULT_NUM_THREADS,
) -> Pipeline:
    """An unbuilt pipeline (``device_id=None``: Triton's DALI backend sets it on the GPU)."""
    check_device(device)
    config.image.validate()
    return pipeline_of(lambda: (define_video_graph(config, device),), max_batch_size, num_threads)


def serialize_video_pipeline(
    config: VideoTransformConfig,
    device: Device = "cpu",
    max_batch_size: int = DEFAULT_VIDEO_BATCH_SIZE,
    num_threads: int = DEFAULT_NUM_THREADS,
) -> bytes:
    return serialized(build_video_pipeline(config, device, max_batch_size, num_threads))


def write_video_pipeline(
    out_path: str | Path,
    config: VideoTransformConfig,
    device: Device = "cpu",
    max_batch_size: int = DEFAULT_VIDEO_BATCH_SIZE,
) -> Path:
    """Write ``video.dali`` for a target; same inputs, same bytes."""
    return write_serialized(out_path, serialize_video_pipeline(config, device, max_batch_size))


__all__ = [
    "DEFAULT_VIDEO_BATCH_SIZE",
    "DECODED_FRAMES_INPUT",
    "FRAME_INDICES_INPUT",
    "RESIZE_INPUT",
    "VIDEO_INPUT",
    "VIDEO_OUTPUT",
    "VideoTransformConfig",
    "build_video_pipeline",
    "define_video_graph",
    "serialize_video_pipeline",
    "write_video_pipeline",
]

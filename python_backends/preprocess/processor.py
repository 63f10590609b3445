"""What every image preprocessor shares, without DALI: the checkpoint's transform config, Qwen2-VL's
``smart_resize`` and the processor's output. The torchvision path (the cpu target's) imports only
this; the DALI pipeline (``image_pipeline``, the gpu target's) builds on it too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# PIL's resampling id for bicubic; the only filter this pipeline reproduces.
PIL_BICUBIC = 3
_RGB_CHANNELS = 3


class PreprocessConfigError(ValueError):
    """A preprocessor_config.json this pipeline cannot reproduce; the message says why."""


@dataclass(frozen=True)
class ImageTransformConfig:
    """The parts of a Qwen2-VL ``preprocessor_config.json`` that define the image transform."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255

    @property
    def resize_factor(self) -> int:
        """Both output sides are multiples of this (one merged token = merge x merge patches)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one unfolded row (the processor's, and videos'): C * T * P * P."""
        return _RGB_CHANNELS * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def folded_patch_dim(self) -> int:
        """Length of one row of preprocessed images' ``pixel_values``: C * P * P (one temporal
        copy; the encoder repeats it T times, or folds its patch embedding to match)."""
        return _RGB_CHANNELS * self.patch_size * self.patch_size

    def validate(self) -> None:
        problems = []
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"):
            if int(getattr(self, name)) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.min_pixels > self.max_pixels:
            problems.append(f"min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")
        if len(self.image_mean) != _RGB_CHANNELS or len(self.image_std) != _RGB_CHANNELS:
            problems.append("image_mean and image_std need one value per RGB channel")
        if any(s <= 0 for s in self.image_std):
            problems.append(f"image_std must be positive, got {self.image_std}")
        if self.rescale_factor <= 0:
            problems.append(f"rescale_factor must be positive, got {self.rescale_factor}")
        if problems:
            raise PreprocessConfigError("; ".join(problems))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ImageTransformConfig:
        """Read a preprocessor_config.json's contents (hub or transformers-5 spelling)."""
        _reject_unsupported_steps(raw)
        size = raw.get("size") or {}
        defaults = cls()
        # The processor lets explicit min/max_pixels override size (its __init__ does so too).
        min_pixels = raw.get("min_pixels", size.get("shortest_edge", defaults.min_pixels))
        max_pixels = raw.get("max_pixels", size.get("longest_edge", defaults.max_pixels))
        config = cls(
            patch_size=int(raw.get("patch_size", defaults.patch_size)),
            merge_size=int(raw.get("merge_size", defaults.merge_size)),
            temporal_patch_size=int(raw.get("temporal_patch_size", defaults.temporal_patch_size)),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            image_mean=_three_floats(raw.get("image_mean", defaults.image_mean), "image_mean"),
            image_std=_three_floats(raw.get("image_std", defaults.image_std), "image_std"),
            rescale_factor=float(raw.get("rescale_factor", defaults.rescale_factor)),
        )
        config.validate()
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> ImageTransformConfig:
        """From a preprocessor_config.json, or a checkpoint directory that holds one."""
        path = Path(path)
        if path.is_dir():
            path = path / "preprocessor_config.json"
        if not path.is_file():
            raise PreprocessConfigError(f"{path} not found: point at a Qwen2-VL checkpoint directory")
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))


def _reject_unsupported_steps(raw: Mapping[str, Any]) -> None:
    # A checkpoint that turns a step off or picks another filter needs another pipeline;
    # silently producing different pixels would be worse than refusing.
    for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if raw.get(flag, True) is False:
            raise PreprocessConfigError(f"{flag}=false is not supported by the DALI pipeline")
    resample = raw.get("resample", PIL_BICUBIC)
    if resample != PIL_BICUBIC:
        raise PreprocessConfigError(f"resample={resample} is not supported; only bicubic (3) is")


def _three_floats(values: Any, name: str) -> tuple[float, float, float]:
    if isinstance(values, (int, float)):
        values = [values] * _RGB_CHANNELS
    values = [float(v) for v in values]
    if len(values) != _RGB_CHANNELS:
        raise PreprocessConfigError(f"{name} needs {_RGB_CHANNELS} values, got {values}")
    return values[0], values[1], values[2]


def smart_resize(height: int, width: int, config: ImageTransformConfig) -> tuple[int, int]:
    """Qwen2-VL's target size in plain Python: the reference the graph version must match.

    Same arithmetic as transformers' ``smart_resize`` (round half to even, float64), minus its
    aspect-ratio check, which the caller does with a clear error before decoding.
    """
    factor = config.resize_factor
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > config.max_pixels:
        beta = math.sqrt((height * width) / config.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class PreprocessedImages:
    """The processor's outputs for a batch, images in request order."""

    pixel_values: np.ndarray  # [sum(h*w), C*P*P] float32: folded, one temporal copy per row
    image_grid_thw: np.ndarray  # [num_images, 3] int64

    def patch_counts(self) -> list[int]:
        """Rows of ``pixel_values`` that belong to each image."""
        return [int(t * h * w) for t, h, w in self.image_grid_thw]

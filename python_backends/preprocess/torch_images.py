"""The ``cpu`` target's image preprocessing: PIL decode + torchvision resize, bit-exact with vLLM.

vLLM runs transformers' ``Qwen2VLImageProcessor`` (the torchvision backend) on PIL images. This
module runs the very same kernels on the very same pixels, minus the processor's generic
plumbing, so its numbers are equal bit for bit (tests/unit/test_torch_preprocess.py), and ~6x
cheaper than the DALI CPU pipeline, whose antialiased cubic resize dominates its cost (one core,
4 JPEGs of 512x512 to 1000x1000: 10.6 ms against DALI's 68 ms and the processor's 16 ms with
the same PIL decode):

1. decode: :func:`python_backends.request.images.decode_rgb`, the decode that ``llm`` uses
   (PIL, EXIF orientation applied, ``convert("RGB")``, header limits first). Every format that
   ``request/images.py`` accepts, GIF included.
2. resize: ``torchvision.transforms.v2.functional.resize(uint8 CHW, smart_resize(h, w),
   BICUBIC, antialias=True)``, the processor's call, hence its kernel whatever the CPU (uint8
   natively with AVX2 on x86, else float with clamp and round). We hand it the decoded HWC
   buffer as a channels-last CHW view, the layout the uint8 kernel works in, which skips the
   processor's contiguous copy (same bytes: tested).
3. normalize + patchify: the processor's fused rescale/normalize (``mean / rescale``,
   ``std / rescale`` in float32, then ``(x - mean) / std``: one subtraction and one true
   division per value, in float32, as ``tvF.normalize`` does), on the uint8 pixels already
   put in the patch layout, written straight into the batch's output array.

Output layout ("temporal fold"): an image's two temporal copies are identical, so each row of
``pixel_values`` holds one copy, ``C * P * P`` values laid out (c, p, p), rows merge block by
merge block as the processor orders them. :func:`python_backends.preprocess.images.unfold_temporal`
gives back the processor's ``C * T * P * P`` rows.

Threads: torch's intra-op thread count is process-wide, so nothing is set at import. Each
:meth:`TorchImagePreprocessor.preprocess` call runs with ``num_threads`` intra-op threads (1 by
default) and restores the previous count after; switching costs ~0.15 ms a call, so a process
that runs only this preprocessor (the ``preprocess`` model's stub) sets the count once with
:func:`set_process_threads` and no call switches. Measured on the 4-image set (512x512,
640x480, 1024x768, 1000x1000 JPEGs): one thread is all a 1-core CPU set can use; on 2 free
cores, 2 threads cut the normalize step from 2.3 to 1.3 ms and left decode (PIL, single
threaded) and the resize (3.1 ms) as they were, ~10% of the call for a second core's time.

Plain Python: no Triton import. Stateless apart from its configuration: safe to share.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as tvF

from python_backends.errors import invalid_arg
from python_backends.preprocess.processor import ImageTransformConfig, PreprocessedImages, smart_resize
from python_backends.request.images import ImageLimits, check_image_header, decode_rgb, image_bytes

DEFAULT_NUM_THREADS = 1


@dataclass(frozen=True)
class FusedNormalization:
    """Per-channel ``mean / rescale_factor`` and ``std / rescale_factor`` as float32 tensors.

    Computed with the processor's own expression (``_fuse_mean_std_and_rescale_factor``:
    ``torch.tensor(values) * (1.0 / rescale_factor)``), so the constants are the same float32
    bits and ``(x - mean) / std`` rounds the same way.
    """

    mean: torch.Tensor  # [C] float32
    std: torch.Tensor  # [C] float32

    @classmethod
    def of(cls, config: ImageTransformConfig) -> FusedNormalization:
        scale = 1.0 / config.rescale_factor
        mean = torch.tensor(list(config.image_mean), dtype=torch.float32) * scale
        std = torch.tensor(list(config.image_std), dtype=torch.float32) * scale
        return cls(mean=mean, std=std)


@dataclass
class StepTimes:
    """Seconds spent in each step of one :meth:`TorchImagePreprocessor.preprocess_timed` call,
    per image and summed (for benchmarks; ``perf_counter`` around each step)."""

    images: int
    per_image: list[dict[str, float]] = field(init=False)

    def __post_init__(self) -> None:
        self.per_image = [{"decode_s": 0.0, "resize_s": 0.0, "normalize_s": 0.0} for _ in range(self.images)]

    def add(self, index: int, **seconds: float) -> None:
        for step, value in seconds.items():
            self.per_image[index][step] += value

    @property
    def decode_s(self) -> float:
        """Header check + PIL decode + EXIF transpose + ``convert("RGB")``."""
        return sum(t["decode_s"] for t in self.per_image)

    @property
    def resize_s(self) -> float:
        """``smart_resize`` + torchvision antialiased bicubic."""
        return sum(t["resize_s"] for t in self.per_image)

    @property
    def normalize_s(self) -> float:
        """Fused normalize into the folded patch layout."""
        return sum(t["normalize_s"] for t in self.per_image)

    @property
    def total_s(self) -> float:
        return self.decode_s + self.resize_s + self.normalize_s


# ---------------------------------------------------------------------------------------------
# The steps, one function each, so a benchmark can time them apart.
# ---------------------------------------------------------------------------------------------


def decode_image(item: bytes, index: int, limits: ImageLimits) -> Image.Image:
    """Step 1: raw or base64 bytes -> fully decoded RGB PIL image, as ``llm`` decodes them.

    Bad input raises :class:`EpdError` (``INVALID_ARG``) naming ``image[index]``."""
    return decode_rgb(image_bytes(item, index), index, limits)


def image_tensor(image: Image.Image) -> torch.Tensor:
    """The RGB pixels as a uint8 ``[C, H, W]`` tensor over PIL's HWC buffer (channels-last
    strides, no copy beyond the one numpy makes of PIL's pixels).

    The buffer is read-only and the resize never writes to its input; torch's warning about
    read-only arrays is silenced for this one conversion."""
    pixels = np.asarray(image)
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8:
        raise ValueError(f"expected an 8-bit RGB image, got {image.mode} {pixels.shape}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        hwc = torch.from_numpy(pixels)
    return hwc.permute(2, 0, 1)


def target_size(height: int, width: int, config: ImageTransformConfig) -> tuple[int, int]:
    """Qwen2-VL's ``smart_resize`` target (height, width) for a decoded image."""
    return smart_resize(height, width, config)


def resize_image(pixels: torch.Tensor, config: ImageTransformConfig) -> torch.Tensor:
    """Step 2: uint8 ``[C, H, W]`` -> uint8 ``[C, h, w]`` at :func:`target_size`, with the
    processor's call (torchvision antialiased bicubic; an image already at its target size is
    returned as it is, as torchvision does)."""
    height, width = int(pixels.shape[-2]), int(pixels.shape[-1])
    out_h, out_w = target_size(height, width, config)
    return tvF.resize(pixels, [out_h, out_w], interpolation=InterpolationMode.BICUBIC, antialias=True)


def folded_patch_count(height: int, width: int, config: ImageTransformConfig) -> int:
    """Rows of ``pixel_values`` for a resized image of ``height`` x ``width``."""
    return (height // config.patch_size) * (width // config.patch_size)


def normalize_folded(
    resized: torch.Tensor,
    config: ImageTransformConfig,
    norm: FusedNormalization,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Step 3: uint8 ``[C, h, w]`` -> float32 ``[grid_h * grid_w, C * P * P]`` (folded rows).

    The uint8 frame is put in the processor's patch order (merge blocks row by row, the m x m
    patches of a block adjacent, each patch (c, p, p)), then ``float32(x) - mean`` is written
    into ``out`` (a slice of the batch's array) and divided by ``std`` in place: the same
    float32 subtraction and division as ``tvF.normalize``. The layout changes where each value
    is stored, never how it is computed. Two float passes instead of the processor's four
    (convert, subtract, divide, then the patch copy with its temporal repeat)."""
    p, m = config.patch_size, config.merge_size
    channels, height, width = (int(v) for v in resized.shape)
    grid_h, grid_w = height // p, width // p
    if grid_h * p != height or grid_w * p != width or grid_h % m or grid_w % m:
        raise ValueError(f"{height}x{width} is not a multiple of patch_size * merge_size = {p * m}")
    if out is None:
        out = np.empty((grid_h * grid_w, channels * p * p), dtype=np.float32)
    if out.shape != (grid_h * grid_w, channels * p * p) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 [{grid_h * grid_w}, {channels * p * p}]")
    blocks = resized.reshape(channels, grid_h // m, m, p, grid_w // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    ordered = blocks.contiguous()  # the reordering copy in uint8: a quarter of float32's bytes
    target = torch.from_numpy(out).view(grid_h // m, grid_w // m, m, m, channels, p, p)
    # float32(x) - mean, written straight into the output, then / std in place.
    torch.sub(ordered, norm.mean.view(channels, 1, 1), out=target)
    target.div_(norm.std.view(channels, 1, 1))
    return out


# ---------------------------------------------------------------------------------------------
# The preprocessor
# ---------------------------------------------------------------------------------------------


def set_process_threads(count: int = DEFAULT_NUM_THREADS) -> None:
    """torch's intra-op thread count for the whole process, for a process that runs only this
    preprocessor (a model stub): per-call switches in :func:`intra_op_threads` then cost nothing."""
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


@contextlib.contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` for a block, then restored (it is
    process-wide; nothing here sets it for good)."""
    before = torch.get_num_threads()
    if before == count:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class TorchImagePreprocessor:
    """Encoded images -> the processor's ``pixel_values`` (folded) and ``image_grid_thw``.

    Same surface as :class:`python_backends.preprocess.images.DaliImagePreprocessor`:
    ``preprocess(items)``, ``limits``, ``validate(item, index)``. All-or-nothing per call: the
    first bad image (headers of all images are checked before any pixel is decoded) fails the
    call with an ``INVALID_ARG`` :class:`EpdError` naming ``image[i]``."""

    def __init__(
        self,
        config: ImageTransformConfig,
        limits: ImageLimits | None = None,
        num_threads: int = DEFAULT_NUM_THREADS,
    ) -> None:
        if num_threads <= 0:
            raise ValueError("num_threads must be positive")
        config.validate()
        self._config = config
        self._limits = limits or ImageLimits()
        self._num_threads = num_threads
        self._norm = FusedNormalization.of(config)

    @classmethod
    def for_config(
        cls, config: ImageTransformConfig, limits: ImageLimits | None = None, num_threads: int = DEFAULT_NUM_THREADS
    ) -> TorchImagePreprocessor:
        """Same as the constructor; mirrors ``DaliImagePreprocessor.for_config`` for callers
        (tests, benchmarks) that pick a backend by name."""
        return cls(config, limits, num_threads)

    @property
    def limits(self) -> ImageLimits:
        return self._limits

    @property
    def config(self) -> ImageTransformConfig:
        return self._config

    def validate(self, item: bytes, index: int) -> bytes:
        """The encoded bytes of ``item`` if its header passes the limits; else
        :class:`EpdError`. Header only (PIL's lazy open): bombs cost nothing."""
        data = image_bytes(item, index)
        check_image_header(data, index, self._limits)
        return data

    def preprocess(self, items: Sequence[bytes]) -> PreprocessedImages:
        """Decode + transform every image; all-or-nothing for the call."""
        return self.preprocess_timed(items)[0]

    def preprocess_timed(self, items: Sequence[bytes]) -> tuple[PreprocessedImages, StepTimes]:
        """:meth:`preprocess` and the seconds each step took (decode, resize, normalize).

        Each image is decoded and resized before the next is decoded, so at most one full-size
        decoded image is alive at a time; the small resized frames wait for the output array,
        which is allocated once its size is known and filled in place."""
        self._check_count(len(items))
        encoded = [self.validate(item, i) for i, item in enumerate(items)]  # every header first
        times = StepTimes(images=len(encoded))
        with intra_op_threads(self._num_threads):
            resized = [self._decode_and_resize(data, i, times) for i, data in enumerate(encoded)]
            counts = [folded_patch_count(int(r.shape[-2]), int(r.shape[-1]), self._config) for r in resized]
            pixel_values = np.empty((sum(counts), self._config.folded_patch_dim), dtype=np.float32)
            bounds = np.cumsum([0, *counts]).tolist()
            for i, frame in enumerate(resized):
                started = time.perf_counter()
                normalize_folded(frame, self._config, self._norm, out=pixel_values[bounds[i] : bounds[i + 1]])
                times.add(i, normalize_s=time.perf_counter() - started)
        p = self._config.patch_size
        grid = np.array([[1, int(r.shape[-2]) // p, int(r.shape[-1]) // p] for r in resized], dtype=np.int64)
        return PreprocessedImages(pixel_values=pixel_values, image_grid_thw=grid.reshape(-1, 3)), times

    def _decode_and_resize(self, data: bytes, index: int, times: StepTimes) -> torch.Tensor:
        started = time.perf_counter()
        image = decode_rgb(data, index, self._limits)
        decoded_at = time.perf_counter()
        frame = resize_image(image_tensor(image), self._config)
        times.add(index, decode_s=decoded_at - started, resize_s=time.perf_counter() - decoded_at)
        return frame

    def _check_count(self, count: int) -> None:
        if count == 0:
            raise invalid_arg("no image given")
        if count > self._limits.max_images:
            raise invalid_arg(f"{count} images given, above the limit of {self._limits.max_images} (max_images)")

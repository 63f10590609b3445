"""CPU runner of the serialized DALI image pipeline (``python_backends/preprocess/image_pipeline.py``).

This is the ``cpu`` target's ``preprocess`` with ``image_backend: dali``: the pipeline
definition that Triton's DALI backend runs on a GPU, serialized for the CPU and deserialized
here with ``device_id=None``. It takes
a batch of encoded images (raw bytes or base64, as clients send them), rejects bad ones with
an :class:`EpdError` (``INVALID_ARG``) before any pixel is decoded where the header allows,
and returns what transformers' ``Qwen2VLImageProcessor`` returns, temporally folded:
``pixel_values`` ``[sum(h*w), C*P*P]`` float32 (one temporal copy per row: an image's T copies
are identical; :func:`python_backends.encode.vit_onnx.unfold_temporal` gives back the processor's ``C*T*P*P`` rows) and
``image_grid_thw`` ``[num_images, 3]`` int64. The patch layout is made here in numpy when the
serialized graph stops at the normalized frame (the CPU default, see
``python_backends/preprocess/image_pipeline.py``).

The ``cpu`` target's default backend is
:class:`python_backends.preprocess.torch_images.TorchImagePreprocessor` (bit-exact with the
processor, ~6x cheaper on one core); this runner keeps the ``gpu`` target's pipeline definition
tested on the CPU. Both share :class:`PreprocessedImages`.

Plain Python: no Triton import. One :class:`DaliImagePreprocessor` per model instance; it is
not thread-safe (a DALI pipeline runs one batch at a time).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from python_backends.errors import EpdError, ErrorCode, invalid_arg
from python_backends.preprocess.image_pipeline import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_NUM_THREADS,
    INPUT_NAME,
    serialize_pipeline,
)
from python_backends.preprocess.processor import ImageTransformConfig, PreprocessedImages
from python_backends.preprocess.runner import DaliCpuRunner
from python_backends.request.images import ImageLimits, check_image_header, image_bytes

LOGGER = logging.getLogger(__name__)

# What DALI's CPU and nvJPEG-based decoders read. GIF is accepted by media.py for the colocated
# path but DALI cannot decode it, so this path names it instead of failing inside DALI.
_DALI_FORMAT_MAGIC: tuple[tuple[str, bytes], ...] = (
    ("JPEG", b"\xff\xd8\xff"),
    ("PNG", b"\x89PNG\r\n\x1a\n"),
    ("BMP", b"BM"),
    ("TIFF", b"II*\x00"),
    ("TIFF", b"MM\x00*"),
)
DALI_FORMATS = "JPEG, PNG, WebP, BMP, TIFF"


def patchify(frame: np.ndarray, config: ImageTransformConfig) -> np.ndarray:
    """``[C, H, W]`` -> ``[grid_h * grid_w, C * P * P]``, the processor's row order (merge
    blocks row by row, the m x m patches of a block adjacent), each row one temporal copy laid
    out (c, p, p): the folded layout (:func:`python_backends.encode.vit_onnx.unfold_temporal` repeats it T times)."""
    p, m = config.patch_size, config.merge_size
    channels, height, width = frame.shape
    grid_h, grid_w = height // p, width // p
    blocks = frame.reshape(channels, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    return blocks.reshape(grid_h * grid_w, channels * p * p)  # one copy, out of DALI's buffer


def _dali_format(data: bytes) -> str | None:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    for name, magic in _DALI_FORMAT_MAGIC:
        if data.startswith(magic):
            return name
    return None


def validate_encoded_image(item: bytes, index: int, limits: ImageLimits) -> bytes:
    """The encoded bytes of ``item`` if DALI may decode them; else :class:`EpdError`.

    Reads only the header (PIL's lazy open): size limits reject decompression bombs in
    bounded memory. Corrupt pixel data past the header is caught when DALI decodes.
    Callers on the GPU target (the BLS in front of the DALI backend) use this too.
    """
    data = image_bytes(item, index)  # empty, non-image and base64 handling
    check_image_header(data, index, limits)
    if _dali_format(data) is None:
        raise invalid_arg(f"image[{index}]: format not supported here; send one of {DALI_FORMATS}")
    return data


class DaliImagePreprocessor(DaliCpuRunner):
    """Runs the serialized pipeline on the CPU in batches of at most ``max_batch_size``."""

    def __init__(
        self,
        serialized_pipeline: bytes,
        config: ImageTransformConfig,
        limits: ImageLimits | None = None,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        num_threads: int = DEFAULT_NUM_THREADS,
    ) -> None:
        """``config`` must be the one the pipeline was serialized from (patch sizes)."""
        self._config = config
        self._limits = limits or ImageLimits()
        super().__init__(serialized_pipeline, max_batch_size, num_threads)

    @classmethod
    def for_config(
        cls,
        config: ImageTransformConfig,
        limits: ImageLimits | None = None,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        num_threads: int = DEFAULT_NUM_THREADS,
    ) -> DaliImagePreprocessor:
        """Serialize the CPU pipeline in process (tests, benchmarks, no model repository)."""
        serialized = serialize_pipeline(config, "cpu", max_batch_size=max_batch_size)
        return cls(serialized, config, limits, max_batch_size, num_threads)

    @property
    def limits(self) -> ImageLimits:
        return self._limits

    def validate(self, item: bytes, index: int) -> bytes:
        """:func:`validate_encoded_image` with this preprocessor's limits (header only)."""
        return validate_encoded_image(item, index, self._limits)

    def preprocess(self, items: Sequence[bytes]) -> PreprocessedImages:
        """Validate, then decode + transform every image; all-or-nothing for the batch."""
        if len(items) == 0:
            raise invalid_arg("no image given")
        if len(items) > self._limits.max_images:
            raise invalid_arg(
                f"{len(items)} images given, above the limit of {self._limits.max_images} (max_images)"
            )
        encoded = [validate_encoded_image(item, i, self._limits) for i, item in enumerate(items)]
        pixel_chunks: list[np.ndarray] = []
        grids: list[np.ndarray] = []
        for start, chunk in self._chunks(encoded):
            pixels, grid = self._run_chunk(list(chunk), first_index=start)
            pixel_chunks.append(pixels)
            grids.extend(grid)
        pixel_values = pixel_chunks[0] if len(pixel_chunks) == 1 else np.concatenate(pixel_chunks)
        return PreprocessedImages(pixel_values=pixel_values, image_grid_thw=np.stack(grids))

    def _run_chunk(self, chunk: list[bytes], first_index: int) -> tuple[np.ndarray, list[np.ndarray]]:
        try:
            return self._run(chunk)
        except RuntimeError:
            # DALI fails the whole batch; a fresh pipeline finds which image, one by one.
            self._rebuild()
            bad_index = self._find_undecodable(chunk)
            if bad_index is None:
                LOGGER.exception("DALI failed on a batch whose images decode one by one")
                raise EpdError("image preprocessing failed", ErrorCode.INTERNAL) from None
            raise invalid_arg(
                f"image[{first_index + bad_index}] cannot be decoded: corrupt or truncated data"
            ) from None

    def _run(self, chunk: list[bytes]) -> tuple[np.ndarray, list[np.ndarray]]:
        pixel_list, grid_list = self._run_feeds({INPUT_NAME: [np.frombuffer(data, dtype=np.uint8) for data in chunk]})
        # Copy out of DALI's buffers (the next run reuses them): patchify and concatenate copy.
        samples = [np.asarray(pixel_list[i]) for i in range(len(chunk))]
        if samples[0].ndim == 3:  # the graph stopped at the normalized [C, H, W] frame
            samples = [patchify(frame, self._config) for frame in samples]  # new arrays
        elif len(samples) == 1:
            samples = [samples[0].copy()]
        pixels = samples[0] if len(samples) == 1 else np.concatenate(samples)
        grids = [np.array(grid_list[i], dtype=np.int64) for i in range(len(chunk))]
        return pixels, grids

    def _find_undecodable(self, chunk: list[bytes]) -> int | None:
        for index, data in enumerate(chunk):
            try:
                self._run([data])
            except RuntimeError:
                self._rebuild()
                return index
        return None

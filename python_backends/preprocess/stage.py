"""Request-level logic of the ``preprocess`` python model (the ``cpu`` target's model.py).

The ``cpu`` target's ``preprocess`` is not batched (:class:`RequestPreprocess`): each request
brings its own 0..N encoded images (``image`` BYTES ``[n]``, raw or base64, as ``llm`` takes
them), all preprocessed in one call, all or nothing (an error names ``image[i]``):

- ``image`` BYTES ``[n]`` (absent or ``[0]``: no image) -> ``pixel_values`` float32
  ``[sum(patches), C*P*P]`` (folded: one temporal copy per row; every image's rows concatenated
  in order, so images of different sizes share a request) + ``image_grid_thw`` int64 ``[n, 3]``.

:class:`PreprocessStage` serves the interface of Triton's DALI backend (the ``gpu`` target's
``preprocess``, dynamically batched), which the same model.py takes when its config batches
(tests/server/test_gpu_topology.py runs the gpu topology on the CPU that way): Triton's dynamic
batcher hands a list of requests per ``execute``, each with one image per row of its batch
dimension (uint8 ``[b, bytes]``); it turns such a list into as few runs as possible and back
into one result per request. A bad request fails alone: its slot holds an :class:`EpdError`
and the others are served. Images of one such request must share a grid (a tensor is not
ragged).

Plain Python: no Triton import. The ``model.py`` files call these from ``execute`` (one call at a
time per model instance); ``encode/stage.py`` is the ``vit_encoder`` side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, TypeVar

import numpy as np

from python_backends.errors import EpdError, invalid_arg
from python_backends.preprocess.processor import PreprocessedImages
from python_backends.request.images import ImageLimits

T = TypeVar("T")
Result: TypeAlias = T | EpdError


def encoded_images(array: np.ndarray) -> list[bytes]:
    """One encoded image per row of a request's ``image`` tensor (uint8 ``[b, bytes]``)."""
    if array.dtype != np.uint8:
        raise invalid_arg(f"image must be uint8 (the encoded file's bytes), got {array.dtype}")
    if array.ndim == 1:
        array = array[None]
    if array.ndim != 2:
        raise invalid_arg(f"image must have shape [images, bytes], got {list(array.shape)}")
    if array.shape[0] == 0:
        raise invalid_arg("no image given")
    return [row.tobytes() for row in array]


@dataclass(frozen=True)
class PixelBatch:
    """One request's ``preprocess`` output."""

    pixel_values: np.ndarray  # [b, patches, patch_dim] float32
    image_grid_thw: np.ndarray  # [b, 3] int64


def _one_grid(image_grid_thw: np.ndarray) -> None:
    if len({tuple(row) for row in image_grid_thw.tolist()}) > 1:
        grids = ", ".join("x".join(str(v) for v in row) for row in image_grid_thw.tolist())
        raise invalid_arg(
            f"the images of one request must have the same grid (t x h x w), got {grids}; "
            "send images of different sizes as separate requests"
        )


class ImagePreprocessor(Protocol):
    """What :class:`PreprocessStage` needs (``torch_images.TorchImagePreprocessor``, the cpu
    default, or ``images.DaliImagePreprocessor``)."""

    @property
    def limits(self) -> ImageLimits: ...

    def validate(self, item: bytes, index: int) -> bytes:
        """The encoded bytes if the header passes this preprocessor's checks (its limits, and
        the formats it decodes); else :class:`EpdError`. Header only."""
        ...

    def preprocess(self, items: Sequence[bytes]) -> PreprocessedImages: ...


def request_images(array: np.ndarray | None, max_images: int) -> list[bytes]:
    """One request's ``image`` tensor (BYTES ``[n]``; absent or ``[0]``: no image) as the encoded
    items, at most ``max_images`` of them. Each item is checked by the preprocessor (raw bytes or
    base64, header limits)."""
    if array is None:
        return []
    if array.dtype != np.object_:
        raise invalid_arg(f"image must be BYTES (encoded images, raw or base64), got {array.dtype}")
    items = array.reshape(-1)
    if len(items) > max_images:
        raise invalid_arg(
            f"{len(items)} images in one request, above the limit of {max_images} (max_images_per_request)"
        )
    return [bytes(item) if isinstance(item, (bytes, np.bytes_)) else b"" for item in items]


class RequestPreprocess:
    """The ``cpu`` target's ``preprocess`` (not batched): every image of one request in one
    preprocessor call, rows concatenated; no image gives empty outputs."""

    def __init__(self, preprocessor: ImagePreprocessor, patch_width: int) -> None:
        """``patch_width``: the width of a folded row (``image_patch_dim``), for no image."""
        self._preprocessor = preprocessor
        self._patch_width = patch_width

    def run_tensors(self, tensors: Sequence[np.ndarray | None]) -> list[Result[PreprocessedImages]]:
        """One result per request (its ``image`` tensor, or None when absent), in order."""
        results: list[Result[PreprocessedImages]] = []
        for tensor in tensors:
            try:
                results.append(self.run(request_images(tensor, self._preprocessor.limits.max_images)))
            except EpdError as exc:
                results.append(exc)
        return results

    def run(self, images: Sequence[bytes]) -> PreprocessedImages:
        """The request's pixels and grids; all or nothing (:class:`EpdError` names ``image[i]``)."""
        if not images:
            return PreprocessedImages(
                pixel_values=np.zeros((0, self._patch_width), dtype=np.float32),
                image_grid_thw=np.zeros((0, 3), dtype=np.int64),
            )
        return self._preprocessor.preprocess(images)


class PreprocessStage:
    """The DALI backend's interface (batched, one image per row): all images of a list of
    requests through the preprocessor, in as few runs as allowed."""

    def __init__(self, preprocessor: ImagePreprocessor) -> None:
        # limits.max_images caps the images of one preprocess() call (the model sets it to
        # its max_batch_size, which is also the most images Triton puts in one execute).
        self._preprocessor = preprocessor

    def run_tensors(self, tensors: Sequence[np.ndarray | None]) -> list[Result[PixelBatch]]:
        """:meth:`run` on each request's ``image`` tensor (uint8 ``[b, bytes]``)."""
        parsed: list[Result[list[bytes]]] = []
        for tensor in tensors:
            try:
                if tensor is None:
                    raise invalid_arg("the image input is required")
                parsed.append(encoded_images(tensor))
            except EpdError as exc:
                parsed.append(exc)
        ok = [slot for slot, item in enumerate(parsed) if not isinstance(item, EpdError)]
        done = iter(self.run([parsed[slot] for slot in ok]))  # type: ignore[misc]
        return [item if isinstance(item, EpdError) else next(done) for item in parsed]

    def run(self, requests: Sequence[Sequence[bytes]]) -> list[Result[PixelBatch]]:
        """One result per request, in order: its images' pixels, or its error."""
        results: list[Result[PixelBatch] | None] = [None] * len(requests)
        valid: list[int] = []
        for slot, images in enumerate(requests):
            try:
                self._check(images)
                valid.append(slot)
            except EpdError as exc:
                results[slot] = exc
        for group in self._groups(valid, requests):
            self._run_group(group, requests, results)
        return filled(results)

    def _check(self, images: Sequence[bytes]) -> None:
        limits = self._preprocessor.limits
        if not images:
            raise invalid_arg("no image given")
        if len(images) > limits.max_images:
            raise invalid_arg(f"{len(images)} images in one request, above the limit of {limits.max_images}")
        for index, item in enumerate(images):  # header only: bombs cost nothing here
            self._preprocessor.validate(item, index)

    def _groups(self, slots: list[int], requests: Sequence[Sequence[bytes]]) -> list[list[int]]:
        """Consecutive requests whose images fit in one preprocess() call."""
        cap = self._preprocessor.limits.max_images
        groups: list[list[int]] = []
        count = 0
        for slot in slots:
            if not groups or count + len(requests[slot]) > cap:
                groups.append([])
                count = 0
            groups[-1].append(slot)
            count += len(requests[slot])
        return groups

    def _run_group(
        self, group: list[int], requests: Sequence[Sequence[bytes]], results: list[Result[PixelBatch] | None]
    ) -> None:
        images = [item for slot in group for item in requests[slot]]
        try:
            done = self._preprocessor.preprocess(images)
        except EpdError:
            # An image the header check let through cannot be decoded: run each request alone,
            # so that only its request fails, with the index within that request.
            for slot in group:
                results[slot] = self._alone(requests[slot])
            return
        row_bounds = np.cumsum([0, *done.patch_counts()])
        first = 0
        for slot in group:
            count = len(requests[slot])
            grid = done.image_grid_thw[first : first + count]
            rows = done.pixel_values[row_bounds[first] : row_bounds[first + count]]
            first += count
            try:
                _one_grid(grid)
            except EpdError as exc:
                results[slot] = exc
                continue
            results[slot] = PixelBatch(rows.reshape(count, -1, rows.shape[-1]), grid)

    def _alone(self, images: Sequence[bytes]) -> Result[PixelBatch]:
        try:
            done = self._preprocessor.preprocess(images)
            _one_grid(done.image_grid_thw)
        except EpdError as exc:
            return exc
        return PixelBatch(done.pixel_values.reshape(len(images), -1, done.pixel_values.shape[-1]), done.image_grid_thw)


def filled(results: list[Result[T] | None]) -> list[Result[T]]:
    if any(result is None for result in results):
        raise RuntimeError("a request was left without a result")  # a bug here, not bad input
    return [result for result in results if result is not None]

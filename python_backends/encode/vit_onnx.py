"""ONNX Runtime runner of the exported Qwen2-VL vision tower (``builders/encoder.py``).

The graph takes the data-dependent pieces as inputs, computed here in numpy from
``image_grid_thw`` (one implementation, shared with the exporter and its tests):

- ``pixel_values``   ``[num_patches, C*T*P*P]`` float32, images concatenated (the preprocess output)
- ``rotary_pos_ids`` ``[num_patches, 2]`` int64, (row, column) of each patch, merge-block order
- ``cu_seqlens``     ``[num_frames + 1]`` int64, patch offsets of each frame (attention blocks)

and returns ``image_embeds`` ``[num_patches / merge**2, hidden]``, which :class:`OnnxVisionEncoder`
splits per image. The same graph is what a TensorRT plan is built from on the GPU target.

Plain Python: no Triton import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from python_backends.errors import invalid_arg

INPUT_NAMES: tuple[str, str, str] = ("pixel_values", "rotary_pos_ids", "cu_seqlens")
OUTPUT_NAME = "image_embeds"
# ONNX metadata keys the exporter writes, so the runner needs no checkpoint config.
META_MERGE_SIZE = "spatial_merge_size"
META_PATCH_DIM = "patch_dim"
META_HIDDEN_SIZE = "hidden_size"


def _as_grid(image_grid_thw: np.ndarray | Sequence[Sequence[int]]) -> np.ndarray:
    grid = np.asarray(image_grid_thw, dtype=np.int64)
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] == 0:
        raise invalid_arg(f"image_grid_thw must have shape [num_images, 3], got {list(grid.shape)}")
    if (grid <= 0).any():
        raise invalid_arg("image_grid_thw values must be positive")
    return grid


def vision_position_ids(image_grid_thw: np.ndarray, merge_size: int) -> np.ndarray:
    """``[num_patches, 2]`` (row, column) per patch, in the merge-block order of ``pixel_values``.

    Same values as transformers' ``get_vision_position_ids``: each merge x merge block's
    patches are adjacent, rows of blocks left to right, top to bottom, repeated per frame.
    """
    per_image = []
    for t, h, w in _as_grid(image_grid_thw).tolist():
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block_shape = (h // merge_size, merge_size, w // merge_size, merge_size)
        rows = rows.reshape(block_shape).transpose(0, 2, 1, 3).reshape(-1)
        cols = cols.reshape(block_shape).transpose(0, 2, 1, 3).reshape(-1)
        per_image.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
    return np.concatenate(per_image).astype(np.int64)


def vision_cu_seqlens(image_grid_thw: np.ndarray) -> np.ndarray:
    """``[num_frames + 1]`` patch offsets: attention never crosses a frame (nor an image)."""
    grid = _as_grid(image_grid_thw)
    frame_lengths = np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])
    return np.concatenate([[0], np.cumsum(frame_lengths)]).astype(np.int64)


def patch_counts(image_grid_thw: np.ndarray) -> list[int]:
    return [int(t * h * w) for t, h, w in _as_grid(image_grid_thw)]


def embedding_counts(image_grid_thw: np.ndarray, merge_size: int) -> list[int]:
    """Rows of ``image_embeds`` per image: one per merge x merge block (the placeholder count)."""
    return [count // (merge_size * merge_size) for count in patch_counts(image_grid_thw)]


@dataclass(frozen=True)
class EncoderInputs:
    pixel_values: np.ndarray
    rotary_pos_ids: np.ndarray
    cu_seqlens: np.ndarray

    def as_feed(self) -> dict[str, np.ndarray]:
        return dict(zip(INPUT_NAMES, (self.pixel_values, self.rotary_pos_ids, self.cu_seqlens), strict=True))


def encoder_inputs(
    pixel_values: np.ndarray, image_grid_thw: np.ndarray, merge_size: int, patch_dim: int | None = None
) -> EncoderInputs:
    """The graph's inputs for a batch, after checking that pixels and grid agree."""
    grid = _as_grid(image_grid_thw)
    if ((grid[:, 1] % merge_size) != 0).any() or ((grid[:, 2] % merge_size) != 0).any():
        raise invalid_arg(f"image_grid_thw heights and widths must be multiples of {merge_size}")
    pixels = np.ascontiguousarray(pixel_values, dtype=np.float32)
    expected_rows = sum(patch_counts(grid))
    if pixels.ndim != 2 or pixels.shape[0] != expected_rows:
        raise invalid_arg(
            f"pixel_values has shape {list(pixels.shape)}, image_grid_thw needs {expected_rows} rows"
        )
    if patch_dim is not None and pixels.shape[1] != patch_dim:
        raise invalid_arg(f"pixel_values rows have {pixels.shape[1]} values, the encoder takes {patch_dim}")
    return EncoderInputs(pixels, vision_position_ids(grid, merge_size), vision_cu_seqlens(grid))


def group_images_by_patches(image_grid_thw: np.ndarray, max_patches_per_run: int) -> list[slice]:
    """Consecutive image ranges of at most ``max_patches_per_run`` patches (an image larger than
    the budget runs alone). Attention over a packed call costs (sum of patches)^2 although only
    the diagonal blocks are used, so large batches run in several calls."""
    groups: list[slice] = []
    start, total = 0, 0
    for index, count in enumerate(patch_counts(image_grid_thw)):
        if index > start and total + count > max_patches_per_run:
            groups.append(slice(start, index))
            start, total = index, 0
        total += count
    groups.append(slice(start, len(image_grid_thw)))
    return groups


class OnnxVisionEncoder:
    """One ONNX Runtime session; ``encode`` may be called from one thread at a time per
    instance (ORT sessions are thread-safe, but the Triton model instance is the unit here)."""

    # Packing beyond this costs more in masked attention than it saves in per-call overhead on
    # CPU (measured with the tiny model: 8 images in one call were 4x slower than one by one).
    DEFAULT_MAX_PATCHES_PER_RUN = 1024

    def __init__(
        self,
        onnx_path: str | Path,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        intra_op_threads: int = 0,
        max_patches_per_run: int = DEFAULT_MAX_PATCHES_PER_RUN,
    ) -> None:
        import onnxruntime as ort  # heavy import stays out of callers that only need the helpers

        if max_patches_per_run <= 0:
            raise ValueError(f"max_patches_per_run must be positive, got {max_patches_per_run}")
        self._max_patches_per_run = max_patches_per_run

        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads  # 0: ORT's default (all cores)
        self._session = ort.InferenceSession(str(onnx_path), sess_options=options, providers=list(providers))
        metadata = self._session.get_modelmeta().custom_metadata_map
        missing = [key for key in (META_MERGE_SIZE, META_PATCH_DIM, META_HIDDEN_SIZE) if key not in metadata]
        if missing:
            raise ValueError(f"{onnx_path} lacks metadata {missing}: export it with builders.encoder")
        self.merge_size = int(metadata[META_MERGE_SIZE])
        self.patch_dim = int(metadata[META_PATCH_DIM])
        self.hidden_size = int(metadata[META_HIDDEN_SIZE])

    def encode(self, pixel_values: np.ndarray, image_grid_thw: np.ndarray) -> list[np.ndarray]:
        """Embeddings per image, ``[tokens_i, hidden]`` float32, in ``image_grid_thw`` order."""
        embeds = self.encode_concatenated(pixel_values, image_grid_thw)
        bounds = np.cumsum(embedding_counts(image_grid_thw, self.merge_size))[:-1]
        return np.split(embeds, bounds)

    def encode_concatenated(self, pixel_values: np.ndarray, image_grid_thw: np.ndarray) -> np.ndarray:
        """``[sum(tokens_i), hidden]``: all images' embeddings in order, in as few calls as the
        patch budget allows."""
        inputs = encoder_inputs(pixel_values, image_grid_thw, self.merge_size, self.patch_dim)
        grid = np.asarray(image_grid_thw, dtype=np.int64)
        groups = group_images_by_patches(grid, self._max_patches_per_run)
        if len(groups) == 1:
            return self._run(inputs)
        row_bounds = np.cumsum([0, *patch_counts(grid)])
        outputs = []
        for group in groups:
            rows = slice(int(row_bounds[group.start]), int(row_bounds[group.stop]))
            part = EncoderInputs(
                inputs.pixel_values[rows],
                inputs.rotary_pos_ids[rows],
                vision_cu_seqlens(grid[group]),
            )
            outputs.append(self._run(part))
        return np.concatenate(outputs)

    def _run(self, inputs: EncoderInputs) -> np.ndarray:
        (embeds,) = self._session.run([OUTPUT_NAME], inputs.as_feed())
        return embeds

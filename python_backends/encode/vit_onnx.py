"""ONNX Runtime runner of the exported Qwen2-VL vision tower (``builders/encoder.py``).

The graph encodes ONE image (or one video) per call, so attention needs no mask:

- ``pixel_values``   ``[frames, patches, width]`` float32: the image's (or video's) patch rows,
  one frame after another (a video's grid ``t`` frames, an image's 1), merge-block order.
  ``width`` is ``C*T*P*P`` (the processor's rows) or ``C*P*P`` for *folded* rows, where an
  image's ``T`` temporal copies (equal by construction) are sent once.
- ``rotary_pos_ids`` ``[patches, 2]`` int64: (row, column) of each patch of one frame.

and returns ``image_embeds`` ``[frames * patches / merge**2, hidden]``. Attention within a
frame is all Qwen2-VL's vision tower does (its ``cu_seqlens`` are per frame), so a call per
image gives transformers' numbers, and the same image always goes through the same arithmetic
whatever else is being encoded: bit-identical embeddings on every encoder. Packing several
images into one call needs a block-diagonal mask whose cost grows with the square of the total
(docs/benchmarks/encode.md). The same graph is what the TensorRT plan is built from.

Plain Python: no Triton import.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from python_backends.errors import invalid_arg

INPUT_NAMES: tuple[str, str] = ("pixel_values", "rotary_pos_ids")
OUTPUT_NAME = "image_embeds"
# ONNX metadata keys the exporter writes, so the runner needs no checkpoint config.
META_MERGE_SIZE = "spatial_merge_size"
META_PATCH_DIM = "patch_dim"
META_HIDDEN_SIZE = "hidden_size"
META_TEMPORAL_PATCH_SIZE = "temporal_patch_size"
_CHANNELS = 3  # RGB: rows are laid out (channel, [temporal,] patch row, patch column)


def _as_grid(image_grid_thw: np.ndarray | Sequence[Sequence[int]]) -> np.ndarray:
    grid = np.asarray(image_grid_thw, dtype=np.int64)
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] == 0:
        raise invalid_arg(f"image_grid_thw must have shape [num_images, 3], got {list(grid.shape)}")
    if (grid <= 0).any():
        raise invalid_arg("image_grid_thw values must be positive")
    return grid


def frame_position_ids(height: int, width: int, merge_size: int) -> np.ndarray:
    """``[height * width, 2]`` (row, column) of each patch of one frame, in merge-block order.

    Same values as transformers' ``get_vision_position_ids`` for one frame: each merge x merge
    block's patches adjacent, rows of blocks left to right, top to bottom.
    """
    rows, cols = np.meshgrid(np.arange(height), np.arange(width), indexing="ij")
    block_shape = (height // merge_size, merge_size, width // merge_size, merge_size)
    rows = rows.reshape(block_shape).transpose(0, 2, 1, 3).reshape(-1)
    cols = cols.reshape(block_shape).transpose(0, 2, 1, 3).reshape(-1)
    return np.stack([rows, cols], axis=-1).astype(np.int64)


def vision_position_ids(image_grid_thw: np.ndarray, merge_size: int) -> np.ndarray:
    """``[num_patches, 2]`` for a batch of grids: each image's frames repeat its frame's ids."""
    return np.concatenate(
        [np.tile(frame_position_ids(h, w, merge_size), (t, 1)) for t, h, w in _as_grid(image_grid_thw).tolist()]
    )


def patch_counts(image_grid_thw: np.ndarray) -> list[int]:
    return [int(t * h * w) for t, h, w in _as_grid(image_grid_thw)]


def embedding_counts(image_grid_thw: np.ndarray, merge_size: int) -> list[int]:
    """Rows of ``image_embeds`` per image: one per merge x merge block (the placeholder count)."""
    return [count // (merge_size * merge_size) for count in patch_counts(image_grid_thw)]


def unfold_temporal(folded: np.ndarray, temporal_patch_size: int) -> np.ndarray:
    """Folded rows ``[n, C*P*P]`` -> the processor's rows ``[n, C*T*P*P]`` (each channel's
    ``P*P`` values repeated ``T`` times, as ``Qwen2VLImageProcessor`` repeats an image)."""
    rows, width = folded.shape
    per_channel = folded.reshape(rows, _CHANNELS, 1, width // _CHANNELS)
    return np.repeat(per_channel, temporal_patch_size, axis=2).reshape(rows, width * temporal_patch_size)


@dataclass(frozen=True)
class VisionShape:
    """What the exported graph takes: merge size, full and folded row widths, output width."""

    merge_size: int
    patch_dim: int
    temporal_patch_size: int
    hidden_size: int

    @property
    def folded_patch_dim(self) -> int:
        """Width of a folded row (one temporal copy of an image's patch)."""
        return self.patch_dim // self.temporal_patch_size

    def check_width(self, width: int) -> None:
        if width not in (self.patch_dim, self.folded_patch_dim):
            raise invalid_arg(
                f"pixel_values rows have {width} values; the encoder takes {self.patch_dim} "
                f"(C*T*P*P) or {self.folded_patch_dim} (folded: one temporal copy)"
            )


@dataclass(frozen=True)
class EncoderCall:
    """The graph's inputs for one image or video."""

    pixel_values: np.ndarray  # [frames, patches, width]
    rotary_pos_ids: np.ndarray  # [patches, 2]

    def as_feed(self) -> dict[str, np.ndarray]:
        return dict(zip(INPUT_NAMES, (self.pixel_values, self.rotary_pos_ids), strict=True))


def encoder_calls(pixel_values: np.ndarray, image_grid_thw: np.ndarray, shape: VisionShape) -> list[EncoderCall]:
    """One call per image of a batch (rows concatenated in grid order), after checking that
    pixels and grid agree."""
    grid = _as_grid(image_grid_thw)
    merge = shape.merge_size
    if ((grid[:, 1] % merge) != 0).any() or ((grid[:, 2] % merge) != 0).any():
        raise invalid_arg(f"image_grid_thw heights and widths must be multiples of {merge}")
    pixels = np.ascontiguousarray(pixel_values, dtype=np.float32)
    expected_rows = sum(patch_counts(grid))
    if pixels.ndim != 2 or pixels.shape[0] != expected_rows:
        raise invalid_arg(f"pixel_values has shape {list(pixels.shape)}, image_grid_thw needs {expected_rows} rows")
    shape.check_width(pixels.shape[1])
    calls, first = [], 0
    for t, h, w in grid.tolist():
        rows = pixels[first : first + t * h * w]
        calls.append(EncoderCall(rows.reshape(t, h * w, -1), frame_position_ids(h, w, merge)))
        first += t * h * w
    return calls


def threads_of_cpu_set(requested: int) -> int:
    """``requested``, or with 0 one thread per CPU this process may run on (ONNX Runtime's own
    default counts the machine's cores and oversubscribes a CPU set: docs/benchmarks/encode.md)."""
    return requested if requested > 0 else len(os.sched_getaffinity(0))


class VisionRunner:
    """What every runner of the graph shares: its shape (from the model's metadata), one call per
    image, and the calls of a batch side by side on ``_pool`` (None: one after another). A
    subclass sets ``shape`` and ``_pool`` and runs one call in :meth:`run`."""

    shape: VisionShape
    _pool: ThreadPoolExecutor | None = None

    @property
    def merge_size(self) -> int:
        return self.shape.merge_size

    @property
    def patch_dim(self) -> int:
        return self.shape.patch_dim

    @property
    def hidden_size(self) -> int:
        return self.shape.hidden_size

    def encode(self, pixel_values: np.ndarray, image_grid_thw: np.ndarray) -> list[np.ndarray]:
        """Embeddings per image, ``[tokens_i, hidden]`` float32, in ``image_grid_thw`` order."""
        return self.run_all(encoder_calls(pixel_values, image_grid_thw, self.shape))

    def run_all(self, calls: Sequence[EncoderCall]) -> list[np.ndarray]:
        """Each call's embeddings, in order, side by side where there is a pool."""
        if self._pool is None or len(calls) <= 1:
            return [self.run(call) for call in calls]
        return list(self._pool.map(self.run, calls))

    def encode_concatenated(self, pixel_values: np.ndarray, image_grid_thw: np.ndarray) -> np.ndarray:
        """``[sum(tokens_i), hidden]``: all images' embeddings in order."""
        return np.concatenate(self.encode(pixel_values, image_grid_thw))

    def run(self, call: EncoderCall) -> np.ndarray:
        raise NotImplementedError


def side_by_side(calls: int, name: str) -> ThreadPoolExecutor | None:
    """A pool for ``calls`` concurrent calls, or None for one at a time."""
    return ThreadPoolExecutor(calls, thread_name_prefix=name) if calls > 1 else None


class OnnxVisionEncoder(VisionRunner):
    """One ONNX Runtime session, each call on ONE thread, up to ``threads`` calls (images) at once.

    Why not ONNX Runtime's intra-op threads: MLAS splits a small matrix product differently with
    another thread count, so an image's embeddings would change (by ~1e-6) with the CPU set of
    the encoder that served it, and greedy tokens with them. One thread per call gives the same
    bits everywhere; parallelism comes from the images of a batch, run side by side
    (``session.run`` releases the GIL). ``encode`` may be called from one thread at a time.
    """

    def __init__(
        self, onnx_path: str | Path, providers: Sequence[str] = ("CPUExecutionProvider",), threads: int = 0
    ) -> None:
        import onnxruntime as ort  # heavy import stays out of callers that only need the helpers

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(str(onnx_path), sess_options=options, providers=list(providers))
        self._pool = side_by_side(threads_of_cpu_set(threads), "vit")
        metadata = self._session.get_modelmeta().custom_metadata_map
        keys = (META_MERGE_SIZE, META_PATCH_DIM, META_TEMPORAL_PATCH_SIZE, META_HIDDEN_SIZE)
        missing = [key for key in keys if key not in metadata]
        if missing:
            raise ValueError(f"{onnx_path} lacks metadata {missing}: export it with builders.encoder")
        self.shape = VisionShape(*(int(metadata[key]) for key in keys))

    def run(self, call: EncoderCall) -> np.ndarray:
        (embeds,) = self._session.run([OUTPUT_NAME], call.as_feed())
        return embeds

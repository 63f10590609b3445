"""Precomputed image embeddings as an alternative to encoded images (``llm``, ``ensemble``).

A client (or the ``ensemble``'s ``vit_encoder`` step) may send what the vision encoder
produced instead of the image itself:

- ``image_embeds``: FP32 ``[tokens, hidden]`` or ``[n, tokens, hidden]``; the leading
  dimensions are flattened, so the ``encode`` model's output ``[1, tokens, hidden]`` can be
  passed on as it is, and the embeddings of several images are concatenated (in image order)
  along the token axis.
- ``image_grid_thw``: INT64 ``[images, 3]`` (or ``[3]`` for one image): each image's
  (t, h, w) patch grid, which gives vLLM the placeholder count and rotary positions.

No rows in both (``image_embeds`` ``[1, 0, hidden]`` + ``image_grid_thw`` ``[0, 3]``, what the
``ensemble``'s encode steps give for a request without an image) is no image at all.

Validated before vLLM sees anything (vLLM trusts ``enable_mm_embeds`` inputs; a wrong shape
would fail inside the engine): the hidden size is the model's, every grid is positive and
divisible by the merge size, and the token count is exactly ``sum(t*h*w) / merge**2``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from python_backends import contract
from python_backends.errors import invalid_arg


@dataclass(frozen=True)
class EmbedsSpec:
    """What the serving model's LM expects (config.pbtxt parameters, from the encoder build)."""

    hidden_size: int
    merge_size: int = 2


@dataclass(frozen=True)
class ImageEmbedsInput:
    embeds: np.ndarray  # float32 [tokens, hidden], all images concatenated in order
    grid_thw: np.ndarray  # int64 [images, 3]

    @property
    def num_images(self) -> int:
        return int(self.grid_thw.shape[0])

    def multi_modal_data(self) -> dict[str, Any]:
        """vLLM's ``enable_mm_embeds`` form (as python_backends.engines.prompt builds it)."""
        import torch

        return {
            "image": {
                "image_embeds": torch.from_numpy(np.ascontiguousarray(self.embeds)),
                "image_grid_thw": torch.from_numpy(np.ascontiguousarray(self.grid_thw)),
            }
        }


def tokens_per_image(grid_thw: np.ndarray, merge_size: int) -> list[int]:
    return [int(t * h * w) // (merge_size * merge_size) for t, h, w in grid_thw.tolist()]


def parse_image_embeds(
    inputs: Mapping[str, np.ndarray], spec: EmbedsSpec | None, max_images: int
) -> ImageEmbedsInput | None:
    """The request's embeddings, or None when it sends none (or both with no rows). Raises
    INVALID_ARG errors."""
    embeds = inputs.get(contract.IMAGE_EMBEDS)
    grid = inputs.get(contract.IMAGE_GRID_THW)
    if embeds is None and grid is None:
        return None
    if spec is None:
        raise invalid_arg("this model does not take image_embeds / image_grid_thw; send 'image'")
    if embeds is None or grid is None:
        pair = (contract.IMAGE_EMBEDS, contract.IMAGE_GRID_THW)
        given, missing = pair if grid is None else pair[::-1]
        raise invalid_arg(f"input '{given}' needs '{missing}' too")
    if inputs.get(contract.IMAGE) is not None:
        raise invalid_arg("send either 'image' or 'image_embeds' + 'image_grid_thw', not both")

    if embeds.dtype != np.float32:
        raise invalid_arg(f"input 'image_embeds' must be FP32, got {embeds.dtype}")
    if embeds.ndim not in (2, 3):
        raise invalid_arg(
            f"input 'image_embeds' must be [tokens, hidden] or [n, tokens, hidden], got shape {list(embeds.shape)}"
        )
    if embeds.shape[-1] != spec.hidden_size:
        raise invalid_arg(
            f"image_embeds has hidden size {embeds.shape[-1]}, the model expects {spec.hidden_size}"
        )
    flat = embeds.reshape(-1, spec.hidden_size)

    if grid.dtype != np.int64:
        raise invalid_arg(f"input 'image_grid_thw' must be INT64, got {grid.dtype}")
    if grid.ndim == 1:
        grid = grid.reshape(1, -1)
    if grid.ndim != 2 or grid.shape[1] != 3:
        raise invalid_arg(f"input 'image_grid_thw' must be [images, 3], got shape {list(grid.shape)}")
    if grid.shape[0] == 0:
        if flat.shape[0] == 0:  # no image: what the ensemble's encode steps give for none
            return None
        raise invalid_arg(f"image_grid_thw has no rows (no image) but image_embeds has {flat.shape[0]} tokens")
    if grid.shape[0] > max_images:
        raise invalid_arg(
            f"request has {grid.shape[0]} images, above the limit of {max_images} (max_images)"
        )
    merge = spec.merge_size
    for i, (t, h, w) in enumerate(grid.tolist()):
        if t < 1 or h < 1 or w < 1:
            raise invalid_arg(f"image_grid_thw[{i}] = {[t, h, w]} must be positive")
        if h % merge or w % merge:
            raise invalid_arg(
                f"image_grid_thw[{i}] = {[t, h, w]}: h and w must be multiples of the merge size {merge}"
            )
    expected = sum(tokens_per_image(grid, merge))
    if flat.shape[0] != expected:
        raise invalid_arg(
            f"image_embeds has {flat.shape[0]} tokens but image_grid_thw {grid.tolist()} needs {expected} "
            f"(t*h*w/{merge * merge} per image)"
        )
    if not np.isfinite(flat).all():
        raise invalid_arg("image_embeds holds NaN or infinite values")
    return ImageEmbedsInput(embeds=flat, grid_thw=grid.astype(np.int64, copy=False))

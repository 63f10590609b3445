"""The digest an embedding carries across nodes (see docs/scale-out.md).

Who calls what: an ``encoder_<i>`` model asked for an embedding ``by_value`` (by a ``pd`` server
on another node) computes :func:`embedding_digest` over the entry it stored, and sends it with
the embedding; the ``pd`` server (``scaleout/remote.py``) computes it again over what arrived and
refuses the answer when they differ (the call then counts as a failed one and goes to another
encoder). It covers the dtype, shape, grid and every byte, so a truncated, reordered or altered
tensor, or one of another image's grid, never enters the PD node's store.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

PREFIX = "sha256:"


def embedding_digest(embeds: np.ndarray, grid_thw: Sequence[int]) -> str:
    """``sha256:<hex>`` of an embedding ``[tokens, hidden]`` and its ``(t, h, w)`` grid."""
    array = np.ascontiguousarray(embeds)
    header = f"epd-embedding-v1|{array.dtype.str}|{tuple(array.shape)}|{tuple(int(v) for v in grid_thw)}|"
    digest = hashlib.sha256(header.encode())
    digest.update(array.tobytes())
    return PREFIX + digest.hexdigest()


def by_value_answer(store: Any, reference: Any) -> tuple[np.ndarray, np.ndarray, str]:
    """What an encoder model answers ``by_value`` for an entry it holds under a lease
    (``reference``: ``[1, tokens, hidden]`` float32, ``[1, 3]`` grid, digest); the lease is
    released once the bytes are copied out."""
    try:
        embeds = store.resolve(reference)  # an owned host copy
    finally:
        store.release(reference)
    grid = reference.grid_thw
    if grid is None:
        raise ValueError("stored entry has no image grid")
    return embeds[None], np.array([grid], np.int64), embedding_digest(embeds, grid)

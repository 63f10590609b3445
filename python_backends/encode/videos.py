"""One video -> its embeddings, inside an ``encoder_<i>`` model (``cpu`` target).

Steps: the ``cpu`` target's video preprocessing (:class:`python_backends.preprocess.videos.DaliVideoPreprocessor`,
run from the repository's serialized ``preprocess/1/video.dali``: the container checks, vLLM's
frame sampler, OpenCV decode as vLLM's loader, the check of the decoded frames (``llm``'s own:
``checked_decode``), DALI resize + normalize, the temporal patch layout), then the same vision
tower as images (``vit_encoder``, reached by BLS; a video's grid has ``t`` = frames / temporal
patch size). The result is stored by the encoder like an image's
(:class:`python_backends.encode.cached.CachedEncoder`, modality ``video``).

Why the encoder runs the video pipeline itself instead of calling ``preprocess``: ``preprocess``
is Triton's DALI backend on the ``gpu`` target, with one input (``image``) and a dynamic batcher
over images; a video is one large, variable item that the encoder would only forward. The
pipeline is the same serialized artefact either way. The ``gpu`` target does not serve video on
``epd`` yet (its ``video.dali`` decodes with NVDEC inside Triton's DALI backend; not built, no GPU
here), so its ``epd`` and encoders take no video (``max_videos`` 0).

Plain Python: no Triton import.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np

from python_backends.encode.cached import EncodedImage
from python_backends.errors import EpdError, ErrorCode
from python_backends.preprocess.videos import DaliVideoPreprocessor

# pixel_values [patches, patch_dim], grid [1, 3] -> embeddings [1, tokens, hidden]
EncodePixels = Callable[[np.ndarray, np.ndarray], Awaitable[np.ndarray]]


class VideoEncode:
    """The ``encode_video`` function of a :class:`CachedEncoder`: one video a call, the DALI
    pipeline one video at a time (it is not thread-safe), off the event loop."""

    def __init__(self, preprocessor: DaliVideoPreprocessor, encode_pixels: EncodePixels) -> None:
        self._preprocessor = preprocessor
        self._encode_pixels = encode_pixels
        self._lock = asyncio.Lock()

    async def __call__(self, video: bytes) -> EncodedImage:
        async with self._lock:
            result = await asyncio.to_thread(self._preprocessor.preprocess, [video])
        grid = result.video_grid_thw.reshape(-1, 3)
        embeds = await self._encode_pixels(result.pixel_values_videos, grid)
        t, h, w = (int(v) for v in grid[0])
        flat = embeds.reshape(-1, embeds.shape[-1])
        merge = self._preprocessor.merge_size
        if flat.shape[0] != t * h * w // (merge * merge):
            raise EpdError(
                f"the vision encoder returned {flat.shape[0]} rows for a video grid {[t, h, w]}", ErrorCode.INTERNAL
            )
        return EncodedImage(flat, (t, h, w))

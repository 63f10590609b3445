"""One audio file -> its embeddings, inside an ``encoder_<i>`` model of an audio checkpoint.

Steps: FFmpeg (PyAV) decodes it to mono samples at the feature extractor's rate with the
request's limits (:class:`python_backends.request.audios.AudioInput`, the same decode ``llm``
uses), the repository's serialized DALI pipeline (``audio_encoder/1/audio.dali``) makes Whisper's
features on the CPU (both targets), and ``audio_encoder`` (reached by BLS: ONNX Runtime on cpu, a
TensorRT plan on gpu, whose embeddings stay in CUDA memory for the GPU store) embeds them. The
result is stored by the encoder like an image's (:class:`python_backends.encode.cached.CachedEncoder`,
modality ``audio``, no grid: its token count is the embeddings' row count, the reference's
placeholders).

Why the encoder decodes and makes the features itself instead of calling a ``preprocess`` model:
as for video (python_backends/encode/videos.py), a clip is one large, variable item the encoder
would only forward; the pipeline is the same serialized artefact either way.

Plain Python: no Triton import.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from python_backends.encode.cached import EncodedImage
from python_backends.errors import EpdError, ErrorCode
from python_backends.preprocess.audio import AudioFeatures, DaliAudioFeatures
from python_backends.request.audios import AudioInput, decode_audio

# features [1, mel bins, frames], lengths [1] -> (embeddings [1, padded tokens, hidden], tokens [1]):
# numpy arrays (cpu target) or torch CUDA tensors (gpu target: the TensorRT plan's outputs).
EmbedFeatures = Callable[[np.ndarray, np.ndarray], Awaitable[tuple[Any, Any]]]


class AudioEncode:
    """The ``encode_audio`` function of a :class:`CachedEncoder`: one clip a call, decoded and
    featurized off the event loop, the DALI pipeline one clip at a time (it is not thread-safe)."""

    def __init__(self, audio: AudioInput, features: DaliAudioFeatures, embed: EmbedFeatures) -> None:
        self._audio = audio
        self._features = features
        self._embed = embed
        self._lock = asyncio.Lock()

    async def __call__(self, data: bytes) -> EncodedImage:
        # Decoded before the lock: a bad file is refused without waiting for other clips' features.
        samples = await asyncio.to_thread(decode_audio, data, 0, self._audio.limits, self._audio.sampling_rate)
        async with self._lock:
            (clip,) = await asyncio.to_thread(self._features.features, [samples])
        return EncodedImage(await self.embeddings(clip), None)

    async def embeddings(self, clip: AudioFeatures) -> np.ndarray | Any:
        """The clip's ``[tokens, hidden]`` rows, contiguous (what the store takes): a numpy array,
        or a CUDA tensor on the device the encoder returned it on."""
        embeds, tokens = await self._embed(clip.features[None], np.array([clip.length], dtype=np.int64))
        count = int(tokens.reshape(-1)[0])  # numpy or torch alike (a CUDA scalar is copied to the host)
        if embeds.ndim != 3 or not 0 < count <= embeds.shape[1]:
            raise EpdError(
                f"the audio encoder returned {list(embeds.shape)} for a clip of {count} tokens", ErrorCode.INTERNAL
            )
        rows = embeds[0, :count]
        return np.ascontiguousarray(rows) if isinstance(rows, np.ndarray) else rows.contiguous()

"""The baseline of metadata-only forwarding (the article's audio experiment), on ``prefill``.

With request parameter ``forward_media`` = raw (measurement only: contract.FORWARD_MEDIA), ``epd``
sends each audio clip on to ``prefill`` with its reference, as a system does whose downstream
stage is not given the clip's structure: ``prefill`` decodes the clip again and re-extracts its
features (transformers' Whisper feature extractor, what vLLM's processor runs on a raw clip) to
learn the layout (its token count) that the reference already carries. The embeddings still come
from the store: only the work the reference saves is done again, and checked against it.

Plain Python: no Triton import.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from python_backends import contract
from python_backends.errors import EpdError, ErrorCode, invalid_arg
from python_backends.request.audios import AudioInput, audio_bytes, decode_audio
from python_backends.runtime.model_params import ModelParameters
from python_backends.store import Reference


def audio_tokens(feature_frames: int) -> int:
    """Qwen2-Audio's tokens for a clip of ``feature_frames`` (stride-2 convolution, 2x pooling)."""
    return ((feature_frames - 1) // 2 + 1 - 2) // 2 + 1


class ReprocessedAudio:
    def __init__(self, audio: AudioInput, preprocessor_config: Path) -> None:
        from transformers import WhisperFeatureExtractor

        self.audio = audio
        self.extractor = WhisperFeatureExtractor(**json.loads(preprocessor_config.read_text()))

    @classmethod
    def from_params(cls, params: ModelParameters) -> ReprocessedAudio | None:
        """None unless the server allows the experiment and the model takes audio."""
        audio = AudioInput.from_params(params)
        if audio is None or os.environ.get(contract.ALLOW_RAW_FORWARDING_ENV) != "1":
            return None
        return cls(audio, Path(params.string(contract.PREPROCESSOR_CONFIG)))

    def check(self, clips: Sequence[bytes], references: Sequence[Reference]) -> None:
        """Decode and re-extract every clip; its token count must be its reference's."""
        audio_refs = [ref for ref in references if ref.modality == "audio"]
        if len(clips) != len(audio_refs):
            raise invalid_arg(f"{len(clips)} forwarded clips for {len(audio_refs)} audio references")
        rate = self.audio.sampling_rate
        for index, (clip, ref) in enumerate(zip(clips, audio_refs, strict=True)):
            samples = decode_audio(audio_bytes(clip), index, self.audio.limits, rate)
            features = self.extractor(samples, sampling_rate=rate, padding="max_length", return_attention_mask=True)
            tokens = audio_tokens(int(features["attention_mask"].sum()))
            if tokens != ref.num_placeholders:
                raise EpdError(
                    f"audio[{index}]: re-extracted {tokens} tokens, the reference says {ref.num_placeholders}",
                    ErrorCode.INTERNAL,
                )


def reprocess_forwarded(
    clips: np.ndarray | None, reprocessed: ReprocessedAudio | None, references: Sequence[Reference]
) -> int:
    """prefill's ``audio`` input, if sent: decoded and re-extracted (INVALID_ARG unless the server
    allows the experiment); the bytes that crossed into prefill."""
    if clips is None:
        return 0
    if reprocessed is None:
        raise invalid_arg(f"prefill takes audio clips only when started with {contract.ALLOW_RAW_FORWARDING_ENV}=1")
    items = [bytes(clip) for clip in clips.reshape(-1)]
    reprocessed.check(items, references)
    return sum(len(item) for item in items)

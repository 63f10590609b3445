"""The baseline of metadata-only forwarding on prefill (issue 34, the article's experiment): a
forwarded clip is decoded and re-extracted there, and must come to its reference's token count."""

from __future__ import annotations

import numpy as np
import pytest

from bench.audio_clips import CLIP, wav
from builders.default_model import DEFAULT_AUDIO_MODEL_DIR, build_default_model
from python_backends.errors import EpdError, ErrorCode
from python_backends.pd.forwarded import ReprocessedAudio, audio_tokens, reprocess_forwarded
from python_backends.request.audios import AudioInput, AudioLimits
from python_backends.store import Reference


def reference(modality: str, tokens: int) -> Reference:
    return Reference(
        modality=modality, mm_hash="k" * 64, store_id="s", location="shm://x", key="k" * 64, generation=1,
        lease_id="", dtype="float32", shape=(tokens, 8), nbytes=tokens * 32, num_placeholders=tokens, grid_thw=None,
        tag="t",
    )  # fmt: skip


@pytest.fixture(scope="module")
def reprocessed() -> ReprocessedAudio:
    model_dir = build_default_model(DEFAULT_AUDIO_MODEL_DIR, recipe="qwen2-audio")
    return ReprocessedAudio(AudioInput(2, AudioLimits(), 16_000), model_dir / "preprocessor_config.json")


def test_the_token_count_is_the_audio_encoders() -> None:
    assert [audio_tokens(frames) for frames in (100, 300, 3000)] == [25, 75, 750]


def test_a_forwarded_clip_is_decoded_and_reextracted_to_its_references_tokens(reprocessed: ReprocessedAudio) -> None:
    clip = wav(CLIP)  # 3 s: 75 tokens
    clips = np.array([clip], dtype=np.object_)
    assert reprocess_forwarded(clips, reprocessed, [reference("audio", 75)]) == len(clip)
    assert reprocess_forwarded(None, None, [reference("audio", 75)]) == 0
    with pytest.raises(EpdError) as caught:
        reprocess_forwarded(clips, reprocessed, [reference("audio", 74)])
    assert caught.value.code is ErrorCode.INTERNAL
    assert "re-extracted 75 tokens, the reference says 74" in caught.value.message
    with pytest.raises(EpdError, match="1 forwarded clips for 0 audio references"):
        reprocess_forwarded(clips, reprocessed, [reference("image", 75)])
    with pytest.raises(EpdError, match="only when started with TRITON_EPD_ALLOW_RAW_FORWARDING=1"):
        reprocess_forwarded(clips, None, [reference("audio", 75)])

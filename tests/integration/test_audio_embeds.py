"""Issue 34's premise, checked on vLLM itself: the tiny Qwen2-Audio model gives the same greedy
tokens from precomputed ``audio_embeds`` as from the raw audio, so an audio encoder can run apart
and hand vLLM embeddings (by value or by reference) as the ViT does for images.

The embeddings come from ``builders.audio_encoder``: transformers' encoder run the way vLLM runs
its own (Whisper features padded to the 30 s window, the padded frames masked out of the encoder's
attention; without that mask every clip under 30 s gave other tokens), as a torch module and as
its ONNX graph under ONNX Runtime.

One in-process engine (like the server's stubs); ~30 s.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from bench.audio_clips import tone
from builders.audio_encoder import AudioEncoder, export_onnx, onnx_embeddings
from builders.default_model import DEFAULT_AUDIO_MODEL_DIR, build_default_model

SAMPLING_RATE = 16_000
PROMPT = (
    "<|im_start|>user\nAudio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"
)


class Engine(NamedTuple):
    llm: Any
    processor: Any
    encoder: AudioEncoder
    session: Any


def clip(seconds: float, tone_hz: float, seed: int, rate: int = SAMPLING_RATE) -> np.ndarray:
    """A tone under noise: different clips give different features."""
    return tone(seconds, tone_hz, seed, rate)


def features(processor: Any, audio: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Whisper features padded to the 30 s window, and the clip's feature length."""
    out = processor.feature_extractor(
        audio, sampling_rate=SAMPLING_RATE, return_attention_mask=True, padding="max_length", return_tensors="np"
    )
    return out["input_features"].astype(np.float32), out["attention_mask"].sum(-1).astype(np.int64)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    import onnxruntime as ort
    from transformers import AutoProcessor

    model_dir = build_default_model(DEFAULT_AUDIO_MODEL_DIR, recipe="qwen2-audio")
    onnx_path = export_onnx(model_dir, tmp_path_factory.mktemp("audio-encoder"))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the conftest restores the environment
    from vllm import LLM

    llm = LLM(
        str(model_dir), dtype="float32", enforce_eager=True, max_model_len=2048, limit_mm_per_prompt={"audio": 1},
        enable_mm_embeds=True, kv_cache_memory_bytes=256 << 20, seed=0,
    )
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    yield Engine(llm, AutoProcessor.from_pretrained(model_dir), AudioEncoder(model_dir), session)
    llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("seconds, tone_hz", [(1.0, 440.0), (3.5, 880.0), (10.0, 300.0), (30.0, 1000.0)])
def test_audio_embeds_give_the_raw_audios_greedy_tokens(engine: Engine, seconds: float, tone_hz: float) -> None:
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=12)

    def tokens(audio_data: Any) -> list[int]:
        out = engine.llm.generate({"prompt": PROMPT, "multi_modal_data": {"audio": audio_data}}, greedy, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    def embeds(audio: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """torch's and ONNX Runtime's embeddings of one clip."""
        feats, lengths = features(engine.processor, audio)
        with torch.no_grad():
            padded, count = engine.encoder(torch.from_numpy(feats), torch.from_numpy(lengths))
        return padded[0, : int(count[0])], onnx_embeddings(engine.session, feats, lengths)[0]

    audio = clip(seconds, tone_hz, seed=int(tone_hz))
    from_raw = tokens((audio, SAMPLING_RATE))
    from_torch, from_onnx = embeds(audio)
    assert tokens({"audio_embeds": from_torch[None]}) == from_raw
    assert tokens({"audio_embeds": torch.from_numpy(from_onnx)[None]}) == from_raw
    # The embeddings matter: another clip's give other tokens (a check that could fail).
    other, _ = embeds(clip(seconds, tone_hz * 1.5, seed=1))
    assert tokens({"audio_embeds": other[None]}) != from_raw


@pytest.mark.parametrize("container", ["wav", "flac", "mp3", "ogg opus 48 kHz"])
def test_the_served_encode_chain_gives_vllms_tokens_on_the_same_samples(engine: Engine, container: str) -> None:
    """The encode path end to end without transformers: file bytes -> FFmpeg's samples -> the DALI
    features -> the ONNX graph -> vLLM, against vLLM on the same samples."""
    from vllm import SamplingParams

    from bench.audio_clips import encoded, wav
    from python_backends.preprocess.audio import DaliAudioFeatures
    from python_backends.preprocess.audio_pipeline import AudioFeatureConfig
    from python_backends.request.audios import AudioLimits, decode_audio

    data = {
        "wav": lambda: wav(clip(7.3, 660.0, seed=7)),
        "flac": lambda: encoded(clip(7.3, 660.0, seed=7), "flac", "flac"),
        "mp3": lambda: encoded(clip(7.3, 660.0, seed=7), "mp3", "libmp3lame"),
        "ogg opus 48 kHz": lambda: encoded(clip(7.3, 660.0, seed=7, rate=48_000), "ogg", "libopus", 48_000),
    }[container]()
    samples = decode_audio(data, 0, AudioLimits(), SAMPLING_RATE)
    features = DaliAudioFeatures.of_config(AudioFeatureConfig(), max_batch_size=1, num_threads=1).features([samples])[0]
    lengths = np.array([features.length], dtype=np.int64)
    embeds = onnx_embeddings(engine.session, features.features[None], lengths)[0]

    greedy = SamplingParams(temperature=0, max_tokens=12)

    def tokens(audio_data: Any) -> list[int]:
        out = engine.llm.generate({"prompt": PROMPT, "multi_modal_data": {"audio": audio_data}}, greedy, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    assert tokens({"audio_embeds": torch.from_numpy(embeds)[None]}) == tokens((samples, SAMPLING_RATE))

"""The tiny Qwen2-Audio checkpoint (issue 34): transformers loads every file of it as a hub
download, its encoder and LM weights are in shards of their own, and its processor turns a clip
into one audio token per 40 ms."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from builders.default_model import (
    ModelDirError,
    build_default_model,
    is_audio_checkpoint,
    is_complete_build,
    main,
    resolve_model,
)
from builders.tiny_audio import AUDIO_ENCODER_SHARD, AUDIO_TOKENS, LANGUAGE_SHARD, is_audio_encoder_key


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_default_model(tmp_path_factory.mktemp("audio") / "model", seed=0, recipe="qwen2-audio")


def test_transformers_loads_it_with_every_weight_and_no_other(audio_dir: Path) -> None:
    from transformers import Qwen2AudioForConditionalGeneration

    model, info = Qwen2AudioForConditionalGeneration.from_pretrained(audio_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.audio_token_index == model.config.text_config.vocab_size - len(AUDIO_TOKENS)


def test_encoder_and_language_model_weights_are_in_shards_of_their_own(audio_dir: Path) -> None:
    index = json.loads((audio_dir / "model.safetensors.index.json").read_text())
    assert index["metadata"]["shards"] == {"audio_encoder": AUDIO_ENCODER_SHARD, "language": LANGUAGE_SHARD}
    for key, shard in index["weight_map"].items():
        assert (shard == AUDIO_ENCODER_SHARD) == is_audio_encoder_key(key), key
    assert {"audio_tower.conv1.weight", "multi_modal_projector.linear.weight",
            "language_model.model.embed_tokens.weight", "language_model.lm_head.weight"} <= set(index["weight_map"])


@pytest.mark.parametrize("seconds, tokens", [(1.0, 25), (3.5, 87), (30.0, 750)])
def test_the_processor_gives_one_audio_token_per_40_ms(audio_dir: Path, seconds: float, tokens: int) -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(audio_dir)
    messages = [{"role": "user", "content": [{"type": "audio", "audio": "clip"}, {"type": "text", "text": "What?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>" in prompt
    clip = np.zeros(int(seconds * 16_000), dtype=np.float32)
    out = processor(text=prompt, audio=[clip], sampling_rate=16_000, return_tensors="np")
    assert out["input_features"].shape == (1, 128, 3000)  # Whisper's 30 s window
    audio_id = processor.tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    assert int((out["input_ids"] == audio_id).sum()) == tokens


def test_it_is_served_as_an_audio_checkpoint(audio_dir: Path, tmp_path: Path) -> None:
    assert resolve_model(audio_dir) == audio_dir and is_audio_checkpoint(audio_dir)
    assert not is_audio_checkpoint(build_default_model())
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    for path in audio_dir.iterdir():
        if path.name != "preprocessor_config.json":
            (lacking / path.name).write_bytes(path.read_bytes())
    with pytest.raises(ModelDirError, match="not a complete Qwen2-Audio checkpoint: no feature extractor config"):
        resolve_model(lacking)


def test_recipes_are_stamped_apart(audio_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert is_complete_build(audio_dir, 0, "qwen2-audio")
    assert not is_complete_build(audio_dir, 0)  # not the default model's build
    with pytest.raises(ModelDirError, match="unknown recipe"):
        build_default_model(tmp_path / "x", recipe="qwen2-omni")
    assert main(["--recipe", "qwen2-audio", "--out", str(audio_dir)]) == 0
    assert "reused intact build: tiny Qwen2-Audio checkpoint" in capsys.readouterr().out


def test_the_audio_encoders_onnx_graph_matches_torch_for_any_clip_count_and_length(
    audio_dir: Path, tmp_path: Path
) -> None:
    from builders.audio_encoder import export_onnx, max_abs_difference

    onnx_path = export_onnx(audio_dir, tmp_path)
    features = np.random.default_rng(0).standard_normal((3, 128, 3000)).astype(np.float32)
    lengths = np.array([3000, 1000, 101], dtype=np.int64)  # 30 s, 10 s, 1 s (exported with 2 clips)
    assert max_abs_difference(audio_dir, onnx_path, features, lengths) < 1e-4
    assert max_abs_difference(audio_dir, onnx_path, features[:1], lengths[:1]) < 1e-4

"""A tiny, seeded, random-weight Qwen2-Audio checkpoint: the audio model of issue 34.

Qwen2-Audio is a Whisper-style audio encoder (two convolutions, 2x average pooling: one token
per 40 ms of audio), a linear projector and a Qwen2 LM. vLLM 0.32 serves it on CPU and takes
precomputed ``audio_embeds`` for it, so its encoder can run apart, as the ViT does. The recipe is
the default model's (``builders/default_model.py``): the same BPE tokenizer and LM sizes, the
family's special tokens plus its three audio tokens, hub-layout configs and keys, our seeded init;
the feature extractor is Whisper's at 128 mel bins, 16 kHz, 30 s windows, as Qwen2-Audio ships it.

The weights go in the default model's two shard files, the first holding the audio encoder
(``audio_tower.*``, ``multi_modal_projector.*``), the second the LM, so an encoder process can
load only its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builders.default_model import LANGUAGE_SHARD, VISION_SHARD, init_weights, save_shards, write_json, write_tokenizer
from builders.tiny_checkpoint import SPECIAL_TOKENS, TinySpec, generation_config

# Qwen2-Audio's audio tokens, in its id order (151646..151648 there).
AUDIO_TOKENS: tuple[str, ...] = ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")
AUDIO_SPECIAL_TOKENS = SPECIAL_TOKENS + AUDIO_TOKENS

# After Qwen2-Audio-7B-Instruct's chat template: each audio part becomes
# "Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>", which vLLM's processor expands to one
# <|AUDIO|> per audio token.
AUDIO_CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if 'audio' in content or 'audio_url' in content or content['type'] == 'audio' %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
AUDIO_ENCODER_SHARD = VISION_SHARD  # the default model's first shard file, its encoder's here too


@dataclass(frozen=True)
class AudioSpec:
    """Sizes of the tiny audio model; its LM is the default model's."""

    lm: TinySpec = TinySpec(bpe_vocab_size=1071)  # 1071 + 17 special = 1088 = 17 * 64, no padding rows
    num_mel_bins: int = 128
    encoder_layers: int = 2
    encoder_d_model: int = 128
    encoder_attention_heads: int = 2  # head_dim 64, as for the LM and the ViT
    encoder_ffn_dim: int = 256
    max_source_positions: int = 1500  # 30 s of 10 ms frames after the stride-2 convolution
    sampling_rate: int = 16_000
    hop_length: int = 160
    n_fft: int = 400
    chunk_length_s: int = 30


def audio_model_config(spec: AudioSpec, ids: dict[str, int], vocab_size: int) -> dict[str, Any]:
    """config.json in the layout of hub Qwen2-Audio checkpoints."""
    lm = spec.lm
    return {
        "architectures": ["Qwen2AudioForConditionalGeneration"],
        "model_type": "qwen2_audio",
        "audio_token_index": ids["<|AUDIO|>"],
        "ignore_index": -100,
        "torch_dtype": "float32",
        "audio_config": {
            "model_type": "qwen2_audio_encoder",
            "activation_function": "gelu",
            "d_model": spec.encoder_d_model,
            "encoder_attention_heads": spec.encoder_attention_heads,
            "encoder_ffn_dim": spec.encoder_ffn_dim,
            "encoder_layers": spec.encoder_layers,
            "max_source_positions": spec.max_source_positions,
            "num_mel_bins": spec.num_mel_bins,
            "scale_embedding": False,
        },
        "text_config": {
            "model_type": "qwen2",
            "architectures": ["Qwen2ForCausalLM"],
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "hidden_act": "silu",
            "hidden_size": lm.hidden_size,
            "intermediate_size": lm.intermediate_size,
            "max_position_embeddings": lm.max_position_embeddings,
            "num_attention_heads": lm.num_attention_heads,
            "num_hidden_layers": lm.num_hidden_layers,
            "num_key_value_heads": lm.num_key_value_heads,
            "rms_norm_eps": 1e-06,
            "rope_theta": lm.rope_theta,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "vocab_size": vocab_size,
        },
    }


def feature_extractor_config(spec: AudioSpec) -> dict[str, Any]:
    """preprocessor_config.json: Whisper's log-mel feature extractor, as Qwen2-Audio ships it."""
    return {
        "chunk_length": spec.chunk_length_s,
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": spec.num_mel_bins,
        "hop_length": spec.hop_length,
        "n_fft": spec.n_fft,
        "n_samples": spec.chunk_length_s * spec.sampling_rate,
        "nb_max_frames": spec.chunk_length_s * spec.sampling_rate // spec.hop_length,
        "padding_side": "right",
        "padding_value": 0.0,
        "processor_class": "Qwen2AudioProcessor",
        "return_attention_mask": True,
        "sampling_rate": spec.sampling_rate,
    }


def hub_key(transformers_key: str) -> str:
    """transformers 5's parameter name -> the hub Qwen2-Audio layout, which vLLM loads."""
    for prefix, replacement in (
        ("model.audio_tower.", "audio_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
    ):
        if transformers_key.startswith(prefix):
            return replacement + transformers_key[len(prefix) :]
    raise ValueError(f"unexpected parameter {transformers_key!r} in Qwen2-Audio model")


def is_audio_encoder_key(name: str) -> bool:
    return name.startswith(("audio_tower.", "multi_modal_projector."))


def parameter_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names (hub layout) and shapes of every tensor transformers' own model has (meta device)."""
    import torch
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    with torch.device("meta"):
        model = Qwen2AudioForConditionalGeneration(Qwen2AudioConfig(**config))
    return {hub_key(name): tuple(t.shape) for name, t in model.state_dict().items()}


def write_audio_checkpoint(out_dir: Path, seed: int, spec: AudioSpec = AudioSpec()) -> None:
    """Every file of the checkpoint (but the build stamp) into the existing empty ``out_dir``."""
    vocab_size, ids = write_tokenizer(out_dir, spec.lm, AUDIO_SPECIAL_TOKENS, AUDIO_CHAT_TEMPLATE)
    write_json(out_dir / "preprocessor_config.json", feature_extractor_config(spec))
    config = audio_model_config(spec, ids, vocab_size)
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json", generation_config(ids))
    save_shards(
        init_weights(parameter_shapes(config), seed), out_dir,
        {"audio_encoder": AUDIO_ENCODER_SHARD, "language": LANGUAGE_SHARD}, is_audio_encoder_key,
    )

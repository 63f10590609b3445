"""What the files of the default model say: its sizes, its tokenizer and its configs.

``builders/default_model.py`` writes them (with the weights) into a checkpoint directory;
nothing here touches the disk. The tokenizer is a real byte-level BPE trained on
``builders/data/corpus.txt`` with the Qwen2-VL family's special tokens and chat template; the
configs are those of a hub Qwen2-VL checkpoint, at :class:`TinySpec`'s sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# The Qwen2-VL family's added tokens, in the family's id order (151643..151656 there,
# directly after our BPE vocabulary here).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2's pre-tokenizer split (GPT-4 style, digits one by one), as in its tokenizer.json.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2-VL-Instruct's chat template, verbatim.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# CLIP normalisation, as in Qwen2-VL's preprocessor_config.json.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class TinySpec:
    """Sizes of the default model: small enough for 2 CPU cores, shaped so vLLM accepts it."""

    # 1074 BPE tokens + 14 special tokens = 1088 = 17 * 64: the embedding needs no padding
    # rows. Padding rows (as real checkpoints have) would be untrained ids that random
    # weights happily generate and the tokenizer cannot decode. The corpus supports ~1320.
    bpe_vocab_size: int = 1074
    hidden_size: int = 128
    num_attention_heads: int = 2  # head_dim 64: vLLM's CPU attention rejects 16
    num_key_value_heads: int = 1  # keeps GQA in the picture, as in Qwen2-VL-2B
    num_hidden_layers: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    mrope_section: tuple[int, int, int] = (16, 8, 8)  # sums to head_dim / 2
    vision_depth: int = 2
    vision_embed_dim: int = 128
    vision_num_heads: int = 2  # vision head_dim 64 too, for the same CPU kernels
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 448 * 448  # at most 256 image tokens per image on CPU


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def train_tokenizer(corpus: str, spec: TinySpec, special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> Tokenizer:
    """Train Qwen2's tokenizer pipeline (NFC, regex split, byte-level BPE) on ``corpus``.

    The trainer breaks ties deterministically, so the same corpus gives the same merges in
    every process. Special tokens are added after training so that they take the ids right
    after the BPE vocabulary, in the family's order.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=spec.bpe_vocab_size,
        min_frequency=1,
        show_progress=False,
        # all 256 bytes, so any text (any language, emoji) still encodes
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator([corpus], trainer=trainer)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in special_tokens]
    )
    return tokenizer


def special_token_ids(tokenizer: Tokenizer, special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> dict[str, int]:
    ids = {token: tokenizer.token_to_id(token) for token in special_tokens}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
        raise RuntimeError(f"tokenizer lacks special tokens {missing}")
    return ids  # type: ignore[return-value]


def tokenizer_config(ids: dict[str, int], spec: TinySpec, chat_template: str = CHAT_TEMPLATE) -> dict[str, Any]:
    """tokenizer_config.json as Qwen2-VL-Instruct ships it (eos <|im_end|>, pad <|endoftext|>);
    ``ids`` names the special tokens, in id order."""
    added = {
        str(ids[token]): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in ids
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in ids if t != "<|endoftext|>"],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": spec.max_position_embeddings,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# ---------------------------------------------------------------------------------------------
# Model and processor configs
# ---------------------------------------------------------------------------------------------


def model_config(spec: TinySpec, ids: dict[str, int], vocab_size: int) -> dict[str, Any]:
    """config.json in the flat layout of hub Qwen2-VL checkpoints (what real downloads have)."""
    head_dim = spec.hidden_size // spec.num_attention_heads
    if sum(spec.mrope_section) * 2 != head_dim:
        raise ValueError(f"mrope_section {spec.mrope_section} must sum to head_dim/2 = {head_dim // 2}")
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "rms_norm_eps": 1e-06,
        "rope_theta": spec.rope_theta,
        "rope_scaling": {"type": "mrope", "mrope_section": list(spec.mrope_section)},
        "sliding_window": spec.max_position_embeddings,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",  # CPU serving; hub configs still use this key
        "use_cache": True,
        "vocab_size": vocab_size,
        "vision_config": {
            "depth": spec.vision_depth,
            "embed_dim": spec.vision_embed_dim,
            "hidden_act": "quick_gelu",
            "hidden_size": spec.hidden_size,  # the merger projects into the LM's width
            "in_channels": 3,
            "mlp_ratio": 4,
            "num_heads": spec.vision_num_heads,
            "patch_size": spec.patch_size,
            "spatial_merge_size": spec.spatial_merge_size,
            "temporal_patch_size": spec.temporal_patch_size,
        },
    }


def generation_config(ids: dict[str, int]) -> dict[str, Any]:
    # transformers generates greedily with this. vLLM ignores do_sample (it takes only
    # temperature/top_k/top_p/... from here), so greedy there means temperature=0 in the
    # request. We set no sampling defaults on purpose: hub Qwen2-VL-Instruct ships top_k=1,
    # which vLLM merges into every request and silently turns sampling into greedy.
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "do_sample": False,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    }


def _vision_processing(spec: TinySpec) -> dict[str, Any]:
    # Both spellings of the pixel budget, as recent hub configs carry them: transformers 5
    # reads size.shortest_edge/longest_edge, older code and qwen-vl-utils min/max_pixels.
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": list(CLIP_MEAN),
        "image_std": list(CLIP_STD),
        "merge_size": spec.spatial_merge_size,
        "min_pixels": spec.min_pixels,
        "max_pixels": spec.max_pixels,
        "patch_size": spec.patch_size,
        "resample": 3,  # bicubic
        "rescale_factor": 1 / 255,
        "size": {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
        "temporal_patch_size": spec.temporal_patch_size,
    }


def preprocessor_config(spec: TinySpec) -> dict[str, Any]:
    return {
        **_vision_processing(spec),
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
    }


def video_preprocessor_config(spec: TinySpec) -> dict[str, Any]:
    # Without this file transformers builds the video processor from preprocessor_config.json;
    # writing it keeps video settings explicit and the class unambiguous.
    return {
        **_vision_processing(spec),
        # Bound a video's total pixels the way qwen-vl-utils does (transformers 5.19 warns
        # until this is chosen; 5.22 makes it the default), against our context length.
        "cap_pixels_per_frame": True,
        "max_video_tokens": spec.max_position_embeddings,
        "video_processor_type": "Qwen2VLVideoProcessor",
        "processor_class": "Qwen2VLProcessor",
    }

"""The tiny default Qwen2-VL checkpoint: reproducible, split into vision/LM shards, loadable.

The checkpoint is built once per module (a few seconds); each extra build is ~1 s.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from builders.default_model import (
    INDEX_FILE,
    LANGUAGE_SHARD,
    STAMP_FILE,
    VISION_SHARD,
    ModelDirError,
    build_default_model,
    main,
    resolve_model,
)
from builders.tiny_checkpoint import SPECIAL_TOKENS

IMAGE_SPAN = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_default_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file: 8-byte little-endian length, then JSON."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length))


def tensor_names(path: Path) -> set[str]:
    return {name for name in safetensors_header(path) if name != "__metadata__"}


def file_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_same_seed_gives_byte_identical_files(model_dir: Path, tmp_path: Path) -> None:
    again = build_default_model(tmp_path / "again", seed=0)
    first, second = file_bytes(model_dir), file_bytes(again)
    assert sorted(first) == sorted(second)
    differing = [name for name in first if first[name] != second[name]]
    assert differing == []


def test_other_seed_changes_only_the_weights(model_dir: Path, tmp_path: Path) -> None:
    other = build_default_model(tmp_path / "seed1", seed=1)
    first, second = file_bytes(model_dir), file_bytes(other)
    differing = {name for name in first if first[name] != second[name]}
    assert differing == {VISION_SHARD, LANGUAGE_SHARD, STAMP_FILE}


def test_vision_and_language_weights_sit_in_separate_shards(model_dir: Path) -> None:
    index = read_json(model_dir / INDEX_FILE)
    vision = tensor_names(model_dir / VISION_SHARD)
    language = tensor_names(model_dir / LANGUAGE_SHARD)

    assert vision and all(name.startswith("visual.") for name in vision)
    assert language and not any(name.startswith("visual.") for name in language)
    # hub layout, as real Qwen2-VL checkpoints: visual.*, model.*, lm_head.*
    assert {name.split(".")[0] for name in language} == {"model", "lm_head"}
    assert "model.embed_tokens.weight" in language and "lm_head.weight" in language
    assert "visual.merger.mlp.2.weight" in vision

    expected_map = {name: VISION_SHARD for name in vision} | {name: LANGUAGE_SHARD for name in language}
    assert index["weight_map"] == expected_map
    assert index["metadata"]["shards"] == {"vision": VISION_SHARD, "language": LANGUAGE_SHARD}


def test_key_layout_is_what_transformers_itself_saves(model_dir: Path) -> None:
    # transformers 5 renames hub keys on load and reverts the renaming on save; our files
    # must look like its saves (and so like hub downloads), not like its in-memory names.
    import torch
    from transformers import AutoConfig, Qwen2VLForConditionalGeneration
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(AutoConfig.from_pretrained(model_dir))
    saved_keys = set(revert_weight_conversion(model, model.state_dict()))
    assert set(read_json(model_dir / INDEX_FILE)["weight_map"]) == saved_keys


def test_transformers_generates_from_an_image(model_dir: Path) -> None:
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir)
    processor = AutoProcessor.from_pretrained(model_dir)
    assert model.dtype == torch.float32
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)

    def greedy(image: Image.Image) -> list[int]:
        inputs = processor(text=[prompt], images=[image], return_tensors="pt")
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        return output[0, inputs["input_ids"].shape[1] :].tolist()

    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (120, 160, 3), dtype=np.uint8))
    red = Image.new("RGB", (160, 120), (255, 0, 0))
    tokens = greedy(noise)
    assert len(tokens) == 8 and all(0 <= t < model.config.text_config.vocab_size for t in tokens)
    assert greedy(noise) == tokens
    # the image reaches the output: token comparisons across serving modes mean something
    assert greedy(red) != tokens


def test_shard_sizes_match_index_total(model_dir: Path) -> None:
    total = 0
    for shard in (VISION_SHARD, LANGUAGE_SHARD):
        header = safetensors_header(model_dir / shard)
        assert header["__metadata__"] == {"format": "pt"}
        total += sum(end - start for name, info in header.items() if name != "__metadata__"
                     for start, end in [info["data_offsets"]])
        assert all(info["dtype"] == "F32" for name, info in header.items() if name != "__metadata__")
    assert read_json(model_dir / INDEX_FILE)["metadata"]["total_size"] == total


def test_special_token_ids_match_config(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = read_json(model_dir / "config.json")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}

    assert len(set(ids.values())) == len(SPECIAL_TOKENS)
    # every special token encodes to itself, as one token
    for token, token_id in ids.items():
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    assert config["image_token_id"] == ids["<|image_pad|>"]
    assert config["video_token_id"] == ids["<|video_pad|>"]
    assert config["vision_start_token_id"] == ids["<|vision_start|>"]
    assert config["vision_end_token_id"] == ids["<|vision_end|>"]
    assert config["bos_token_id"] == ids["<|endoftext|>"]
    assert config["eos_token_id"] == ids["<|im_end|>"] == tokenizer.eos_token_id
    assert tokenizer.pad_token_id == ids["<|endoftext|>"]
    # no embedding row without a token: random weights would generate undecodable ids
    assert config["vocab_size"] == len(tokenizer)
    generation = read_json(model_dir / "generation_config.json")
    assert generation["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]


def test_tokenizer_is_a_trained_byte_level_bpe(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # corpus words are single tokens; unseen text still round-trips through bytes
    assert len(tokenizer.tokenize(" image")) == 1
    text = "Describe this image: Ünïcödé 🐱, 1234!"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_chat_template_with_one_image_renders_the_vision_span(model_dir: Path) -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)

    assert prompt.count(IMAGE_SPAN) == 1
    assert prompt.endswith(f"<|im_start|>user\n{IMAGE_SPAN}What is it?<|im_end|>\n<|im_start|>assistant\n")
    # the tokenizer alone (what vLLM uses for text prompts) renders the same
    assert processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == prompt


def test_processor_caps_image_tokens(model_dir: Path) -> None:
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    image = Image.fromarray(np.zeros((1080, 1920, 3), dtype=np.uint8))
    inputs = processor(text=[IMAGE_SPAN], images=[image], return_tensors="pt")
    image_tokens = int((inputs["input_ids"] == processor.image_token_id).sum())
    t, h, w = inputs["image_grid_thw"][0].tolist()
    assert image_tokens == t * h * w // 4 <= 256


def test_build_reuses_an_intact_build_and_redoes_a_damaged_one(model_dir: Path, tmp_path: Path) -> None:
    out = build_default_model(tmp_path / "m", seed=0)
    config_path = out / "config.json"
    mtime = config_path.stat().st_mtime_ns
    assert build_default_model(out, seed=0) == out
    assert config_path.stat().st_mtime_ns == mtime  # reused, not rewritten

    (out / LANGUAGE_SHARD).write_bytes(b"truncated")
    build_default_model(out, seed=0)
    assert (out / LANGUAGE_SHARD).read_bytes() == (model_dir / LANGUAGE_SHARD).read_bytes()


def test_build_refuses_to_overwrite_a_foreign_directory(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ModelDirError, match="not written by builders.default_model"):
        build_default_model(foreign, seed=0, force=True)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_resolve_model_accepts_a_built_checkpoint(model_dir: Path) -> None:
    assert resolve_model(model_dir) == model_dir
    assert resolve_model(str(model_dir)) == model_dir


def copy_checkpoint(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir()
    for path in src.iterdir():
        if path.name not in skip:
            (dst / path.name).write_bytes(path.read_bytes())
    return dst


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: None, "does not exist"),
        (lambda d: d.mkdir(), "has no config.json"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text("{")), "not valid JSON"),
        (
            lambda d: (d.mkdir(), (d / "config.json").write_text('{"model_type": "llama"}')),
            "model_type 'llama'; this server needs a Qwen2-VL checkpoint",
        ),
    ],
    ids=["missing", "empty", "bad-json", "other-architecture"],
)
def test_resolve_model_rejects_non_qwen2_vl_dirs(tmp_path: Path, setup, message: str) -> None:
    target = tmp_path / "ckpt"
    setup(target)
    with pytest.raises(ModelDirError, match=message):
        resolve_model(target)


@pytest.mark.parametrize(
    ("removed", "message"),
    [
        (("tokenizer.json", "vocab.json"), "no tokenizer"),
        (("preprocessor_config.json",), "no image processor config"),
        ((LANGUAGE_SHARD,), "shards listed in model.safetensors.index.json are missing"),
        ((INDEX_FILE,), "no model.safetensors"),
    ],
    ids=["tokenizer", "preprocessor", "shard", "index"],
)
def test_resolve_model_names_what_an_incomplete_checkpoint_lacks(
    model_dir: Path, tmp_path: Path, removed: tuple[str, ...], message: str
) -> None:
    broken = copy_checkpoint(model_dir, tmp_path / "broken", skip=removed)
    with pytest.raises(ModelDirError, match=message):
        resolve_model(broken)


def test_cli_builds_and_reports_where(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(model_dir), "--seed", "0"]) == 0
    assert f"reused intact build: tiny Qwen2-VL checkpoint (seed 0) at {model_dir}" in capsys.readouterr().out

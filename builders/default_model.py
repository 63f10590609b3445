"""Build the project's default model: a tiny, seeded, random-weight Qwen2-VL checkpoint.

The checkpoint has the real Qwen2-VL architecture (vision tower + merger + Qwen2 LM with
M-RoPE), a real byte-level BPE tokenizer with the family's special tokens and chat template,
and processor configs, so transformers and vLLM load it exactly like a hub download. Weights
are random, so text is meaningless, but greedy decoding is deterministic: every serving mode
must produce the same tokens from it.

Everything is generated offline from this file and ``builders/data/corpus.txt``; the same
seed gives byte-identical files. Weights are saved in the key layout of hub checkpoints
(``visual.*``, ``model.*``, ``lm_head.*``) as two shards: one holding only the vision weights,
one only the LM weights, so an encoder process can load just its shard.

CLI: ``python -m builders.default_model [--out DIR] [--seed 0] [--force]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from builders.tiny_checkpoint import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TinySpec,
    generation_config,
    model_config,
    preprocessor_config,
    special_token_ids,
    tokenizer_config,
    train_tokenizer,
    video_preprocessor_config,
)

if TYPE_CHECKING:  # heavy imports stay lazy: resolve_model runs in every serving process
    import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "build" / "models" / "tiny-qwen2-vl"
DEFAULT_AUDIO_MODEL_DIR = REPO_ROOT / "build" / "models" / "tiny-qwen2-audio"
CORPUS_PATH = Path(__file__).resolve().parent / "data" / "corpus.txt"

# The stamp records a digest of this file, tiny_checkpoint.py and the corpus, so any change to the recipe
# (sizes, tokenizer, init, file layout) makes existing builds stale without a manual bump.
STAMP_FILE = "build_stamp.json"

VISION_SHARD = "model-00001-of-00002.safetensors"
LANGUAGE_SHARD = "model-00002-of-00002.safetensors"
INDEX_FILE = "model.safetensors.index.json"

class ModelDirError(ValueError):
    """A model directory is not a usable Qwen2-VL checkpoint; the message says what to do."""


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def hub_key(transformers_key: str) -> str:
    """Map a transformers 5 parameter name to the hub checkpoint layout.

    transformers 5 nests modules as ``model.visual`` / ``model.language_model``; hub checkpoints
    (and transformers' own save_pretrained, which reverts its load-time renaming) use
    ``visual.*`` and ``model.*``. Both transformers and vLLM load the hub layout.
    """
    for prefix, replacement in (("model.visual.", "visual."), ("model.language_model.", "model.")):
        if transformers_key.startswith(prefix):
            return replacement + transformers_key[len(prefix) :]
    if transformers_key.startswith("lm_head."):
        return transformers_key
    raise ValueError(f"unexpected parameter {transformers_key!r} in Qwen2-VL model")


def parameter_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names (hub layout) and shapes of every saved tensor, read off transformers' own model.

    The model is built on the meta device: no memory, no RNG use, just the module tree, so
    the checkpoint always has exactly the tensors transformers expects.
    """
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    hf_config = Qwen2VLConfig(**config)
    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(hf_config)
    return {hub_key(name): tuple(t.shape) for name, t in model.state_dict().items()}


def init_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Seeded init, ours rather than transformers' so weights don't move with its version.

    Matrices get N(0, 1/fan_in) (variance-preserving), unlike the usual N(0, 0.02): with
    0.02 a 2-layer random model barely mixes positions, and its greedy tokens would ignore
    the image and prompt, which would make cross-mode token comparisons prove nothing.
    Norm weights are 1, biases 0, as in any fresh model.
    """
    import torch

    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.float32)
    if len(shape) == 1:  # LayerNorm / RMSNorm weights
        return torch.ones(shape, dtype=torch.float32)
    fan_in = 1
    for dim in shape[1:]:
        fan_in *= dim
    std = 1.0 if name.endswith("embed_tokens.weight") else fan_in**-0.5
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std


def init_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    # Sorted names fix the order in which random numbers are drawn.
    return {name: init_tensor(name, shapes[name], generator) for name in sorted(shapes)}


def is_vision_key(name: str) -> bool:
    return name.startswith("visual.")


def save_shards(
    weights: dict[str, torch.Tensor],
    out_dir: Path,
    names: dict[str, str] | None = None,
    is_encoder_key: Callable[[str], bool] = is_vision_key,
) -> None:
    """Write the encoder's shard, the LM's shard and a standard index that maps every key.
    ``names``: what the index calls the two shards (encoder first) and their files."""
    from safetensors.torch import save_file

    names = names or {"vision": VISION_SHARD, "language": LANGUAGE_SHARD}
    encoder_file, language_file = names.values()
    shards = {
        encoder_file: {k: v for k, v in weights.items() if is_encoder_key(k)},
        language_file: {k: v for k, v in weights.items() if not is_encoder_key(k)},
    }
    weight_map: dict[str, str] = {}
    total_size = 0
    for filename, tensors in shards.items():
        # Fixed metadata only: safetensors writes no timestamps, so files are reproducible.
        save_file(tensors, str(out_dir / filename), metadata={"format": "pt"})
        weight_map.update({k: filename for k in tensors})
        total_size += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {
        "metadata": {
            "total_size": total_size,
            # Informative only; real checkpoints lack it, so loaders go by weight_map.
            "shards": names,
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    write_json(out_dir / INDEX_FILE, index)


# ---------------------------------------------------------------------------------------------
# Build, stamp, resolve
# ---------------------------------------------------------------------------------------------


def write_json(path: Path, data: Any) -> None:
    # Key order comes from the dicts we build, so the same inputs give the same bytes.
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_tokenizer(
    out_dir: Path, spec: TinySpec, special_tokens: tuple[str, ...] = SPECIAL_TOKENS, chat_template: str = CHAT_TEMPLATE
) -> tuple[int, dict[str, int]]:
    """The tokenizer's files, trained on the corpus with ``special_tokens`` after its vocabulary;
    returns the vocabulary size (every model id is a token the tokenizer decodes) and the special ids."""
    tokenizer = train_tokenizer(CORPUS_PATH.read_text(encoding="utf-8"), spec, special_tokens)
    ids = special_token_ids(tokenizer, special_tokens)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    tokenizer.model.save(str(out_dir))  # vocab.json + merges.txt, as hub checkpoints ship
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(ids, spec, chat_template))
    # transformers 5 reads chat_template.jinja for processors; tokenizer_config has it too
    # for readers (vLLM, older transformers) that only look there.
    (out_dir / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    return tokenizer.get_vocab_size(), ids


def write_checkpoint(out_dir: Path, seed: int, spec: TinySpec | None = None) -> None:
    """Write every file of the checkpoint (except the stamp) into an existing empty dir."""
    spec = spec or TinySpec()
    vocab_size, ids = write_tokenizer(out_dir, spec)
    write_json(out_dir / "preprocessor_config.json", preprocessor_config(spec))
    write_json(out_dir / "video_preprocessor_config.json", video_preprocessor_config(spec))

    config = model_config(spec, ids, vocab_size)
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json", generation_config(ids))
    save_shards(init_weights(parameter_shapes(config), seed), out_dir)


def _write_audio_checkpoint(out_dir: Path, seed: int) -> None:
    from builders.tiny_audio import write_audio_checkpoint  # it builds on this module

    write_audio_checkpoint(out_dir, seed)


@dataclass(frozen=True)
class Recipe:
    title: str
    default_dir: Path
    write: Callable[[Path, int], None]  # every file but the stamp, into an empty folder, from a seed


# The checkpoints this module builds: the default (Qwen2-VL) and the audio one (issue 34).
RECIPES = {
    "qwen2-vl": Recipe("Qwen2-VL", DEFAULT_MODEL_DIR, write_checkpoint),
    "qwen2-audio": Recipe("Qwen2-Audio", DEFAULT_AUDIO_MODEL_DIR, _write_audio_checkpoint),
}


def builder_digest() -> str:
    """sha256 over the inputs that define a build: the modules' sources and the corpus."""
    digest = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for path in (Path(__file__).resolve(), here / "tiny_checkpoint.py", here / "tiny_audio.py", CORPUS_PATH):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def expected_stamp(seed: int, recipe: str = "qwen2-vl") -> dict[str, Any]:
    return {"builder": "builders.default_model", "builder_digest": builder_digest(), "recipe": recipe, "seed": seed}


def stamp_for(out_dir: Path, seed: int, recipe: str = "qwen2-vl") -> dict[str, Any]:
    files = sorted(p.name for p in out_dir.iterdir() if p.is_file() and p.name != STAMP_FILE)
    return {**expected_stamp(seed, recipe), "files": {name: sha256_file(out_dir / name) for name in files}}


def is_complete_build(out_dir: Path, seed: int, recipe: str = "qwen2-vl") -> bool:
    """True if ``out_dir`` holds an intact build of this exact recipe for ``seed``.

    Hashing the few MB of files is cheap and catches half-written or edited builds.
    """
    stamp_path = out_dir / STAMP_FILE
    try:
        stamp = json.loads(stamp_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    expected = expected_stamp(seed, recipe)
    if {k: stamp.get(k) for k in expected} != expected:
        return False
    files = stamp.get("files")
    if not isinstance(files, dict) or not files:
        return False
    try:
        return all(sha256_file(out_dir / name) == digest for name, digest in files.items())
    except OSError:
        return False


def _make_readable(directory: Path) -> None:
    # mkdtemp makes the dir 0700 and safetensors writes 0600 files; serving processes may run
    # as another user (containers), so give the usual world-readable modes.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def build_default_model(
    out_dir: Path = DEFAULT_MODEL_DIR, seed: int = 0, force: bool = False, recipe: str = "qwen2-vl"
) -> Path:
    """Build the tiny checkpoint of ``recipe`` into ``out_dir`` and return it; reuse an intact build.

    The files are written into a temporary sibling directory and renamed into place, so a
    crash or a concurrent builder never leaves a half-written checkpoint at ``out_dir``.
    A non-empty ``out_dir`` that is not one of our builds is never deleted.
    """
    out_dir = Path(out_dir).resolve()
    if recipe not in RECIPES:
        raise ModelDirError(f"unknown recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    if not force and is_complete_build(out_dir, seed, recipe):
        return out_dir
    if out_dir.exists() and not out_dir.is_dir():
        raise ModelDirError(f"{out_dir} exists and is not a directory; choose another --out")
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / STAMP_FILE).exists():
        raise ModelDirError(
            f"{out_dir} is not empty and was not written by builders.default_model; "
            "choose another --out directory or empty it first"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        RECIPES[recipe].write(tmp_dir, seed)
        write_json(tmp_dir / STAMP_FILE, stamp_for(tmp_dir, seed, recipe))
        _make_readable(tmp_dir)
        if out_dir.exists():
            shutil.rmtree(out_dir)  # one of our builds (checked above): stale or forced
        try:
            os.replace(tmp_dir, out_dir)
        except OSError:
            # Another builder renamed its copy in first; the same seed means the same bytes.
            if not is_complete_build(out_dir, seed, recipe):
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def _missing_weights(model_dir: Path) -> str | None:
    """Describe what is wrong with the weight files, or None if they are all there."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            return f"{INDEX_FILE} is unreadable ({exc})"
        absent = sorted({f for f in weight_map.values() if not (model_dir / f).is_file()})
        return f"shards listed in {INDEX_FILE} are missing: {absent}" if absent else None
    if (model_dir / "model.safetensors").is_file():
        return None
    return f"no model.safetensors or {INDEX_FILE} (weights must be safetensors)"


# The architectures served, by config.json's ``model_type``: what each takes besides text.
# Qwen2-VL: images and video (every model of the repository); Qwen2-Audio: audio (``llm``).
SERVED_MODEL_TYPES = {"qwen2_vl": "Qwen2-VL", "qwen2_audio": "Qwen2-Audio"}
AUDIO_MODEL_TYPES = frozenset({"qwen2_audio"})


def is_audio_checkpoint(model_dir: Path) -> bool:
    """Whether ``model_dir``'s config.json names an audio architecture (not validated here)."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        return False
    return json.loads(config_path.read_text(encoding="utf-8")).get("model_type") in AUDIO_MODEL_TYPES


def validate_checkpoint(model_dir: Path) -> None:
    """Raise ModelDirError unless ``model_dir`` looks like a complete checkpoint of an architecture
    this server serves (:data:`SERVED_MODEL_TYPES`)."""
    if not model_dir.is_dir():
        raise ModelDirError(f"model directory {model_dir} does not exist or is not a directory")
    config_path = model_dir / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelDirError(f"{model_dir} has no config.json; is it a Hugging Face checkpoint?") from None
    except ValueError as exc:
        raise ModelDirError(f"{config_path} is not valid JSON: {exc}") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in SERVED_MODEL_TYPES:
        raise ModelDirError(
            f"{model_dir} holds model_type {model_type!r}; this server needs a Qwen2-VL checkpoint "
            "(model_type 'qwen2_vl'), e.g. Qwen/Qwen2-VL-2B-Instruct, or no path for the tiny default "
            "(or a Qwen2-Audio one, model_type 'qwen2_audio', for audio)"
        )
    title = SERVED_MODEL_TYPES[model_type]
    problems: list[str] = []
    if not (model_dir / "tokenizer.json").is_file() and not (
        (model_dir / "vocab.json").is_file() and (model_dir / "merges.txt").is_file()
    ):
        problems.append("no tokenizer (tokenizer.json, or vocab.json + merges.txt)")
    if not (model_dir / "tokenizer_config.json").is_file():
        problems.append("no tokenizer_config.json")
    if not (model_dir / "preprocessor_config.json").is_file() and not (
        model_dir / "processor_config.json"
    ).is_file():
        what = "feature extractor" if model_type in AUDIO_MODEL_TYPES else "image processor"
        problems.append(f"no {what} config (preprocessor_config.json)")
    if (weights_problem := _missing_weights(model_dir)) is not None:
        problems.append(weights_problem)
    if problems:
        raise ModelDirError(f"{model_dir} is not a complete {title} checkpoint: " + "; ".join(problems))


def resolve_model(path_or_none: str | os.PathLike[str] | None) -> Path:
    """Return the checkpoint directory to serve: the given one (validated) or the default.

    ``None`` (or an empty string, as an unset config parameter arrives) means the tiny default
    model, built on first use.
    """
    if path_or_none is None or str(path_or_none) == "":
        model_dir = build_default_model(DEFAULT_MODEL_DIR)
    else:
        model_dir = Path(path_or_none).expanduser().resolve()
    validate_checkpoint(model_dir)
    return model_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m builders.default_model",
        description="Build the tiny random-weight Qwen2-VL checkpoint used by default (or the audio one).",
    )
    parser.add_argument("--recipe", choices=list(RECIPES), default="qwen2-vl",
                        help="qwen2-vl (the default model) or qwen2-audio (issue 34's audio model)")
    parser.add_argument("--out", type=Path, help="output directory (default: build/models/tiny-<recipe>)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--force", action="store_true", help="rebuild even if an intact build exists")
    args = parser.parse_args(argv)
    out = args.out or RECIPES[args.recipe].default_dir
    reused = not args.force and is_complete_build(out.resolve(), args.seed, args.recipe)
    try:
        out_dir = build_default_model(out, seed=args.seed, force=args.force, recipe=args.recipe)
    except ModelDirError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    action = "reused intact build" if reused else "wrote"
    print(f"{action}: tiny {RECIPES[args.recipe].title} checkpoint (seed {args.seed}) at {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

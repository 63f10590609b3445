"""What the builders read from a checkpoint, and the facts and errors that describe it.

The lowest floor of ``builders/``: it imports none of its neighbours, so the exporters
(``encoder``, ``audio_encoder``), the TensorRT builder, the checks (``preflight``) and the config
writers (``model_configs``) all import from here and never from each other in a circle.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from python_backends import contract

if TYPE_CHECKING:  # torch loads only where weights are read
    import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

Precision = Literal["fp16", "fp32"]


class EncoderBuildError(RuntimeError):
    """The checkpoint or environment cannot give an encoder; the message says why."""


@dataclass(frozen=True)
class EncoderFacts:
    """Shapes and provenance of the exported vision encoder (kept in its build stamp); the
    configs size their tensors from it and write it as ``vit_encoder`` parameters."""

    patch_dim: int
    image_patch_dim: int  # folded: one temporal copy (python_backends/encode/vit_onnx.py)
    hidden_size: int
    merge_size: int
    vision_shards: int  # shard files the export read
    checkpoint_shards: int  # shard files in the checkpoint
    vision_weight_bytes: int
    checkpoint_weight_bytes: int

    @classmethod
    def from_report(cls, report: dict[str, Any]) -> EncoderFacts:
        return cls(**{name: int(report[name]) for name in cls.__dataclass_fields__})

    def parameters(self) -> dict[str, int]:
        """The facts as config parameters; also the sizes of named dims (contract.PATCH_DIM, ...)."""
        return {key: getattr(self, key) for key in contract.ENCODER_FACTS}


def shard_plan(model_dir: Path, wanted: Callable[[str], bool]) -> tuple[dict[str, list[str]], int]:
    """{shard file: [its keys that are ``wanted``]} and the total number of shard files (any
    encoder's weights: the ViT's here, the audio encoder's in ``builders/audio_encoder.py``)."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        plan: dict[str, list[str]] = {}
        for key, filename in weight_map.items():
            if wanted(key):
                plan.setdefault(filename, []).append(key)
        return plan, len(set(weight_map.values()))
    if (model_dir / SINGLE_FILE).is_file():
        from safetensors import safe_open

        with safe_open(str(model_dir / SINGLE_FILE), framework="pt") as handle:
            keys = [key for key in handle.keys() if wanted(key)]
        return ({SINGLE_FILE: keys} if keys else {}), 1
    raise EncoderBuildError(f"{model_dir} has neither {INDEX_FILE} nor {SINGLE_FILE}")


def read_planned(model_dir: Path, plan: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """The planned tensors (hub names), reading only those."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for filename, keys in sorted(plan.items()):
        with safe_open(str(model_dir / filename), framework="pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in keys})
    return tensors


def checkpoint_positions(model_dir: Path) -> int | None:
    """The checkpoint's ``max_position_embeddings`` (top level, or the text config's), if any."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    value = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return int(value) if value else None

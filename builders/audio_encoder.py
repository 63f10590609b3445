"""The audio encoder of a Qwen2-Audio checkpoint as one ONNX graph (issue 34): Whisper features in,
the LM's audio embeddings out, computed as vLLM computes them from raw audio.

vLLM's Qwen2-Audio masks the frames that pad a clip to Whisper's 30 s window out of the encoder's
attention (``_process_audio_input``, vLLM 0.32); embeddings computed without that mask give other
greedy tokens (docs/facts.md). The graph takes each clip's feature length and builds the mask
itself, so a caller passes only what the feature extractor gives:

- ``input_features`` float32 ``[clips, mel bins, 3000]``, ``feature_lengths`` int64 ``[clips]``
  (the feature extractor's attention mask, summed);
- ``audio_embeds`` float32 ``[clips, 750, hidden]`` (padded) and ``audio_tokens`` int64 ``[clips]``:
  clip ``i``'s embeddings are ``audio_embeds[i, :audio_tokens[i]]``, what vLLM takes as
  ``audio_embeds``.

Only the encoder's shard is read (``audio_tower.*``, ``multi_modal_projector.*``).

CLI: ``python -m builders.audio_encoder --model DIR --out DIR`` (writes ``model.onnx``, checks ONNX
Runtime against the torch module).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import torch

from builders.checkpoint import EncoderBuildError, read_planned, shard_plan
from builders.tiny_audio import is_audio_encoder_key

INPUT_NAMES = ("input_features", "feature_lengths")
OUTPUT_NAMES = ("audio_embeds", "audio_tokens")


def encoder_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The encoder's tensors (hub names), from the shards that hold them only."""
    plan, _ = shard_plan(model_dir, is_audio_encoder_key)
    if not plan:
        raise EncoderBuildError(f"no audio encoder weights (audio_tower.*, multi_modal_projector.*) in {model_dir}")
    return read_planned(model_dir, plan)


class AudioEncoder(torch.nn.Module):
    """transformers' Qwen2-Audio encoder and projector, with vLLM's padding mask."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__()
        from transformers import Qwen2AudioConfig
        from transformers.models.qwen2_audio.modeling_qwen2_audio import (
            Qwen2AudioEncoder,
            Qwen2AudioMultiModalProjector,
        )

        config = Qwen2AudioConfig.from_pretrained(model_dir)
        self.tower = Qwen2AudioEncoder(config.audio_config)
        self.projector = Qwen2AudioMultiModalProjector(config)
        weights = encoder_weights(model_dir)
        for prefix, module in (("audio_tower.", self.tower), ("multi_modal_projector.", self.projector)):
            module.load_state_dict({k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)})
        self.eval()

    def forward(self, input_features: torch.Tensor, feature_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The stride-2 convolution, then the 2x pooling (Qwen2AudioEncoder._get_feat_extract_output_lengths).
        frames = (feature_lengths - 1) // 2 + 1
        tokens = (frames - 2) // 2 + 1
        positions = (input_features.shape[-1] - 2) // 2 + 1
        padded = torch.arange(positions, device=input_features.device)[None, :] >= frames[:, None]
        mask = torch.zeros(padded.shape, dtype=input_features.dtype).masked_fill(padded, float("-inf"))
        mask = mask[:, None, None, :].expand(-1, 1, positions, positions)
        hidden = self.tower(input_features, attention_mask=mask).last_hidden_state
        return self.projector(hidden), tokens


def export_onnx(model_dir: Path, out_dir: Path) -> Path:
    """``model.onnx`` with a dynamic clip count."""
    encoder = AudioEncoder(model_dir)
    mel_bins = encoder.tower.config.num_mel_bins
    frames = 2 * encoder.tower.config.max_source_positions
    example = (torch.zeros(2, mel_bins, frames), torch.tensor([frames, frames // 3]))
    clips = torch.export.Dim("clips", min=1, max=64)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.onnx"
    with torch.no_grad():
        program = torch.onnx.export(
            encoder, example, input_names=list(INPUT_NAMES), output_names=list(OUTPUT_NAMES),
            dynamic_shapes=({0: clips}, {0: clips}), dynamo=True,
        )
    assert program is not None
    program.save(str(path))
    return path


def onnx_embeddings(session: Any, features: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """Each clip's ``[tokens, hidden]`` from an ONNX Runtime session of :func:`export_onnx`'s graph."""
    embeds, tokens = session.run(list(OUTPUT_NAMES), {"input_features": features, "feature_lengths": lengths})
    return [embeds[i, : int(n)] for i, n in enumerate(tokens)]


def max_abs_difference(model_dir: Path, onnx_path: Path, features: np.ndarray, lengths: np.ndarray) -> float:
    """ONNX Runtime against the torch module on the same features."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        embeds, tokens = AudioEncoder(model_dir)(torch.from_numpy(features), torch.from_numpy(lengths))
    reference = [embeds[i, : int(n)].numpy() for i, n in enumerate(tokens)]
    got = onnx_embeddings(session, features, lengths)
    return max(float(np.abs(a - b).max()) for a, b in zip(reference, got, strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m builders.audio_encoder", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a Qwen2-Audio checkpoint directory")
    parser.add_argument("--out", type=Path, required=True, help="where model.onnx goes")
    args = parser.parse_args(argv)
    path = export_onnx(args.model, args.out)
    rng = np.random.default_rng(0)
    features = rng.standard_normal((3, 128, 3000)).astype(np.float32)
    lengths = np.array([3000, 1000, 101], dtype=np.int64)
    difference = max_abs_difference(args.model, path, features, lengths)
    print(f"wrote {path}; ONNX Runtime vs torch, max |difference|: {difference:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

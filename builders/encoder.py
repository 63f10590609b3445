"""Build the ``vit_encoder`` artefacts from a Qwen2-VL checkpoint: ONNX (both targets) and a
TensorRT plan (GPU target, where ``tensorrt`` imports).

Steps, each a small function:

1. :func:`load_vision_weights` reads only the safetensors shards that hold vision weights
   (``visual.*`` in hub checkpoints, ``model.visual.*`` as transformers 5 names them), using
   ``model.safetensors.index.json`` when there is one, else the single ``model.safetensors``.
2. :func:`load_vision_tower` builds transformers' own vision model + merger from those weights.
3. :func:`export_onnx` exports :class:`PerImageVisionTower`: one image (or video) per call, so
   attention needs no mask; the rotary position ids are an input computed outside by
   ``python_backends.encode.vit_onnx``; images may come folded (one temporal copy per row).
4. :func:`validate_onnx` checks ONNX Runtime against the transformers module over many grids,
   with full and folded rows.
5. :func:`builders.tensorrt_plan.build_tensorrt_plan` (GPU only) serializes the ``tensorrt_plan`` engine for one
   optimisation profile (``builders/tensorrt_config.py``, which also renders its config.pbtxt).

CLI: ``python -m builders.encoder --model DIR --out DIR/vit_encoder/1 [--tensorrt fp16]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from builders.checkpoint import EncoderBuildError, read_planned, shard_plan
from python_backends import contract
from python_backends.encode.vit_onnx import (
    INPUT_NAMES,
    META_HIDDEN_SIZE,
    META_MERGE_SIZE,
    META_PATCH_DIM,
    META_TEMPORAL_PATCH_SIZE,
    OUTPUT_NAME,
    OnnxVisionEncoder,
    frame_position_ids,
    unfold_temporal,
)

if TYPE_CHECKING:  # transformers loads lazily: the config helpers below do not need it
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
        VisionAttention,
    )

LOGGER = logging.getLogger(__name__)

# Hub layout first; transformers 5 save_pretrained may keep its load-time names.
VISION_PREFIXES: tuple[str, ...] = ("visual.", "model.visual.")
ONNX_FILE, PLAN_FILE = contract.ONNX_FILE, contract.PLAN_FILE
ONNX_OPSET = 18
# Above this, weights go to an external data file (protobuf's hard limit is 2 GiB).
EXTERNAL_DATA_BYTES = 1 << 30
PARITY_TOLERANCE = 1e-4

# ---------------------------------------------------------------------------------------------
# 1. Vision weights only
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VisionWeights:
    """Vision tensors keyed as the vision model names them (prefix removed)."""

    tensors: dict[str, torch.Tensor]
    shard_files_read: tuple[str, ...]
    shard_files_total: int
    seconds: float


def _vision_suffix(key: str) -> str | None:
    for prefix in VISION_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return None


def vision_shard_plan(model_dir: Path) -> tuple[dict[str, list[str]], int]:
    """{shard file: [its vision keys]} and the total number of shard files."""
    return shard_plan(model_dir, lambda key: _vision_suffix(key) is not None)


def load_vision_weights(model_dir: str | Path) -> VisionWeights:
    """Open only the shard files that hold vision tensors, and read only those tensors."""
    model_dir = Path(model_dir)
    started = time.perf_counter()
    plan, total = vision_shard_plan(model_dir)
    if not plan:
        raise EncoderBuildError(f"no vision weights ({' or '.join(VISION_PREFIXES)}*) in {model_dir}")
    tensors = {_vision_suffix(key) or key: tensor for key, tensor in read_planned(model_dir, plan).items()}
    seconds = time.perf_counter() - started
    LOGGER.info(
        "read %d vision tensors from %d of %d shard files in %.2f s",
        len(tensors), len(plan), total, seconds,
    )
    return VisionWeights(tensors, tuple(sorted(plan)), total, seconds)


# ---------------------------------------------------------------------------------------------
# 2. The transformers vision tower
# ---------------------------------------------------------------------------------------------


def load_vision_tower(
    model_dir: str | Path, weights: VisionWeights | None = None
) -> Qwen2VisionTransformerPretrainedModel:
    """transformers' Qwen2-VL vision model + merger, float32, eval mode, vision weights only."""
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
        Qwen2VLVisionRotaryEmbedding,
    )

    model_dir = Path(model_dir)
    weights = weights or load_vision_weights(model_dir)
    vision_config = Qwen2VLConfig.from_pretrained(str(model_dir)).vision_config
    vision_config._attn_implementation = "eager"  # the reference: no fused kernels
    with torch.device("meta"):  # no memory and no random init for weights we overwrite
        tower = Qwen2VisionTransformerPretrainedModel(vision_config)
    state = {name: tensor.to(torch.float32) for name, tensor in weights.tensors.items()}
    tower.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers (rotary inverse frequencies) are not in checkpoints: rebuild.
    tower.rotary_pos_emb = Qwen2VLVisionRotaryEmbedding(vision_config)
    return tower.eval()


def tower_dims(tower: Qwen2VisionTransformerPretrainedModel) -> dict[str, int]:
    config = tower.config
    return {
        "merge_size": int(config.spatial_merge_size),
        "patch_dim": int(config.in_channels * config.temporal_patch_size * config.patch_size**2),
        "temporal_patch_size": int(config.temporal_patch_size),
        "hidden_size": int(config.hidden_size),
    }


def torch_reference(
    tower: Qwen2VisionTransformerPretrainedModel, pixel_values: np.ndarray, image_grid_thw: np.ndarray
) -> np.ndarray:
    """transformers' own forward (per-image attention loop): the ground truth."""
    with torch.inference_mode():
        output = tower(torch.from_numpy(pixel_values), grid_thw=torch.from_numpy(np.asarray(image_grid_thw)))
    return output.pooler_output.numpy()


# ---------------------------------------------------------------------------------------------
# 3. Export
# ---------------------------------------------------------------------------------------------


class PerImageVisionTower(torch.nn.Module):
    """The tower for one image (or video) per call: same weights, same maths, a static graph.

    - No attention mask: every frame of a call attends within itself (``[frames, patches, ...]``),
      which is all Qwen2-VL's ``cu_seqlens`` ever allow.
    - The patch embedding (a Conv3d whose stride is its kernel) as one MatMul.
    - The temporal fold: an image's rows repeat one frame ``T`` times, so ``x @ W`` equals the
      frame's ``C*P*P`` values times ``W`` summed over ``T``. The graph takes either width and
      picks its weight rows by slicing one buffer, ``[W_folded; W]``, at ``width - C*P*P``.
    """

    def __init__(self, tower: Qwen2VisionTransformerPretrainedModel) -> None:
        super().__init__()
        self.tower = tower
        weight = tower.patch_embed.proj.weight.detach()  # [hidden, C, T, P, P]
        hidden = weight.shape[0]
        folded = weight.sum(dim=2).reshape(hidden, -1).t()  # [C*P*P, hidden], rows (c, p, p)
        full = weight.reshape(hidden, -1).t()  # [C*T*P*P, hidden], rows (c, t, p, p)
        self.frame_dim = int(folded.shape[0])
        self.register_buffer("embed_weight", torch.cat([folded, full]).contiguous())

    def forward(self, pixel_values: torch.Tensor, rotary_pos_ids: torch.Tensor) -> torch.Tensor:
        tower = self.tower
        frames, patches, width = pixel_values.shape
        first_row = width - self.frame_dim  # 0 for folded rows, C*P*P for full ones
        hidden = torch.matmul(pixel_values, self.embed_weight[first_row : first_row + width])
        cos, sin = tower.rotary_pos_emb(hidden, rotary_pos_ids)
        for block in tower.blocks:
            hidden = hidden + frame_attention(block.attn, block.norm1(hidden), cos, sin)
            hidden = hidden + block.mlp(block.norm2(hidden))
        return tower.merger(hidden.reshape(frames * patches, -1))


def frame_attention(attn: VisionAttention, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """VisionAttention's maths, each frame over its own patches (``hidden``: [frames, patches, dim]);
    scaled-dot-product attention without a mask, a pattern ONNX Runtime's fusions recognise."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

    frames, patches, _ = hidden.shape
    qkv = attn.qkv(hidden).reshape(frames, patches, 3, attn.num_heads, -1).permute(2, 0, 1, 3, 4)
    query, key, value = qkv.unbind(0)  # [frames, patches, heads, head_dim]
    query, key = apply_rotary_pos_emb_vision(query, key, cos, sin)
    context = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale=attn.scaling
    )
    return attn.proj(context.transpose(1, 2).reshape(frames, patches, -1))


def export_onnx(
    tower: Qwen2VisionTransformerPretrainedModel, out_dir: str | Path, max_patches: int = 1 << 16
) -> Path:
    """Write ``model.onnx`` (dynamo exporter) with dynamic frame, patch and row-width dims."""
    from torch.export import Dim

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dims = tower_dims(tower)
    module = PerImageVisionTower(tower).eval()
    block = dims["merge_size"] ** 2
    # Two frames of a 4 x 6 grid in full rows: the exporter must specialise on none of it.
    grid_h, grid_w = 2 * dims["merge_size"], 3 * dims["merge_size"]
    pixels = torch.randn(2, grid_h * grid_w, dims["patch_dim"], generator=torch.Generator().manual_seed(0))
    positions = torch.from_numpy(frame_position_ids(grid_h, grid_w, dims["merge_size"]))
    # The merger folds merge x merge patches into one token, so a frame's patch count is a
    # multiple of merge**2; saying so lets the exporter keep it symbolic.
    merged_tokens = Dim("merged_tokens", min=1, max=max(1, max_patches // block))
    frames = Dim("frames", min=1, max=max_patches)
    temporal = Dim("temporal", min=1, max=dims["temporal_patch_size"])
    dynamic_shapes = {
        "pixel_values": {0: frames, 1: block * merged_tokens, 2: module.frame_dim * temporal},
        "rotary_pos_ids": {0: block * merged_tokens},
    }
    parameter_bytes = sum(p.numel() * p.element_size() for p in tower.parameters())
    onnx_path = out_dir / ONNX_FILE
    with torch.inference_mode():
        program = torch.onnx.export(
            module,
            (pixels, positions),
            dynamo=True,
            input_names=list(INPUT_NAMES),
            output_names=[OUTPUT_NAME],
            dynamic_shapes=dynamic_shapes,
            opset_version=ONNX_OPSET,
            external_data=parameter_bytes > EXTERNAL_DATA_BYTES,
            optimize=True,
        )
    program.save(str(onnx_path), external_data=parameter_bytes > EXTERNAL_DATA_BYTES)
    _write_metadata(onnx_path, dims)
    return onnx_path


def _write_metadata(onnx_path: Path, dims: dict[str, int]) -> None:
    # The runner reads the merge size and widths from the model itself, so a model directory
    # needs no checkpoint config next to it.
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    # The exporter names the output's row count after an internal symbol ("s71"); say what it is.
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "merged_tokens"
    # torch.export's debug notes list its shape symbols in hash order: the same export then gave
    # other bytes under another PYTHONHASHSEED, so servers built apart had other content keys.
    kept = [prop for prop in model.graph.metadata_props if not prop.key.startswith("pkg.torch.export.")]
    del model.graph.metadata_props[:]
    model.graph.metadata_props.extend(kept)
    names = {
        "merge_size": META_MERGE_SIZE,
        "patch_dim": META_PATCH_DIM,
        "temporal_patch_size": META_TEMPORAL_PATCH_SIZE,
        "hidden_size": META_HIDDEN_SIZE,
    }
    values = {meta: dims[name] for name, meta in names.items()}
    existing = {prop.key for prop in model.metadata_props}
    for key, value in values.items():
        if key not in existing:
            model.metadata_props.add(key=key, value=str(value))
    onnx.save(model, str(onnx_path))


# ---------------------------------------------------------------------------------------------
# 4. Validation
# ---------------------------------------------------------------------------------------------


# Single images of many shapes (tiny, square, wide, tall, odd block counts) and mixed batches.
VALIDATION_GRIDS: tuple[tuple[tuple[int, int, int], ...], ...] = (
    ((1, 2, 2),),
    ((1, 4, 6),),
    ((1, 8, 8),),
    ((1, 6, 4),),
    ((1, 2, 40),),
    ((1, 40, 2),),
    ((1, 16, 10),),
    ((1, 26, 36),),
    ((1, 32, 32),),
    ((2, 4, 4),),  # a two-frame input: attention stays within each frame
    ((1, 4, 6), (1, 2, 2)),
    ((1, 10, 14), (1, 6, 6), (1, 2, 8)),
    ((1, 14, 22), (1, 22, 14)),
)


@dataclass(frozen=True)
class ParityReport:
    grids: tuple[tuple[tuple[int, int, int], ...], ...]
    max_abs: tuple[float, ...]
    tolerance: float
    worst: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "worst", max(self.max_abs))

    @property
    def ok(self) -> bool:
        return self.worst <= self.tolerance


def validate_onnx(
    onnx_path: str | Path,
    tower: Qwen2VisionTransformerPretrainedModel,
    grids: Iterable[Sequence[Sequence[int]]] = VALIDATION_GRIDS,
    tolerance: float = PARITY_TOLERANCE,
    seed: int = 0,
) -> ParityReport:
    """Max-abs difference of ONNX Runtime (one call per image) vs transformers (the batch in one
    forward) per batch of grids, float32; batches of images are checked with full and with folded
    rows (both widths the graph takes)."""
    encoder = OnnxVisionEncoder(onnx_path)
    rng = np.random.default_rng(seed)
    checked, errors = [], []
    for batch in grids:
        grid = np.asarray(batch, dtype=np.int64)
        rows = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
        images = bool((grid[:, 0] == 1).all())
        if images:  # an image's temporal copies are equal: draw one, repeat it
            folded = rng.standard_normal((rows, encoder.shape.folded_patch_dim), dtype=np.float32)
            pixels = unfold_temporal(folded, encoder.shape.temporal_patch_size)
        else:
            pixels = rng.standard_normal((rows, encoder.patch_dim), dtype=np.float32)
        expected = torch_reference(tower, pixels, grid)
        for sent in (pixels, folded) if images else (pixels,):
            actual = encoder.encode_concatenated(sent, grid)
            if actual.shape != expected.shape:
                raise EncoderBuildError(f"grid {batch}: ONNX gives {actual.shape}, torch {expected.shape}")
            checked.append(tuple(tuple(int(v) for v in row) for row in grid))
            errors.append(float(np.abs(actual - expected).max()))
    return ParityReport(tuple(checked), tuple(errors), tolerance)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Export the Qwen2-VL vision encoder (ONNX, TensorRT)")
    parser.add_argument("--model", required=True, help="Qwen2-VL checkpoint directory")
    parser.add_argument("--out", required=True, help="directory for model.onnx (and model.plan)")
    parser.add_argument("--tensorrt", choices=["fp16", "fp32"], help="also build a TensorRT plan")
    parser.add_argument("--skip-validation", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("onnx_ir").setLevel(logging.WARNING)  # one line per folded constant

    weights = load_vision_weights(args.model)
    tower = load_vision_tower(args.model, weights)
    onnx_path = export_onnx(tower, args.out)
    print(f"wrote {onnx_path} (vision shards read: {len(weights.shard_files_read)}/{weights.shard_files_total})")
    if not args.skip_validation:
        report = validate_onnx(onnx_path, tower)
        print(f"ONNX Runtime vs torch over {len(report.grids)} grid batches: max-abs {report.worst:.2e}")
        if not report.ok:
            raise EncoderBuildError(f"ONNX parity {report.worst:.2e} > {report.tolerance:.0e}")
    if args.tensorrt:
        from builders.tensorrt_config import TrtProfile
        from builders.tensorrt_plan import build_tensorrt_plan

        # The gpu target's profile: the checkpoint's pixel limits, one image of folded rows per call.
        dims = tower_dims(tower)
        profile = TrtProfile.from_preprocessor_config(
            json.loads((Path(args.model) / "preprocessor_config.json").read_text())
        )
        shapes = profile.input_shapes(dims["patch_dim"] // dims["temporal_patch_size"])
        plan = build_tensorrt_plan(onnx_path, Path(args.out) / PLAN_FILE, shapes, precision=args.tensorrt)
        print(f"wrote {plan}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

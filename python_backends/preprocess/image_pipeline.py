"""The one DALI pipeline that turns encoded images into Qwen2-VL ``pixel_values``.

The same definition serves both targets (docs/architecture.md, "One source, two targets"):

- ``gpu``: serialized with the ``mixed`` (nvJPEG) decoder and run by Triton's DALI backend.
- ``cpu``: serialized with the ``cpu`` decoder and run with ``device_id=None`` by
  :mod:`python_backends.preprocess.images` inside a python-backend model.

Per image it reproduces transformers' ``Qwen2VLImageProcessor``: decode to RGB (grayscale,
palette, RGBA and CMYK converted as PIL's ``convert("RGB")`` does; alpha dropped; EXIF
orientation applied, as transformers' ``load_image`` and vLLM do), Qwen2-VL's ``smart_resize``
computed *inside* the graph from the peeked header shape, bicubic resize, rescale + normalize,
and ``[1, grid_h, grid_w]`` (``image_grid_thw``). The last step, the patch layout
``[grid_h * grid_w, C * P * P]`` (``pixel_values``, temporally folded: one copy of the image per
row where the processor repeats it T times; ``images.unfold_temporal`` restores that), is in
the graph for the GPU target
(the DALI backend's output feeds the encoder directly) and in numpy for the CPU target
(:func:`python_backends.preprocess.images.patchify`): DALI's CPU transpose of that 7-D layout costs
~13 ms per image, numpy's 0.6 ms. Both give identical numbers (tested).

Everything comes from the checkpoint's ``preprocessor_config.json``. Serialization is
deterministic: explicit operator names and no source-location tracing, so the same config and
device give the same bytes wherever the repository is built.

CLI: ``python -m python_backends.preprocess.image_pipeline --model DIR --device cpu --out model.dali``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from nvidia.dali import fn, types
from nvidia.dali import math as dmath
from nvidia.dali.data_node import DataNode
from nvidia.dali.pipeline import Pipeline

from python_backends.preprocess.processor import (
    _RGB_CHANNELS,
    ImageTransformConfig,
)

Device = Literal["cpu", "gpu"]

# Names are a contract with the Triton DALI backend's config.pbtxt (input = external source
# name, outputs in this order) and with python_backends.preprocess.images. Output 0 is
# ``pixel_values`` [patches, C*P*P] (folded) when the graph makes the patch layout, else the
# normalized frame [C, H, W].
INPUT_NAME = "image"
OUTPUT_NAMES: tuple[str, str] = ("pixel_values", "image_grid_thw")

DEFAULT_MAX_BATCH_SIZE = 8
DEFAULT_NUM_THREADS = 2

# ---------------------------------------------------------------------------------------------
# Graph pieces. Sizes are CPU int64 DataNodes, so the same graph works with GPU image data.
# ---------------------------------------------------------------------------------------------


def _as_int64(node: DataNode) -> DataNode:
    return fn.cast(node, dtype=types.INT64)


def _as_float64(node: DataNode) -> DataNode:
    return fn.cast(node, dtype=types.FLOAT64)


def _select(condition: DataNode, if_true: DataNode, if_false: DataNode) -> DataNode:
    """Per-sample ``if_true if condition else if_false`` for int64 nodes, without conditionals."""
    chosen = _as_int64(condition)
    return chosen * if_true + (1 - chosen) * if_false


def _round_half_even_multiple(value: DataNode, factor: int) -> DataNode:
    """``round(value / factor) * factor`` with Python's round-half-to-even, in integers.

    No ``%`` on a node: DALI 1.x (the gpu image's dali backend runs 1.51.2) has no modulo operator,
    so the remainder and the quotient's parity come from ``//`` (values here are non-negative)."""
    quotient = value // factor
    remainder = value - quotient * factor
    odd = quotient - (quotient // 2) * 2 == 1
    rounds_up = (2 * remainder > factor) | ((2 * remainder == factor) & odd)
    return (quotient + _as_int64(rounds_up)) * factor


def smart_resize_nodes(
    height: DataNode, width: DataNode, config: ImageTransformConfig
) -> tuple[DataNode, DataNode]:
    """:func:`smart_resize` as graph arithmetic on int64 scalars (float64 where Python floats)."""
    factor = config.resize_factor
    rounded_h = _round_half_even_multiple(height, factor)
    rounded_w = _round_half_even_multiple(width, factor)
    height_f, width_f = _as_float64(height), _as_float64(width)

    shrink = dmath.sqrt(height_f * width_f / float(config.max_pixels))
    shrunk_h = dmath.max(_as_int64(dmath.floor(height_f / shrink / factor)) * factor, factor)
    shrunk_w = dmath.max(_as_int64(dmath.floor(width_f / shrink / factor)) * factor, factor)

    grow = dmath.sqrt(float(config.min_pixels) / (height_f * width_f))
    grown_h = _as_int64(dmath.ceil(height_f * grow / factor)) * factor
    grown_w = _as_int64(dmath.ceil(width_f * grow / factor)) * factor

    too_big = rounded_h * rounded_w > config.max_pixels
    too_small = rounded_h * rounded_w < config.min_pixels
    out_h = _select(too_big, shrunk_h, _select(too_small, grown_h, rounded_h))
    out_w = _select(too_big, shrunk_w, _select(too_small, grown_w, rounded_w))
    return out_h, out_w


def _size_arg(height: DataNode, width: DataNode) -> DataNode:
    return fn.cast(fn.stack(height, width), dtype=types.FLOAT)


def pil_compatible_bicubic(
    image: DataNode, in_height: DataNode, out_height: DataNode, out_width: DataNode
) -> DataNode:
    """Antialiased bicubic resize the way the processor does it: width pass into uint8, then
    height pass.

    torchvision's uint8 path (the default processor) and Pillow before 13 resample width first
    into a uint8 image, clipping the cubic overshoot, then height. A single 2-D DALI resize is
    ~2.5x faster on the CPU but keeps its intermediate in float and differs by up to ~18 levels
    at hard edges; two 1-axis passes with uint8 in between agree to 2 levels away from the
    borders (tests/unit/test_preprocess_parity.py). Pillow >= 13 runs the height pass first
    when the height shrinks more than twice as much as the width (python-pillow/Pillow#9549).
    """
    cubic = {"interp_type": types.INTERP_CUBIC, "antialias": True}
    horizontal = fn.resize(image, size=_size_arg(in_height, out_width), name="resize_width", **cubic)
    return fn.resize(horizontal, size=_size_arg(out_height, out_width), name="resize_height", **cubic)


def _int64_vector(*values: DataNode | int, like: DataNode) -> DataNode:
    # Constants become per-sample int64 nodes (like * 0 + c) so fn.stack can mix them in.
    nodes = [v if isinstance(v, DataNode) else like * 0 + v for v in values]
    return fn.stack(*nodes)


def patchify(
    normalized_chw: DataNode, out_height: DataNode, out_width: DataNode, config: ImageTransformConfig
) -> DataNode:
    """``[C, H, W]`` -> ``[grid_h * grid_w, C * P * P]`` in Qwen2VLImageProcessor's row order.

    Rows go merge-block by merge-block (so the merger sees its m x m neighbours adjacent); each
    row is C x P x P, one temporal copy (folded: the processor's row repeats it T times).
    """
    p, m = config.patch_size, config.merge_size
    grid_h, grid_w = out_height // p, out_width // p
    blocks = fn.reshape(
        normalized_chw,
        shape=_int64_vector(_RGB_CHANNELS, grid_h // m, m, p, grid_w // m, m, p, like=grid_h),
        layout="",
        name="split_patches",
    )
    # (C, gh/m, m, P, gw/m, m, P) -> (gh/m, gw/m, m, m, C, P, P)
    ordered = fn.transpose(blocks, perm=[1, 4, 2, 5, 0, 3, 6], name="order_patches")
    return fn.reshape(
        ordered,
        shape=_int64_vector(grid_h * grid_w, config.folded_patch_dim, like=grid_h),
        name="flatten_patches",
    )


def grid_thw_node(out_height: DataNode, out_width: DataNode, config: ImageTransformConfig) -> DataNode:
    grid_h = out_height // config.patch_size
    return _int64_vector(1, grid_h, out_width // config.patch_size, like=grid_h)


def patches_in_graph_by_default(device: Device) -> bool:
    return device == "gpu"


def define_image_graph(
    config: ImageTransformConfig, device: Device, patches_in_graph: bool
) -> tuple[DataNode, DataNode]:
    """The graph, to be called inside ``with pipeline:``; returns (pixels, image_grid_thw)."""
    decoder_device = "mixed" if device == "gpu" else "cpu"
    encoded = fn.external_source(name=INPUT_NAME, dtype=types.UINT8, ndim=1, device="cpu")
    # The header alone gives the size (EXIF rotation applied, like the decoder), on the CPU,
    # so the resize arguments never wait for, or depend on, where decoding runs.
    header_shape = fn.peek_image_shape(encoded, dtype=types.INT64, name="peek_shape")
    in_height, in_width = header_shape[0], header_shape[1]
    out_height, out_width = smart_resize_nodes(in_height, in_width, config)

    decoder_args: dict[str, Any] = {"device": decoder_device, "output_type": types.RGB}
    if decoder_device == "mixed":
        # nvJPEG upsamples chroma like libjpeg-turbo only when asked; keeps GPU == CPU pixels.
        decoder_args["jpeg_fancy_upsampling"] = True
    decoded = fn.decoders.image(encoded, name="decode", **decoder_args)

    resized = pil_compatible_bicubic(decoded, in_height, out_height, out_width)
    # (x * rescale - mean) / std == (x - mean / rescale) / (std / rescale)
    normalized = fn.crop_mirror_normalize(
        resized,
        dtype=types.FLOAT,
        output_layout="CHW",
        mean=[m / config.rescale_factor for m in config.image_mean],
        std=[s / config.rescale_factor for s in config.image_std],
        name="normalize",
    )
    pixels = patchify(normalized, out_height, out_width, config) if patches_in_graph else normalized
    return pixels, grid_thw_node(out_height, out_width, config)


@contextlib.contextmanager
def _without_source_tracing() -> Iterator[None]:
    """DALI records each operator's Python file and line in the graph; that would put this
    checkout's absolute path into model.dali and make builds differ by location."""
    try:
        from nvidia.dali._utils import dali_trace
    except ImportError:  # a DALI without tracing has nothing to turn off
        yield
        return
    was_enabled = dali_trace.is_tracing_enabled()
    dali_trace.set_tracing(enabled=False)
    try:
        yield
    finally:
        dali_trace.set_tracing(enabled=was_enabled)


def pipeline_of(
    define: Callable[[], Sequence[DataNode]], max_batch_size: int, num_threads: int = DEFAULT_NUM_THREADS
) -> Pipeline:
    """An unbuilt pipeline whose outputs ``define()`` makes (called inside ``with pipeline:``),
    for every graph of this project (images here, videos in :mod:`python_backends.preprocess.video_pipeline`).
    ``device_id=None``: serialization needs no GPU, and Triton's DALI backend sets the device
    when it loads the model. Depth 1: the CPU runner feeds one batch and runs it at once
    (deeper prefetch fails on the second run with feed_input, docs/facts.md)."""
    pipeline = Pipeline(batch_size=max_batch_size, num_threads=num_threads, device_id=None, prefetch_queue_depth=1)
    with _without_source_tracing(), pipeline:
        pipeline.set_outputs(*define())
    return pipeline


def serialized(pipeline: Pipeline) -> bytes:
    """The pipeline's bytes, without this checkout's paths in them (same inputs, same bytes)."""
    with _without_source_tracing():
        return pipeline.serialize()


def write_serialized(out_path: str | Path, data: bytes) -> Path:
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(data)
    return out_path


def build_pipeline(
    config: ImageTransformConfig,
    device: Device = "cpu",
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    num_threads: int = DEFAULT_NUM_THREADS,
    patches_in_graph: bool | None = None,
) -> Pipeline:
    """An unbuilt image pipeline. ``patches_in_graph`` defaults to the target's choice
    (:func:`patches_in_graph_by_default`)."""
    check_device(device)
    if patches_in_graph is None:
        patches_in_graph = patches_in_graph_by_default(device)
    config.validate()
    return pipeline_of(lambda: define_image_graph(config, device, patches_in_graph), max_batch_size, num_threads)


def check_device(device: str) -> None:
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")


def serialize_pipeline(
    config: ImageTransformConfig,
    device: Device = "cpu",
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    num_threads: int = DEFAULT_NUM_THREADS,
    patches_in_graph: bool | None = None,
) -> bytes:
    return serialized(build_pipeline(config, device, max_batch_size, num_threads, patches_in_graph))


def write_pipeline(
    out_path: str | Path,
    config: ImageTransformConfig,
    device: Device = "cpu",
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
) -> Path:
    """Write ``model.dali`` for a target; same inputs, same bytes."""
    return write_serialized(out_path, serialize_pipeline(config, device, max_batch_size))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint dir or preprocessor_config.json")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE)
    parser.add_argument("--out", required=True, help="where to write the serialized pipeline")
    args = parser.parse_args(argv)
    config = ImageTransformConfig.from_file(args.model)
    path = write_pipeline(args.out, config, args.device, args.max_batch_size)
    print(f"wrote {path} ({path.stat().st_size} bytes, device={args.device})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

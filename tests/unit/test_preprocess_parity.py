"""The DALI pipeline (run on the CPU) against transformers' Qwen2VLImageProcessor.

The pipeline emits images temporally folded (one copy of the T identical temporal copies per
row, ``C*P*P`` wide); comparisons go through ``unfold_temporal``, and the folded patch layout
itself is checked exactly against the processor's ``patchify``. The cpu target's default
preprocessor, bit-exact with the processor, is tested in tests/unit/test_torch_preprocess.py.

Reference: the torchvision ("fast") ``Qwen2VLImageProcessor``, which is what
``AutoImageProcessor`` and vLLM load in transformers 5. We compare against it rather than the
PIL ("slow") ``Qwen2VLImageProcessorPil`` because Pillow >= 13 runs the vertical pass first
when the height shrinks more than twice as much as the width (python-pillow/Pillow#9549),
while torchvision and the DALI pipeline always resample width first; on such sizes the two
transformers processors differ from each other by up to ~20 uint8 levels at hard edges. Where
the pass order agrees, the slow processor gives the same numbers as the fast one here.

Tolerance (normalized units; one uint8 level is 1 / (255 * std) <= 0.0151):
- Away from the borders, <= 2 levels: each of the two 1-D passes rounds to uint8 once, DALI in
  float and Pillow/torchvision in 22-bit fixed point, so each may land one level apart.
- In the border band (output pixels whose filter window reaches past the image edge),
  <= 10 levels (6.6 measured on these images): there DALI clamps source coordinates (repeats
  the edge pixel) while Pillow/torchvision drop the outside taps and renormalise the rest.
  Our images have hard edges and noise up to the border, the worst case for this.
- Mean absolute difference over the whole image <= 0.25 level (0.12 measured, on the
  smallest upscaled images where the band is a large share), which any systematic error (a
  shift, a swapped channel, another filter or normalisation) would exceed many times over.
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from nvidia.dali import fn, types
from nvidia.dali.pipeline import Pipeline
from PIL import Image, ImageDraw, ImageOps
from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
    Qwen2VLImageProcessor,
)
from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
    smart_resize as transformers_smart_resize,
)

from builders.default_model import build_default_model
from python_backends.encode.vit_onnx import unfold_temporal
from python_backends.errors import EpdError, ErrorCode
from python_backends.preprocess.image_pipeline import serialize_pipeline, smart_resize_nodes
from python_backends.preprocess.images import DaliImagePreprocessor, patchify
from python_backends.preprocess.processor import (
    ImageTransformConfig,
    PreprocessConfigError,
    PreprocessedImages,
    smart_resize,
)
from python_backends.request.images import ImageLimits
from tests.images import bilevel_png, zero_width_png

REPO_ROOT = Path(__file__).resolve().parents[2]

LEVEL = 1 / (255 * 0.26130258)  # one uint8 step after normalisation, smallest std (G)
INTERIOR_TOLERANCE = 2 * LEVEL + 1e-5
BORDER_TOLERANCE = 10 * LEVEL
MEAN_TOLERANCE = 0.25 * LEVEL


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def transform_config() -> ImageTransformConfig:
    return ImageTransformConfig.from_file(build_default_model())


@pytest.fixture(scope="module")
def preprocessor(transform_config: ImageTransformConfig) -> DaliImagePreprocessor:
    limits = ImageLimits(max_images=64, max_image_bytes=64 * 1024 * 1024, max_image_pixels=4096 * 4096)
    return DaliImagePreprocessor.for_config(transform_config, limits=limits, max_batch_size=8)


@pytest.fixture(scope="module")
def reference_processor(transform_config: ImageTransformConfig) -> Qwen2VLImageProcessor:
    return Qwen2VLImageProcessor.from_pretrained(str(build_default_model()))


# ---------------------------------------------------------------------------------------------
# Test images: synthetic but hard (gradients, hard-edged boxes, noise up to the borders)
# ---------------------------------------------------------------------------------------------


def synthetic_rgb(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    y = np.arange(height, dtype=np.float32)[:, None]
    x = np.arange(width, dtype=np.float32)[None, :]
    base = np.empty((height, width, 3), dtype=np.float32)
    base[..., 0] = np.sin(x / (7 + seed % 13)) * 60 + 128
    base[..., 1] = np.cos(y / (5 + seed % 7)) * 60 + 128
    base[..., 2] = ((x + y) % 97) * 2.0
    base += rng.normal(0, 6, size=(1, width, 3)).astype(np.float32)  # cheap column noise
    base += rng.normal(0, 6, size=(height, 1, 3)).astype(np.float32)  # and row noise
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(8):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1, y1 = x0 + int(rng.integers(1, width // 2 + 2)), y0 + int(rng.integers(1, height // 2 + 2))
        draw.rectangle((x0, y0, x1, y1), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    return image


def encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def with_alpha(image: Image.Image, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    alpha = np.tile(np.linspace(0, 255, image.width, dtype=np.float32), (image.height, 1))
    alpha[: image.height // 3] = rng.integers(0, 256, size=(image.height // 3, image.width))
    rgba = image.convert("RGBA")
    rgba.putalpha(Image.fromarray(alpha.astype(np.uint8)))
    return rgba


def exif_rotated_jpeg(image: Image.Image) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW to display
    return encode(image, "JPEG", quality=90, exif=exif.tobytes())


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], bytes]


def _rgb(width: int, height: int, fmt: str, **options: object) -> Case:
    seed = width * 7 + height
    return Case(f"{width}x{height}.{fmt.lower()}", lambda: encode(synthetic_rgb(width, height, seed), fmt, **options))


CASES: list[Case] = [
    _rgb(28, 28, "PNG"),
    _rgb(28, 28, "JPEG", quality=95),
    _rgb(29, 31, "PNG"),
    _rgb(56, 56, "WEBP", quality=90),
    _rgb(100, 100, "BMP"),
    _rgb(448, 448, "PNG"),  # already on the grid: only the identity resize
    _rgb(640, 480, "JPEG", quality=90),
    _rgb(480, 640, "PNG"),
    _rgb(300, 200, "BMP"),
    _rgb(200, 300, "BMP"),
    _rgb(1234, 567, "JPEG", quality=85),
    _rgb(777, 1999, "PNG"),
    _rgb(1000, 1000, "WEBP", quality=90),
    _rgb(1920, 1080, "JPEG", quality=90),
    _rgb(1080, 1920, "WEBP", quality=80),
    _rgb(4000, 3000, "JPEG", quality=90),
    _rgb(3000, 4000, "BMP"),
    _rgb(28, 2000, "PNG"),
    _rgb(2000, 28, "JPEG", quality=90),
    _rgb(50, 5000, "PNG"),
    _rgb(5000, 50, "WEBP", lossless=True),
    _rgb(33, 1000, "BMP"),
    _rgb(800, 600, "JPEG", quality=90, progressive=True),
    _rgb(640, 360, "JPEG", quality=95, subsampling=0),  # 4:4:4 chroma
    Case("gray-320x240.png", lambda: encode(synthetic_rgb(320, 240, 1).convert("L"), "PNG")),
    Case("gray-500x375.jpeg", lambda: encode(synthetic_rgb(500, 375, 2).convert("L"), "JPEG", quality=90)),
    Case("gray-150x150.bmp", lambda: encode(synthetic_rgb(150, 150, 3).convert("L"), "BMP")),
    Case("bilevel-120x90.png", lambda: encode(synthetic_rgb(120, 90, 4).convert("1"), "PNG")),
    Case("palette-300x300.png", lambda: encode(synthetic_rgb(300, 300, 5).convert("P"), "PNG")),
    Case("rgba-400x300.png", lambda: encode(with_alpha(synthetic_rgb(400, 300, 6), 6), "PNG")),
    Case("rgba-256x256.webp", lambda: encode(with_alpha(synthetic_rgb(256, 256, 7), 7), "WEBP", lossless=True)),
    Case("la-200x200.png", lambda: encode(with_alpha(synthetic_rgb(200, 200, 8), 8).convert("LA"), "PNG")),
    Case("cmyk-640x480.jpeg", lambda: encode(synthetic_rgb(640, 480, 9).convert("CMYK"), "JPEG", quality=90)),
    Case("exif-rotated-640x480.jpeg", lambda: exif_rotated_jpeg(synthetic_rgb(640, 480, 10))),
]


def reference_outputs(processor: Qwen2VLImageProcessor, data: bytes) -> tuple[np.ndarray, np.ndarray]:
    # What a caller of the processor does with bytes (transformers' load_image): EXIF
    # orientation applied, then the processor's own convert("RGB") (alpha dropped).
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    out = processor(images=[image], return_tensors="np")
    return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])


def unpatchify(pixel_values: np.ndarray, grid_thw: np.ndarray, patch: int = 14, merge: int = 2) -> np.ndarray:
    """Back to one [C, H, W] frame, to locate differences in the image."""
    _, grid_h, grid_w = (int(v) for v in grid_thw)
    blocks = pixel_values.reshape(grid_h // merge, grid_w // merge, merge, merge, 3, -1, patch, patch)
    frame = blocks[:, :, :, :, :, 0].transpose(4, 0, 2, 5, 1, 3, 6)
    return frame.reshape(3, grid_h * patch, grid_w * patch)


def border_band(in_size: int, out_size: int) -> int:
    """Output pixels from an edge whose bicubic window (support 2, widened by the scale when
    shrinking) reaches outside the source image."""
    scale = in_size / out_size
    return math.ceil((2 * max(scale, 1.0) + 0.5) / scale) + 1


# ---------------------------------------------------------------------------------------------
# Parity
# ---------------------------------------------------------------------------------------------


def test_parity_with_transformers_processor(
    preprocessor: DaliImagePreprocessor, reference_processor: Qwen2VLImageProcessor
) -> None:
    encoded = [case.make() for case in CASES]
    assert len(encoded) >= 30
    result = preprocessor.preprocess(encoded)  # several DALI batches, mixed sizes per batch
    offsets = np.cumsum([0, *result.patch_counts()])
    report = []
    for index, (case, data) in enumerate(zip(CASES, encoded, strict=True)):
        ours = result.pixel_values[offsets[index] : offsets[index + 1]]
        ref_pixels, ref_grid = reference_outputs(reference_processor, data)
        assert result.image_grid_thw[index].tolist() == ref_grid[0].tolist(), case.name
        assert ours.shape == (ref_pixels.shape[0], 3 * 14 * 14) and ours.dtype == np.float32, case.name
        assert unfold_temporal(ours, 2).shape == ref_pixels.shape, case.name

        diff = np.abs(unpatchify(ours, ref_grid[0]) - unpatchify(ref_pixels, ref_grid[0])).max(axis=0)
        with Image.open(io.BytesIO(data)) as header:
            width, height = ImageOps.exif_transpose(header).size
        band_y = border_band(height, diff.shape[0])
        band_x = border_band(width, diff.shape[1])
        interior = diff[band_y:-band_y, band_x:-band_x]
        report.append(
            f"{case.name}: max {diff.max():.4f} interior {interior.max(initial=0):.4f} mean {diff.mean():.6f}"
        )
        assert interior.max(initial=0) <= INTERIOR_TOLERANCE, report[-1]
        assert diff.max() <= BORDER_TOLERANCE, report[-1]
        assert diff.mean() <= MEAN_TOLERANCE, report[-1]
    print("\n".join(report))


def test_patch_layout_in_graph_equals_numpy_patchify(
    transform_config: ImageTransformConfig, preprocessor: DaliImagePreprocessor
) -> None:
    """The GPU target makes the patch layout in the graph, the CPU target in numpy: same bytes."""
    in_graph = DaliImagePreprocessor(
        serialize_pipeline(transform_config, "cpu", max_batch_size=8, patches_in_graph=True),
        transform_config,
        limits=preprocessor.limits,
        max_batch_size=8,
    )
    encoded = [CASES[i].make() for i in (0, 2, 6, 9, 17, 30)]
    graph_result, numpy_result = in_graph.preprocess(encoded), preprocessor.preprocess(encoded)
    np.testing.assert_array_equal(graph_result.image_grid_thw, numpy_result.image_grid_thw)
    np.testing.assert_array_equal(graph_result.pixel_values, numpy_result.pixel_values)


def test_folded_patch_layout_is_the_processors_unfolded(
    transform_config: ImageTransformConfig, reference_processor: Qwen2VLImageProcessor
) -> None:
    """Exact, no tolerance: numpy ``patchify`` (the DALI runner's, and the graph's, tested equal
    above) then ``unfold_temporal`` gives the processor's ``patchify`` of the same frame."""
    import torch

    assert transform_config.folded_patch_dim == 3 * 14 * 14
    assert transform_config.patch_dim == 2 * transform_config.folded_patch_dim
    rng = np.random.default_rng(5)
    for height, width in ((28, 28), (56, 84), (112, 28), (336, 448)):
        frame = rng.standard_normal((3, height, width)).astype(np.float32)
        folded = patchify(frame, transform_config)
        assert folded.shape == ((height // 14) * (width // 14), transform_config.folded_patch_dim)
        theirs, grid_h, grid_w = reference_processor.patchify(torch.from_numpy(frame)[None], 14, 2, 2)
        assert (grid_h, grid_w) == (height // 14, width // 14)
        np.testing.assert_array_equal(unfold_temporal(folded, 2), theirs[0].numpy())


def test_smart_resize_in_graph_matches_transformers(transform_config: ImageTransformConfig) -> None:
    """The graph's integer/float64 arithmetic against transformers' Python, on 8000 sizes."""
    pipeline = Pipeline(batch_size=1000, num_threads=1, device_id=None, prefetch_queue_depth=1)
    with pipeline:
        sizes = fn.external_source(name="hw", dtype=types.INT64, ndim=1)
        pipeline.set_outputs(*smart_resize_nodes(sizes[0], sizes[1], transform_config))
    pipeline.build()
    rng = np.random.default_rng(0)
    factor = transform_config.resize_factor
    for round_index in range(8):
        heights = rng.integers(1, 8000, 1000)
        widths = np.clip((heights * np.exp(rng.uniform(-5, 5, 1000))).astype(np.int64), 1, 20000)
        if round_index == 0:  # exact half-way cases exercise round-half-to-even
            heights[:500] = factor // 2 * rng.integers(1, 300, 500)
            widths[:500] = factor // 2 * rng.integers(1, 300, 500)
        pipeline.feed_input("hw", [np.array(pair, dtype=np.int64) for pair in zip(heights, widths, strict=True)])
        out_h, out_w = pipeline.run()
        for i, (h, w) in enumerate(zip(heights.tolist(), widths.tolist(), strict=True)):
            if max(h, w) / min(h, w) > 200:
                continue
            expected = transformers_smart_resize(
                h, w, factor, transform_config.min_pixels, transform_config.max_pixels
            )
            assert (int(np.asarray(out_h[i])), int(np.asarray(out_w[i]))) == expected, (h, w)
            assert smart_resize(h, w, transform_config) == expected


# ---------------------------------------------------------------------------------------------
# Serialization and configuration
# ---------------------------------------------------------------------------------------------


def test_serialization_is_deterministic_across_processes(transform_config: ImageTransformConfig) -> None:
    here = serialize_pipeline(transform_config, "cpu")
    code = (
        "import sys; from python_backends.preprocess.image_pipeline import ImageTransformConfig, serialize_pipeline; "
        "sys.stdout.buffer.write(serialize_pipeline("
        f"ImageTransformConfig.from_dict({_config_dict(transform_config)!r}), 'cpu'))"
    )
    there = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, check=True, timeout=120
    ).stdout
    assert here == there
    assert str(REPO_ROOT).encode() not in here  # no source paths baked in


def test_gpu_target_uses_mixed_decoder_without_needing_a_gpu(transform_config: ImageTransformConfig) -> None:
    cpu = serialize_pipeline(transform_config, "cpu")
    gpu = serialize_pipeline(transform_config, "gpu")
    assert gpu == serialize_pipeline(transform_config, "gpu")
    assert b"mixed" in gpu and b"mixed" not in cpu
    assert b"jpeg_fancy_upsampling" in gpu  # nvJPEG chroma upsampling like libjpeg-turbo
    assert b"order_patches" in gpu and b"order_patches" not in cpu  # patch layout: graph vs numpy
    assert b"repeat_temporal" not in gpu  # folded: one temporal copy per row


def _config_dict(config: ImageTransformConfig) -> dict[str, object]:
    return {
        "patch_size": config.patch_size,
        "merge_size": config.merge_size,
        "temporal_patch_size": config.temporal_patch_size,
        "min_pixels": config.min_pixels,
        "max_pixels": config.max_pixels,
        "image_mean": list(config.image_mean),
        "image_std": list(config.image_std),
        "rescale_factor": config.rescale_factor,
    }


def test_config_reads_both_spellings_and_refuses_what_it_cannot_reproduce() -> None:
    hub = ImageTransformConfig.from_dict({"min_pixels": 100, "max_pixels": 1000})
    tf5 = ImageTransformConfig.from_dict({"size": {"shortest_edge": 100, "longest_edge": 1000}})
    assert hub == tf5 and (hub.min_pixels, hub.max_pixels) == (100, 1000)
    with pytest.raises(PreprocessConfigError, match="resample"):
        ImageTransformConfig.from_dict({"resample": 2})
    with pytest.raises(PreprocessConfigError, match="do_normalize"):
        ImageTransformConfig.from_dict({"do_normalize": False})
    with pytest.raises(PreprocessConfigError, match="min_pixels"):
        ImageTransformConfig.from_dict({"min_pixels": 10, "max_pixels": 5})


# ---------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------


def _invalid(preprocessor: DaliImagePreprocessor, items: list[bytes], match: str) -> EpdError:
    with pytest.raises(EpdError, match=match) as caught:
        preprocessor.preprocess(items)
    assert caught.value.code == ErrorCode.INVALID_ARG
    return caught.value


GOOD = encode(synthetic_rgb(64, 48, 0), "PNG")


@pytest.mark.parametrize(
    ("name", "make", "match"),
    [
        ("empty", lambda: b"", r"image\[0\] is empty"),
        ("random bytes", lambda: np.random.default_rng(0).bytes(1000), r"image\[0\] is neither"),
        ("header only jpeg", lambda: encode(synthetic_rgb(64, 48, 1), "JPEG")[:40], r"image\[0\]"),
        ("zero width png", zero_width_png, r"image\[0\] cannot be read"),
        ("gif", lambda: encode(synthetic_rgb(64, 48, 2), "GIF"), r"format not supported.*PNG"),
        ("too elongated", lambda: encode(synthetic_rgb(1000, 4, 3), "PNG"), r"aspect ratio above 200"),
        ("too many pixels", lambda: bilevel_png(5000, 5000), r"5000x5000.*above the limit"),
    ],
)
def test_bad_input_is_invalid_arg(
    preprocessor: DaliImagePreprocessor, name: str, make: Callable[[], bytes], match: str
) -> None:
    _invalid(preprocessor, [make()], match)


# "decoded": the header reads fine and DALI fails on the pixels; WebP's header check fails first.
@pytest.mark.parametrize(
    ("fmt", "stage"), [("JPEG", "decoded"), ("PNG", "decoded"), ("BMP", "decoded"), ("WEBP", "read")]
)
def test_truncated_image_names_its_index_and_pipeline_recovers(
    preprocessor: DaliImagePreprocessor, fmt: str, stage: str
) -> None:
    data = encode(synthetic_rgb(300, 200, 4), fmt)
    truncated = data[: len(data) * 2 // 3]
    _invalid(preprocessor, [GOOD, GOOD, truncated, GOOD], rf"image\[2\] cannot be {stage}")
    after = preprocessor.preprocess([GOOD])  # a failed batch leaves a working pipeline
    assert isinstance(after, PreprocessedImages) and after.image_grid_thw.shape == (1, 3)


# The memory is measured in a fresh process doing only this: in `make test` this process has
# already held vLLM engines and a transformers model, whose peak RSS would hide any growth.
BOMB_CHILD = """
import json, sys, time
from python_backends.preprocess.processor import ImageTransformConfig
from python_backends.errors import EpdError
from python_backends.preprocess.images import DaliImagePreprocessor
from tests.images import bilevel_png, synthetic_image

def kib(field):
    return int(next(line.split()[1] for line in open('/proc/self/status') if line.startswith(field + ':')))

preprocessor = DaliImagePreprocessor.for_config(ImageTransformConfig.from_file(sys.argv[1]), max_batch_size=8)
preprocessor.preprocess([synthetic_image(64, 48, 0, 'PNG')])  # the pipeline's own buffers exist first
bomb = bilevel_png(30000, 30000)
try:
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')  # peak RSS (VmHWM) := RSS now; without it the peak of the warm-up counts too
except OSError:
    pass
rss_before, started, error = kib('VmRSS'), time.perf_counter(), None
try:
    preprocessor.preprocess([bomb])
except EpdError as exc:
    error = [exc.code.value, exc.message]
print(json.dumps({'seconds': time.perf_counter() - started, 'grown_kib': kib('VmHWM') - rss_before, 'error': error}))
"""


def test_decompression_bomb_rejected_in_bounded_memory(preprocessor: DaliImagePreprocessor) -> None:
    bomb = bilevel_png(30000, 30000)  # 900 Mpx: ~1 GB as grayscale, 2.7 GB as RGB
    assert len(bomb) < 200_000
    started = time.perf_counter()
    _invalid(preprocessor, [bomb], r"image\[0\]")
    assert time.perf_counter() - started < 2.0
    child = subprocess.run(
        [sys.executable, "-c", BOMB_CHILD, str(build_default_model())],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=300,
    )
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["error"] is not None and report["error"][0] == ErrorCode.INVALID_ARG.value, report
    assert "max_image_pixels" in report["error"][1], report
    grown_mib = report["grown_kib"] / 1024
    assert grown_mib < 100, f"peak RSS grew by {grown_mib:.0f} MiB while refusing the bomb"


def test_batch_limits(preprocessor: DaliImagePreprocessor) -> None:
    _invalid(preprocessor, [], "no image")
    _invalid(preprocessor, [GOOD] * (preprocessor.limits.max_images + 1), "max_images")


def test_base64_input_gives_the_same_pixels(preprocessor: DaliImagePreprocessor) -> None:
    import base64

    raw = preprocessor.preprocess([GOOD])
    b64 = preprocessor.preprocess([base64.b64encode(GOOD)])
    np.testing.assert_array_equal(raw.pixel_values, b64.pixel_values)

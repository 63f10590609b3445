"""The cpu target's image preprocessing (python_backends/preprocess/torch_images.py) against
transformers' ``Qwen2VLImageProcessor``, which is what vLLM runs: BIT-EXACT, no tolerance.

The reference is fed what ``llm`` feeds it: the PIL image of
:func:`python_backends.request.images.decode_rgb` (EXIF orientation applied, ``convert("RGB")``).
Our output is temporally folded (``C*P*P`` per row); ``unfold_temporal`` gives the processor's
``C*T*P*P`` rows, which must be equal with ``np.array_equal``.
"""

from __future__ import annotations

import base64
import importlib.util
import io
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

from builders.default_model import build_default_model
from python_backends.encode.vit_onnx import unfold_temporal
from python_backends.errors import EpdError, ErrorCode
from python_backends.preprocess.processor import ImageTransformConfig, PreprocessedImages, smart_resize
from python_backends.preprocess.torch_images import (
    FusedNormalization,
    TorchImagePreprocessor,
    decode_image,
    image_tensor,
    intra_op_threads,
    normalize_folded,
    resize_image,
)
from python_backends.request.images import ImageLimits, decode_rgb
from tests.images import bilevel_png, header_only_png, rotated_jpeg, synthetic_image, zero_width_png

REPO_ROOT = Path(__file__).resolve().parents[2]
LIMITS = ImageLimits(max_images=64, max_image_bytes=64 * 1024 * 1024, max_image_pixels=4096 * 4096)


@pytest.fixture(scope="module")
def config() -> ImageTransformConfig:
    return ImageTransformConfig.from_file(build_default_model())


@pytest.fixture(scope="module")
def preprocessor(config: ImageTransformConfig) -> TorchImagePreprocessor:
    return TorchImagePreprocessor(config, LIMITS)


@pytest.fixture(scope="module")
def reference() -> Qwen2VLImageProcessor:
    return Qwen2VLImageProcessor.from_pretrained(str(build_default_model()))


def reference_outputs(processor: Qwen2VLImageProcessor, items: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """The processor on ``llm``'s decode of each image, all in one call (it groups by shape)."""
    images = [decode_rgb(data, i, LIMITS) for i, data in enumerate(items)]
    out = processor(images=images, return_tensors="np")
    return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])


def assert_bit_exact(ours: PreprocessedImages, processor: Qwen2VLImageProcessor, items: list[bytes], name: str) -> None:
    ref_pixels, ref_grid = reference_outputs(processor, items)
    np.testing.assert_array_equal(ours.image_grid_thw, ref_grid, err_msg=name)
    assert ours.image_grid_thw.dtype == np.int64 and ours.pixel_values.dtype == np.float32, name
    assert ours.pixel_values.shape == (ref_pixels.shape[0], ref_pixels.shape[1] // 2), name
    unfolded = unfold_temporal(ours.pixel_values, 2)
    if not np.array_equal(unfolded, ref_pixels):
        diff = np.abs(unfolded - ref_pixels)
        pytest.fail(f"{name}: {int((diff > 0).sum())} values differ, max {diff.max():.3g}")


# ---------------------------------------------------------------------------------------------
# Test images
# ---------------------------------------------------------------------------------------------


def noise_image(width: int, height: int, seed: int, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    """Uniform noise up to the borders: every pixel a hard edge, the worst case for rounding."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    picture = Image.fromarray(pixels)
    if mode != "RGB":
        picture = picture.convert(mode)
    buffer = io.BytesIO()
    picture.save(buffer, fmt)
    return buffer.getvalue()


def cmyk_jpeg(width: int, height: int, seed: int) -> bytes:
    picture = Image.open(io.BytesIO(synthetic_image(width, height, seed, "PNG"))).convert("CMYK")
    buffer = io.BytesIO()
    picture.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


# The sizes the brief names (512x512, 640x480, 1024x768, 1000x1000: the benchmark's 4 images),
# odd and tiny ones (upscaled), sizes already on the 28-grid, half-way rounding sizes, large
# ones (downscaled hard) and elongated ones up to the 200:1 limit.
SIZES: list[tuple[int, int]] = [
    (512, 512), (640, 480), (1024, 768), (1000, 1000),
    (1, 1), (2, 3), (13, 7), (28, 28), (29, 31), (55, 57), (56, 56), (99, 101), (100, 100),
    (448, 448), (480, 640), (300, 200), (200, 300), (333, 777), (1234, 567), (777, 1999),
    (42, 42), (70, 98), (126, 154),  # 1.5 x 28 multiples: round-half-to-even in smart_resize
    (1920, 1080), (1080, 1920),
    (28, 2000), (2000, 28), (50, 5000), (5000, 50), (10, 1999), (1999, 10),
]

CASES: list[tuple[str, Callable[[], bytes]]] = [
    *[(f"noise-{w}x{h}.png", (lambda w=w, h=h: noise_image(w, h, w * 31 + h))) for w, h in SIZES],
    *[(f"synthetic-{w}x{h}.jpeg", (lambda w=w, h=h: synthetic_image(w, h, w + h, "JPEG"))) for w, h in SIZES[:8]],
    ("640x480.webp", lambda: synthetic_image(640, 480, 1, "WEBP")),
    ("513x385.bmp", lambda: noise_image(513, 385, 2, "BMP")),
    ("401x299.tiff", lambda: noise_image(401, 299, 3, "TIFF")),
    ("320x240.gif", lambda: synthetic_image(320, 240, 4, "GIF")),
    ("noise-257x255.gif", lambda: noise_image(257, 255, 5, "GIF")),
    ("gray-500x375.png", lambda: synthetic_image(500, 375, 6, "PNG", mode="L")),
    ("gray-noise-333x222.jpeg", lambda: noise_image(333, 222, 7, "JPEG", mode="L")),
    ("palette-300x300.png", lambda: noise_image(300, 300, 8, "PNG", mode="P")),
    ("bilevel-120x90.png", lambda: noise_image(120, 90, 9, "PNG", mode="1")),
    ("rgba-400x300.png", lambda: synthetic_image(400, 300, 10, "PNG", mode="RGBA")),
    ("rgba-256x256.webp", lambda: synthetic_image(256, 256, 11, "WEBP", mode="RGBA")),
    ("la-200x150.png", lambda: noise_image(200, 150, 12, "PNG", mode="LA")),
    ("cmyk-640x480.jpeg", lambda: cmyk_jpeg(640, 480, 13)),
    ("exif-rotated-640x480.jpeg", lambda: rotated_jpeg(640, 480, 14)),
    ("exif-mirrored-300x500.jpeg", lambda: rotated_jpeg(300, 500, 15, orientation=2)),
    ("progressive-800x600.jpeg", lambda: _progressive_jpeg(800, 600, 16)),
    ("huge-4000x3000.jpeg", lambda: synthetic_image(4000, 3000, 17, "JPEG")),
]


def _progressive_jpeg(width: int, height: int, seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.open(io.BytesIO(synthetic_image(width, height, seed, "PNG"))).save(buffer, "JPEG", progressive=True)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# Bit-exact parity
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "make"), CASES, ids=[name for name, _ in CASES])
def test_bit_exact_with_the_processor(
    preprocessor: TorchImagePreprocessor, reference: Qwen2VLImageProcessor, name: str, make: Callable[[], bytes]
) -> None:
    data = make()
    assert_bit_exact(preprocessor.preprocess([data]), reference, [data], name)


def test_random_sizes_are_bit_exact(preprocessor: TorchImagePreprocessor, reference: Qwen2VLImageProcessor) -> None:
    """40 random sizes (aspect ratios up to ~50) in batches of 8: upscales, downscales, identity."""
    rng = np.random.default_rng(2024)
    heights = rng.integers(1, 1500, 40)
    widths = np.clip(heights * np.exp(rng.uniform(-3.5, 3.5, 40)), 1, 3000).astype(int)
    items = [noise_image(int(w), int(h), i) for i, (w, h) in enumerate(zip(widths, heights, strict=True))]
    for start in range(0, len(items), 8):
        batch = items[start : start + 8]
        assert_bit_exact(preprocessor.preprocess(batch), reference, batch, f"batch at {start}")


def test_a_batch_of_mixed_sizes_equals_one_by_one(preprocessor: TorchImagePreprocessor) -> None:
    items = [noise_image(w, h, w + h) for w, h in ((640, 480), (29, 31), (1000, 1000), (640, 480), (28, 2000))]
    items.append(synthetic_image(320, 240, 4, "GIF"))
    batch = preprocessor.preprocess(items)
    alone = [preprocessor.preprocess([item]) for item in items]
    np.testing.assert_array_equal(batch.image_grid_thw, np.concatenate([a.image_grid_thw for a in alone]))
    np.testing.assert_array_equal(batch.pixel_values, np.concatenate([a.pixel_values for a in alone]))
    assert batch.patch_counts() == [int(a.pixel_values.shape[0]) for a in alone]


def test_steps_compose_to_preprocess(
    preprocessor: TorchImagePreprocessor, config: ImageTransformConfig, reference: Qwen2VLImageProcessor
) -> None:
    """The step functions a benchmark times (decode, resize, normalize) give the same bytes."""
    data = noise_image(1024, 768, 3, "JPEG")
    image = decode_image(data, 0, LIMITS)
    resized = resize_image(image_tensor(image), config)
    assert tuple(resized.shape) == (3, *smart_resize(768, 1024, config)) and resized.dtype == torch.uint8
    folded = normalize_folded(resized, config, FusedNormalization.of(config))
    np.testing.assert_array_equal(folded, preprocessor.preprocess([data]).pixel_values)

    result, times = preprocessor.preprocess_timed([data, data])
    assert times.images == 2 and len(times.per_image) == 2
    assert times.decode_s > 0 and times.resize_s > 0 and times.normalize_s > 0
    assert times.total_s == pytest.approx(times.decode_s + times.resize_s + times.normalize_s)
    assert_bit_exact(result, reference, [data, data], "timed")


def test_fused_constants_are_the_processors(config: ImageTransformConfig, reference: Qwen2VLImageProcessor) -> None:
    norm = FusedNormalization.of(config)
    mean, std, do_rescale = reference._fuse_mean_std_and_rescale_factor(
        do_normalize=True,
        image_mean=tuple(reference.image_mean),
        image_std=tuple(reference.image_std),
        do_rescale=True,
        rescale_factor=reference.rescale_factor,
        device=torch.device("cpu"),
    )
    assert do_rescale is False
    assert torch.equal(norm.mean, mean) and torch.equal(norm.std, std)
    assert norm.mean.dtype == norm.std.dtype == torch.float32


def test_threads_are_restored_and_do_not_change_the_bytes(config: ImageTransformConfig) -> None:
    before = torch.get_num_threads()
    items = [noise_image(1000, 1000, 1), noise_image(640, 480, 2, "JPEG")]
    one = TorchImagePreprocessor(config, LIMITS, num_threads=1).preprocess(items)
    assert torch.get_num_threads() == before
    two = TorchImagePreprocessor(config, LIMITS, num_threads=2).preprocess(items)
    assert torch.get_num_threads() == before
    np.testing.assert_array_equal(one.pixel_values, two.pixel_values)
    with intra_op_threads(3):
        assert torch.get_num_threads() == 3
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="num_threads"):
        TorchImagePreprocessor(config, LIMITS, num_threads=0)


def test_base64_input_gives_the_same_pixels(preprocessor: TorchImagePreprocessor) -> None:
    data = noise_image(64, 48, 0)
    raw = preprocessor.preprocess([data])
    b64 = preprocessor.preprocess([base64.b64encode(data)])
    np.testing.assert_array_equal(raw.pixel_values, b64.pixel_values)
    np.testing.assert_array_equal(raw.image_grid_thw, b64.image_grid_thw)


# ---------------------------------------------------------------------------------------------
# Bad inputs: INVALID_ARG naming the image, all-or-nothing per call
# ---------------------------------------------------------------------------------------------

GOOD = noise_image(64, 48, 0)


def _invalid(preprocessor: TorchImagePreprocessor, items: list[bytes], match: str) -> EpdError:
    with pytest.raises(EpdError, match=match) as caught:
        preprocessor.preprocess(items)
    assert caught.value.code == ErrorCode.INVALID_ARG
    return caught.value


@pytest.mark.parametrize(
    ("name", "make", "match"),
    [
        ("empty", lambda: b"", r"image\[1\] is empty"),
        ("random bytes", lambda: np.random.default_rng(0).bytes(1000), r"image\[1\] is neither"),
        ("text", lambda: b"not an image", r"image\[1\] is neither"),
        ("base64 of text", lambda: base64.b64encode(b"hello world"), r"image\[1\] is neither"),
        ("header only jpeg", lambda: synthetic_image(64, 48, 1, "JPEG")[:40], r"image\[1\] cannot be"),
        ("header only png", lambda: header_only_png(640, 480), r"image\[1\] cannot be decoded"),
        ("zero width png", zero_width_png, r"image\[1\] cannot be read"),
        ("too elongated", lambda: noise_image(1000, 4, 3), r"image\[1\].*aspect ratio above 200"),
        ("too many pixels", lambda: bilevel_png(5000, 5000), r"image\[1\] is 5000x5000.*max_image_pixels"),
    ],
)
def test_bad_input_is_invalid_arg(
    preprocessor: TorchImagePreprocessor, name: str, make: Callable[[], bytes], match: str
) -> None:
    _invalid(preprocessor, [GOOD, make(), GOOD], match)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "BMP", "WEBP", "GIF", "TIFF"])
def test_truncated_image_names_its_index(preprocessor: TorchImagePreprocessor, fmt: str) -> None:
    data = noise_image(300, 200, 4, fmt)
    truncated = data[: len(data) * 2 // 3]
    _invalid(preprocessor, [GOOD, GOOD, truncated, GOOD], r"image\[2\] cannot be (decoded|read)")
    assert preprocessor.preprocess([GOOD]).image_grid_thw.shape == (1, 3)  # nothing left broken


def test_size_limits(config: ImageTransformConfig) -> None:
    data = noise_image(200, 100, 5)
    small = TorchImagePreprocessor(config, ImageLimits(max_images=2, max_image_bytes=len(data) - 1))
    error = _invalid(small, [data], r"image\[0\] has \d+ bytes, above the limit of \d+ \(max_image_bytes\)")
    assert str(len(data)) in error.message
    few_pixels = TorchImagePreprocessor(config, ImageLimits(max_images=2, max_image_pixels=200 * 100 - 1))
    _invalid(few_pixels, [GOOD, data], r"image\[1\] is 200x100 = 20000 pixels, above the limit .*max_image_pixels")
    _invalid(small, [GOOD] * 3, r"3 images given, above the limit of 2 \(max_images\)")
    _invalid(small, [], "no image given")
    assert TorchImagePreprocessor(config, ImageLimits(max_image_pixels=200 * 100)).preprocess([data])


def test_decompression_bomb_is_refused_from_its_header(preprocessor: TorchImagePreprocessor) -> None:
    import time

    bomb = bilevel_png(30000, 30000)  # 900 Mpx, ~110 kB on the wire
    started = time.perf_counter()
    _invalid(preprocessor, [GOOD, bomb], r"image\[1\].*max_image_pixels")
    assert time.perf_counter() - started < 1.0


def test_every_header_is_checked_before_any_decode(
    preprocessor: TorchImagePreprocessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad header anywhere fails the call before a single image is decoded (bombs and
    oversized images cost nothing even behind good ones)."""
    import python_backends.preprocess.torch_images as torch_images

    decoded: list[int] = []
    real = torch_images.decode_rgb

    def counting(data: bytes, index: int, limits: ImageLimits) -> Image.Image:
        decoded.append(index)
        return real(data, index, limits)

    monkeypatch.setattr(torch_images, "decode_rgb", counting)
    _invalid(preprocessor, [GOOD, GOOD, b""], r"image\[2\] is empty")
    assert decoded == []


# ---------------------------------------------------------------------------------------------
# The preprocess model's choice of backend
# ---------------------------------------------------------------------------------------------


def test_the_preprocess_model_picks_its_backend_by_parameter(config: ImageTransformConfig, tmp_path: Path) -> None:
    from python_backends import contract
    from python_backends.preprocess.image_pipeline import write_pipeline
    from python_backends.preprocess.images import DaliImagePreprocessor
    from python_backends.runtime.model_params import ModelParameters

    source = REPO_ROOT / "model_repository" / "preprocess" / "1" / "model.py"
    spec = importlib.util.spec_from_file_location("preprocess_model", source)
    assert spec is not None and spec.loader is not None
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)  # Triton's utils: the unit tests' stub (conftest.py)

    write_pipeline(tmp_path / "1" / contract.DALI_FILE, config, "cpu", max_batch_size=4)
    args = {"model_repository": str(tmp_path), "model_version": "1", "model_name": "preprocess"}

    def chosen(backend: str | None) -> object:
        values = {contract.DALI_NUM_THREADS: "1"} | ({contract.IMAGE_BACKEND: backend} if backend else {})
        return model._preprocessor(
            ModelParameters("preprocess", values).string(contract.IMAGE_BACKEND),
            args, ModelParameters("preprocess", values), config, LIMITS, 4,
        )

    threads = torch.get_num_threads()
    try:
        assert isinstance(chosen(None), TorchImagePreprocessor)  # the contract's default
        assert isinstance(chosen("torchvision"), TorchImagePreprocessor)
        assert torch.get_num_threads() == 1  # set once for the stub's process
    finally:
        torch.set_num_threads(threads)
    dali = chosen("dali")
    assert isinstance(dali, DaliImagePreprocessor)
    assert dali.preprocess([GOOD]).pixel_values.shape == (16, config.folded_patch_dim)
    with pytest.raises(ValueError, match="image_backend.*'nvjpeg'.*torchvision, dali"):
        chosen("nvjpeg")


def test_the_preprocess_model_serves_a_requests_images_or_the_dali_interface(
    config: ImageTransformConfig, tmp_path: Path
) -> None:
    """``max_batch_size`` 0 (the cpu target's config): a request's BYTES images, rows concatenated,
    none -> empty outputs; a batched config (the gpu target's DALI interface, served with this file
    by tests/server/test_gpu_topology.py): one image per UINT8 batch row."""
    from python_backends import contract
    from python_backends.preprocess.stage import PixelBatch
    from python_backends.runtime.model_params import ModelParameters

    source = REPO_ROOT / "model_repository" / "preprocess" / "1" / "model.py"
    spec = importlib.util.spec_from_file_location("preprocess_model", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # Triton's utils: the unit tests' stub (conftest.py)
    parameters = {
        contract.PREPROCESSOR_CONFIG: str(build_default_model() / "preprocessor_config.json"),
        contract.MAX_IMAGES_PER_REQUEST: "3",
    }
    args = {"model_repository": str(tmp_path), "model_version": "1", "model_name": "preprocess"}

    def served(max_batch_size: int) -> object:
        model = module.TritonPythonModel()
        model.config = {"max_batch_size": max_batch_size}
        model.params = ModelParameters("preprocess", parameters)
        model.setup(args)  # what initialize calls, once the config and parameters are read
        return model

    other = noise_image(120, 200, 1)
    threads = torch.get_num_threads()
    try:
        model = served(0)
        images = np.array([GOOD, other], dtype=np.object_)
        two, none, absent, too_many = model.run(
            [{contract.IMAGE: images}, {contract.IMAGE: images[:0]}, {}, {contract.IMAGE: np.array([GOOD] * 4, object)}]
        )
        alone = [TorchImagePreprocessor(config).preprocess([image]) for image in (GOOD, other)]
        np.testing.assert_array_equal(two[contract.PIXEL_VALUES], np.concatenate([a.pixel_values for a in alone]))
        np.testing.assert_array_equal(two[contract.IMAGE_GRID_THW], np.concatenate([a.image_grid_thw for a in alone]))
        for empty in (none, absent):
            assert empty[contract.PIXEL_VALUES].shape == (0, config.folded_patch_dim)
            assert empty[contract.IMAGE_GRID_THW].shape == (0, 3)
        assert isinstance(too_many, EpdError) and "above the limit of 3" in too_many.message
        batched = served(8)
        (row,) = batched.run([{contract.IMAGE: np.frombuffer(GOOD, np.uint8)[None]}])
        assert row[contract.PIXEL_VALUES].shape == (1, *alone[0].pixel_values.shape)  # [b, patches, row]
        assert isinstance(batched.stage.run([[GOOD]])[0], PixelBatch)
    finally:
        torch.set_num_threads(threads)

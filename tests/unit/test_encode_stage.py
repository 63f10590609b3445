"""The request-level logic of the cpu preprocess and vit_encoder models
(python_backends/preprocess/stage.py, python_backends/encode/stage.py).

Not batched (the cpu target): a request's 0..N images in one preprocessor call, rows
concatenated (images of different sizes share a request), all or nothing with errors naming
``image[i]``; the encoder answers every image's tokens concatenated, ``[1, tokens, hidden]``.
The DALI backend's batched interface (the gpu target's, which the same model.py serves when its
config batches): every request of a dynamic batch in one run, results back in order, a bad request
fails alone. The preprocess side runs with both image backends."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from builders.default_model import build_default_model
from python_backends.encode.stage import EncoderProvenance, EncoderStage
from python_backends.encode.vit_onnx import EncoderCall, VisionShape, encoder_calls
from python_backends.errors import EpdError, ErrorCode
from python_backends.preprocess.images import DaliImagePreprocessor
from python_backends.preprocess.processor import ImageTransformConfig, PreprocessedImages
from python_backends.preprocess.stage import (
    ImagePreprocessor,
    PixelBatch,
    PreprocessStage,
    RequestPreprocess,
    encoded_images,
    request_images,
)
from python_backends.preprocess.torch_images import TorchImagePreprocessor
from python_backends.request.images import ImageLimits
from python_backends.runtime.model_params import ModelParameters


def png(width: int, height: int, seed: int, fmt: str = "PNG") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt)
    return buffer.getvalue()


class CountingPreprocessor:
    """A real preprocessor (torchvision or DALI), counting its runs."""

    def __init__(self, inner: ImagePreprocessor) -> None:
        self.inner = inner
        self.calls: list[int] = []

    @property
    def limits(self) -> ImageLimits:
        return self.inner.limits

    def validate(self, item: bytes, index: int) -> bytes:
        return self.inner.validate(item, index)

    def preprocess(self, items):
        self.calls.append(len(items))
        return self.inner.preprocess(items)


@pytest.fixture(scope="module")
def transform_config() -> ImageTransformConfig:
    return ImageTransformConfig.from_file(build_default_model())


@pytest.fixture(scope="module")
def dali_preprocessor(transform_config: ImageTransformConfig) -> DaliImagePreprocessor:
    return DaliImagePreprocessor.for_config(transform_config, limits=ImageLimits(max_images=4), max_batch_size=4)


@pytest.fixture(scope="module")
def torch_preprocessor(transform_config: ImageTransformConfig) -> TorchImagePreprocessor:
    return TorchImagePreprocessor(transform_config, limits=ImageLimits(max_images=4))


@pytest.fixture(params=["torchvision", "dali"])
def preprocessor(request: pytest.FixtureRequest) -> ImagePreprocessor:
    """Each image backend of the preprocess model in turn."""
    return request.getfixturevalue(f"{'torch' if request.param == 'torchvision' else 'dali'}_preprocessor")


@pytest.fixture
def counting(preprocessor: ImagePreprocessor) -> CountingPreprocessor:
    return CountingPreprocessor(preprocessor)


def _alone(preprocessor: ImagePreprocessor, images: list[bytes]) -> PreprocessedImages:
    return preprocessor.preprocess(images)


def _error(result: object, fragment: str) -> None:
    assert isinstance(result, EpdError), result
    assert result.code == ErrorCode.INVALID_ARG and fragment in result.message, result.message


# ---------------------------------------------------------------------------------------------
# Not batched (the cpu target's preprocess): one request's images
# ---------------------------------------------------------------------------------------------


def _strings(*items: bytes) -> np.ndarray:
    return np.array(list(items), dtype=np.object_).reshape(len(items))  # BYTES [n], as Triton hands it


def test_a_requests_images_of_different_sizes_are_concatenated_in_order(
    counting: CountingPreprocessor, preprocessor: ImagePreprocessor, transform_config: ImageTransformConfig
) -> None:
    a, b, c = png(64, 48, 1), png(200, 120, 2, "JPEG"), png(33, 90, 3)
    stage = RequestPreprocess(counting, transform_config.folded_patch_dim)
    (result,) = stage.run_tensors([_strings(a, b, base64.b64encode(c))])  # raw bytes or base64
    assert isinstance(result, PreprocessedImages)
    assert counting.calls == [3]  # one preprocessor call for the request
    alone = [_alone(preprocessor, [image]) for image in (a, b, c)]
    np.testing.assert_array_equal(result.pixel_values, np.concatenate([x.pixel_values for x in alone]))
    np.testing.assert_array_equal(result.image_grid_thw, np.concatenate([x.image_grid_thw for x in alone]))
    assert result.pixel_values.shape[1] == transform_config.folded_patch_dim
    assert len({tuple(g) for g in result.image_grid_thw.tolist()}) == 3  # three grids in one request


def test_no_image_gives_empty_outputs(counting: CountingPreprocessor, transform_config: ImageTransformConfig) -> None:
    stage = RequestPreprocess(counting, transform_config.folded_patch_dim)
    for result in stage.run_tensors([None, _strings()]):  # absent, or shape [0]
        assert isinstance(result, PreprocessedImages)
        assert result.pixel_values.shape == (0, transform_config.folded_patch_dim)
        assert result.pixel_values.dtype == np.float32
        assert result.image_grid_thw.shape == (0, 3) and result.image_grid_thw.dtype == np.int64
    assert counting.calls == []


def test_a_bad_image_fails_its_request_naming_its_index(
    counting: CountingPreprocessor, transform_config: ImageTransformConfig
) -> None:
    good = png(64, 48, 1)
    truncated = png(300, 200, 4, "JPEG")[:2000]  # header fine, pixels cut: found when decoded
    stage = RequestPreprocess(counting, transform_config.folded_patch_dim)
    results = stage.run_tensors(
        [
            _strings(good, b""),
            _strings(good, good, truncated),
            _strings(b"not an image"),
            np.frombuffer(good, np.uint8)[None],  # the DALI interface's UINT8 rows: not this model's
            _strings(good),
        ]
    )
    _error(results[0], "image[1] is empty")
    _error(results[1], "image[2] cannot be decoded")
    _error(results[2], "image[0] is neither")
    _error(results[3], "must be BYTES")
    assert isinstance(results[4], PreprocessedImages)


def test_more_images_than_max_images_per_request_are_refused(transform_config: ImageTransformConfig) -> None:
    image = png(40, 40, 1)
    limited = TorchImagePreprocessor(transform_config, limits=ImageLimits(max_images=3))
    stage = RequestPreprocess(limited, transform_config.folded_patch_dim)
    ok, refused = stage.run_tensors([_strings(*[image] * 3), _strings(*[image] * 4)])
    assert isinstance(ok, PreprocessedImages) and ok.image_grid_thw.shape == (3, 3)
    _error(refused, "4 images in one request, above the limit of 3 (max_images_per_request)")
    assert request_images(None, 3) == [] and request_images(_strings(b"a", b"b"), 3) == [b"a", b"b"]


# ---------------------------------------------------------------------------------------------
# Batched (the DALI backend's interface: one image per batch row)
# ---------------------------------------------------------------------------------------------


def test_requests_of_different_sizes_share_one_run(
    counting: CountingPreprocessor, preprocessor: ImagePreprocessor
) -> None:
    a, b, c = png(64, 48, 1), png(200, 120, 2, "JPEG"), png(33, 90, 3)
    results = PreprocessStage(counting).run([[a], [b], [c]])
    assert counting.calls == [3]
    for image, result in zip((a, b, c), results, strict=True):
        assert isinstance(result, PixelBatch)
        alone = _alone(preprocessor, [image])
        np.testing.assert_array_equal(result.pixel_values[0], alone.pixel_values)
        np.testing.assert_array_equal(result.image_grid_thw, alone.image_grid_thw)
        assert result.pixel_values.shape == (1, *alone.pixel_values.shape)


def test_several_images_of_one_size_in_one_request(counting: CountingPreprocessor) -> None:
    a, b = png(64, 48, 1), png(64, 48, 2)
    (result,) = PreprocessStage(counting).run([[a, b]])
    assert isinstance(result, PixelBatch)
    assert result.pixel_values.shape[0] == 2 and result.image_grid_thw.tolist() == [[1, 4, 4]] * 2
    assert not np.array_equal(result.pixel_values[0], result.pixel_values[1])


def test_images_of_different_sizes_in_one_request_fail_that_request_only(counting: CountingPreprocessor) -> None:
    results = PreprocessStage(counting).run([[png(64, 48, 1), png(300, 300, 2)], [png(64, 48, 3)]])
    _error(results[0], "same grid")
    assert isinstance(results[1], PixelBatch)


def test_a_bad_request_fails_alone(counting: CountingPreprocessor) -> None:
    good = png(64, 48, 1)
    truncated = png(300, 200, 4, "JPEG")[:2000]  # header fine, pixels cut: found when decoded
    results = PreprocessStage(counting).run([[good], [b""], [good, truncated], [b"not an image"], [good]])
    assert isinstance(results[0], PixelBatch) and isinstance(results[4], PixelBatch)
    _error(results[1], "image[0] is empty")
    _error(results[2], "image[1] cannot be decoded")  # the index within its own request
    _error(results[3], "image[0] is neither")
    # Header checks keep two bad requests out of the run; the decode failure costs a retry.
    assert counting.calls[0] == 4


def test_folded_rows_and_formats_follow_the_backend(
    preprocessor: ImagePreprocessor, transform_config: ImageTransformConfig
) -> None:
    """Rows are folded (C*P*P) with either backend; GIF is decoded by PIL (torchvision backend,
    as ``llm`` decodes it) and refused by name where DALI cannot decode it."""
    (still,) = PreprocessStage(preprocessor).run([[png(64, 48, 1)]])
    assert isinstance(still, PixelBatch) and still.pixel_values.shape == (1, 16, transform_config.folded_patch_dim)
    (gif,) = PreprocessStage(preprocessor).run([[png(64, 48, 5, "GIF")]])
    if isinstance(preprocessor, TorchImagePreprocessor):
        assert isinstance(gif, PixelBatch) and gif.image_grid_thw.tolist() == [[1, 4, 4]]
    else:
        _error(gif, "format not supported")


def test_more_images_than_one_run_takes_are_split(counting: CountingPreprocessor) -> None:
    requests = [[png(40 + i, 40, i)] for i in range(6)] + [[png(64, 48, 9)] * 3]
    results = PreprocessStage(counting).run(requests)
    assert all(isinstance(r, PixelBatch) for r in results)
    assert max(counting.calls) <= counting.limits.max_images and sum(counting.calls) == 9


def test_tensor_inputs_are_parsed_per_request(counting: CountingPreprocessor) -> None:
    good = np.frombuffer(png(64, 48, 1), dtype=np.uint8)[None]
    results = PreprocessStage(counting).run_tensors(
        [good, np.zeros((1, 0), np.uint8), good.astype(np.int32), None, good[0]]
    )
    assert isinstance(results[0], PixelBatch) and isinstance(results[4], PixelBatch)
    _error(results[1], "image[0] is empty")
    _error(results[2], "must be uint8")
    _error(results[3], "required")


def test_encoded_images_rows() -> None:
    assert encoded_images(np.array([[1, 2], [3, 4]], np.uint8)) == [b"\x01\x02", b"\x03\x04"]
    with pytest.raises(EpdError, match="no image"):
        encoded_images(np.zeros((0, 5), np.uint8))
    with pytest.raises(EpdError, match=r"\[images, bytes\]"):
        encoded_images(np.zeros((1, 2, 3), np.uint8))


# ---------------------------------------------------------------------------------------------
# Encoder stage
# ---------------------------------------------------------------------------------------------


class FakeEncoder:
    """Per merged token: the mean of its merge**2 patch rows (routing is what is tested)."""

    merge_size, patch_dim, hidden_size = 2, 6, 6
    shape = VisionShape(merge_size=2, patch_dim=6, temporal_patch_size=2, hidden_size=6)

    def __init__(self) -> None:
        self.calls: list[int] = []  # images per run_all

    def run_all(self, calls: list[EncoderCall]) -> list[np.ndarray]:
        self.calls.append(len(calls))
        block = self.merge_size**2
        return [call.pixel_values.reshape(-1, block, self.patch_dim).mean(axis=1) for call in calls]

    def encode(self, pixel_values: np.ndarray, image_grid_thw: np.ndarray) -> list[np.ndarray]:
        return self.run_all(encoder_calls(pixel_values, image_grid_thw, self.shape))


def _pixels(images: int, grid: tuple[int, int, int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``images`` images of one grid as vit_encoder takes them: rows concatenated, [rows, 6]."""
    patches = grid[0] * grid[1] * grid[2]
    pixels = np.random.default_rng(seed).standard_normal((images * patches, 6)).astype(np.float32)
    return pixels, np.array([grid] * images, dtype=np.int64).reshape(-1, 3)


def _request(*parts: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """One request of several images of different grids."""
    return np.concatenate([p for p, _ in parts]), np.concatenate([g for _, g in parts])


def test_encoder_runs_every_image_of_every_request_and_concatenates_per_request() -> None:
    encoder = FakeEncoder()
    mixed = _request(_pixels(1, (1, 4, 6), 2), _pixels(1, (1, 2, 2), 4), _pixels(1, (1, 8, 2), 5))
    requests = [_pixels(1, (1, 2, 2), 1), mixed, _pixels(2, (1, 8, 2), 3)]
    results = EncoderStage(encoder).run(requests)
    assert encoder.calls == [6]  # every image of every request in one run, one call each
    for (pixels, grid), result in zip(requests, results, strict=True):
        assert isinstance(result, np.ndarray)
        expected = np.concatenate(FakeEncoder().encode(pixels, grid))
        assert result.shape == (1, len(pixels) // 4, 6)  # [1, every image's tokens, hidden]
        np.testing.assert_array_equal(result[0], expected)


def test_encoder_answers_no_image_with_no_tokens() -> None:
    encoder = FakeEncoder()
    (result,) = EncoderStage(encoder).run([(np.zeros((0, 3), np.float32), np.zeros((0, 3), np.int64))])
    assert isinstance(result, np.ndarray) and result.shape == (1, 0, 6) and result.dtype == np.float32
    assert encoder.calls == []


def test_encoder_rejects_inconsistent_requests_alone() -> None:
    encoder = FakeEncoder()
    good = _pixels(1, (1, 2, 2), 1)
    pixels, _ = _pixels(1, (1, 2, 2), 2)
    results = EncoderStage(
        encoder
    ).run(
        [
            good,
            (pixels, np.array([[1, 4, 4]])),  # grid needs 16 patches, 4 given
            (pixels, np.array([[1, 1, 4]])),  # not a multiple of merge_size
            (pixels[..., :5], np.array([[1, 2, 2]])),  # wrong patch width
            (pixels[None], np.array([[1, 2, 2]])),  # an image dimension: not this model's shapes
            (pixels, np.array([[1, 2, 2], [1, 2, 2]])),  # two grids, one image's rows
            (pixels, np.zeros((0, 3), np.int64)),  # rows but no image
            good,
        ]
    )
    assert isinstance(results[0], np.ndarray) and isinstance(results[7], np.ndarray)
    _error(results[1], "image_grid_thw needs 16 rows")
    _error(results[2], "multiples of 2")
    _error(results[3], "the encoder takes 6")
    _error(results[4], "[rows, width] and [images, 3]")
    _error(results[5], "image_grid_thw needs 8 rows")
    _error(results[6], "image_grid_thw has no image")
    assert encoder.calls == [2]


def test_encoder_with_only_bad_requests_never_runs() -> None:
    encoder = FakeEncoder()
    pixels, _ = _pixels(1, (1, 2, 2), 2)
    (result,) = EncoderStage(encoder).run([(pixels, np.array([[0, 2, 2]]))])
    _error(result, "positive")
    assert encoder.calls == []


def test_provenance_from_parameters() -> None:
    values = {
        "vision_shards": "1",
        "checkpoint_shards": "2",
        "vision_weight_bytes": "10",
        "checkpoint_weight_bytes": "30",
    }
    params = ModelParameters("vit_encoder", {**values, "patch_dim": "6", "hidden_size": "6", "merge_size": "2"})
    provenance = EncoderProvenance.from_parameters(params)
    provenance.check(FakeEncoder(), params)
    text = provenance.describe("model.onnx", 3.5, 0.25)
    assert "1 of 2 checkpoint shard files" in text and "10 of 30" in text
    with pytest.raises(ValueError, match="hidden_size=6, the config says 8"):
        provenance.check(
            FakeEncoder(), ModelParameters("vit_encoder", {"patch_dim": "6", "hidden_size": "8", "merge_size": "2"})
        )
    with pytest.raises(ValueError, match=r"\['vision_shards'\] are missing"):
        EncoderProvenance.from_parameters(
            ModelParameters("vit_encoder", {k: v for k, v in values.items() if k != "vision_shards"})
        )

"""The DALI video path (CPU decoder) against vLLM's own video loading + transformers' processor.

Reference (what the ``llm`` model does with raw video bytes): vLLM's ``Qwen2VLVideoBackend``
(OpenCV decode, fps sampling; :mod:`python_backends.video` says what it does) and
transformers' ``Qwen2VLVideoProcessor`` loaded from the checkpoint.

Frame indices and ``video_grid_thw``: equal, always.

Pixels: two comparisons, because the decoders convert YUV to RGB differently.
- Same decoded frames, our transform (``decoded_like_dali``): the clip decoded to YUV by PyAV,
  converted as DALI's decoder does (BT.601 limited range, chroma upsampled bilinearly, float
  maths; 0.004 levels mean from DALI's own frames), then transformers' processor. This
  isolates resize + normalize + patch layout, and it holds the image path's documented
  tolerance (tests/unit/test_preprocess_parity.py): <= 10 levels anywhere (border band), mean
  <= 0.25 level.
- Against vLLM's frames: OpenCV converts with swscale's fast fixed-point path, which
  upsamples chroma by nearest neighbour and rounds differently (~1 level mean on identical
  YUV). The image tolerance does NOT hold there: measured mean 0.8-1.7 levels, max up to ~45
  levels where the picture has sharp edges (chroma of a sharp edge is a 2x2 block in OpenCV
  and a ramp in DALI; lossy codecs smear chroma around sharp luma edges too). The bounds
  below (VLLM_*) are those measurements with a margin, so a regression (a wrong frame, a
  swapped channel, another filter) still fails; they are not a claim of equality.
"""

from __future__ import annotations

import io

import av
import cv2
import numpy as np
import pytest
import torch
from transformers import AutoVideoProcessor
from vllm.multimodal.video import Qwen2VLVideoBackend
from vllm.multimodal.video_decoders import VideoSourceMetadata, VideoTargetMetadata
from vllm.multimodal.video_decoders.opencv import OpenCVVideoBackendMixin

from builders.default_model import build_default_model
from python_backends.dali_video import VideoTransformConfig
from python_backends.errors import EpdError, ErrorCode
from python_backends.video import (
    VideoLimits,
    VideoSamplingConfig,
    probe_video,
    sample_frame_indices,
    torch_arange_float32,
)
from python_backends.video_preprocess import DaliVideoPreprocessor, patchify_video
from tests.videos import ClipSpec, make_clip

LEVEL = 1 / (255 * 0.26130258)  # one uint8 step after normalisation, smallest std (G)
IMAGE_MAX_TOLERANCE = 10 * LEVEL  # the image path's border-band bound
IMAGE_MEAN_TOLERANCE = 0.25 * LEVEL
VLLM_MAX_TOLERANCE = 60 * LEVEL  # measured <= 45 levels (see the module docstring)
VLLM_MEAN_TOLERANCE = 2.5 * LEVEL  # measured <= 1.7 levels

# >= 8 clips over the ranges: 1-20 s, 5-60 fps, 64x64 to 1280x720, every CPU codec.
CLIPS: tuple[ClipSpec, ...] = (
    ClipSpec("vp8", 64, 64, 5, 1.0, seed=1),
    ClipSpec("vp9", 160, 120, 10, 2.0, seed=2),
    ClipSpec("mjpeg", 320, 240, 30, 3.0, seed=3),
    ClipSpec("vp9", 640, 360, 60, 1.5, seed=4),
    ClipSpec("vp8", 1280, 720, 25, 1.0, seed=5),
    ClipSpec("vp9", 96, 200, 24, 4.0, seed=6),
    ClipSpec("mjpeg", 176, 144, 5, 20.0, seed=7),
    ClipSpec("vp8", 320, 180, 15, 10.0, seed=8),
    ClipSpec("vp9", 256, 256, 30, 7.0, seed=9),
    ClipSpec("mjpeg", 1280, 720, 5, 2.0, seed=10),
)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(build_default_model())


@pytest.fixture(scope="module")
def transform(model_dir: str) -> VideoTransformConfig:
    return VideoTransformConfig.from_file(model_dir)


@pytest.fixture(scope="module")
def preprocessor(transform: VideoTransformConfig) -> DaliVideoPreprocessor:
    return DaliVideoPreprocessor.for_config(transform, limits=VideoLimits(max_videos=16), max_batch_size=4)


@pytest.fixture(scope="module")
def hf_processor(model_dir: str):  # type: ignore[no-untyped-def]
    processor = AutoVideoProcessor.from_pretrained(model_dir)
    assert type(processor).__name__ == "Qwen2VLVideoProcessor"
    return processor


@pytest.fixture(scope="module")
def clips() -> list[bytes]:
    return [make_clip(spec) for spec in CLIPS]


# ---------------------------------------------------------------------------------------------
# Sampling and probing: exact
# ---------------------------------------------------------------------------------------------


def _vllm_indices(total: int, fps: float, config: VideoSamplingConfig) -> list[int] | None:
    source = VideoSourceMetadata(total_frames_num=total, original_fps=fps, duration=total / fps)
    target = VideoTargetMetadata(num_frames=-1, fps=config.fps, max_duration=300)
    kwargs = {k: v for k, v in config.loader_kwargs().items() if k != "fps"}
    try:
        return Qwen2VLVideoBackend.compute_frames_index_to_sample(source, target, **kwargs)
    except ZeroDivisionError:  # vLLM fails on clips with fewer frames than temporal_patch_size
        return None


@pytest.mark.parametrize(
    "config",
    [
        VideoSamplingConfig(),
        VideoSamplingConfig(fps=1.0, max_frames=32),
        VideoSamplingConfig(fps=4.5, min_frames=2, max_frames=64),
        VideoSamplingConfig(fps=60.0),  # vLLM caps fps at 30
    ],
)
def test_frame_indices_equal_vllm_sampler(config: VideoSamplingConfig) -> None:
    checked = 0
    for fps in (5.0, 10.0, 23.976023976023978, 25.0, 29.97002997002997, 30.0, 59.94, 60.0):
        for total in (*range(1, 300), *range(300, 40000, 311)):
            expected = _vllm_indices(total, fps, config)
            if expected is None:
                with pytest.raises(EpdError):
                    sample_frame_indices(total, fps, config)
                continue
            assert sample_frame_indices(total, fps, config) == expected, (total, fps)
            checked += 1
    assert checked > 3000


def test_arange_equals_torch_here() -> None:
    """The float32 arange the sampler reproduces, against torch on this machine: every
    (total, n) the sampler can ask for up to 400 frames, and 4000 random ones up to 60000."""
    rng = np.random.default_rng(0)
    cases = [(total, n) for total in range(2, 400) for n in range(2, min(total, 768) + 1, 2)]
    cases += [
        (int(t), int(n) * 2) for t, n in zip(rng.integers(400, 60000, 4000), rng.integers(1, 385, 4000), strict=True)
    ]
    for total, n in cases:
        expected = torch.arange(0, total, total / n).int().numpy()
        np.testing.assert_array_equal(
            torch_arange_float32(total, total / n).astype(np.int32), expected, str((total, n))
        )


def test_probe_equals_vllm_metadata(clips: list[bytes]) -> None:
    for spec, data in zip(CLIPS, clips, strict=True):
        probe = probe_video(data, 0)
        cap = OpenCVVideoBackendMixin.open_video_capture(data)
        meta = OpenCVVideoBackendMixin.get_video_metadata(cap)
        assert (probe.total_frames, probe.fps) == (meta.total_frames_num, meta.original_fps), spec.name
        assert (probe.width, probe.height, probe.codec) == (spec.width, spec.height, spec.codec), spec.name


# ---------------------------------------------------------------------------------------------
# Pixels
# ---------------------------------------------------------------------------------------------


def decoded_like_dali(data: bytes, indices: list[int]) -> np.ndarray:
    """[F, H, W, 3] uint8: PyAV's YUV planes converted the way DALI's decoder converts."""
    frames = []
    with av.open(io.BytesIO(data)) as container:
        for index, frame in enumerate(container.decode(video=0)):
            if index in indices:
                frames.append((index, _yuv_to_rgb_bilinear(frame)))
    by_index = dict(frames)
    return np.stack([by_index[i] for i in indices])


def _yuv_to_rgb_bilinear(frame: av.VideoFrame) -> np.ndarray:
    height, width = frame.height, frame.width
    planes = frame.reformat(format="yuv420p").to_ndarray()  # jpeg range kept as is for MJPEG
    y = planes[:height].astype(np.float64)
    chroma = planes[height:].reshape(2, height // 2, width // 2)
    u, v = (
        cv2.resize(c.astype(np.float32), (width, height), interpolation=cv2.INTER_LINEAR).astype(np.float64)
        for c in chroma
    )
    full_range = frame.format.name == "yuvj420p"
    if full_range:
        luma, cb, cr = y, u - 128, v - 128
    else:
        luma, cb, cr = (y - 16) * 255 / 219, (u - 128) * 255 / 224, (v - 128) * 255 / 224
    red = luma + 1.402 * cr
    blue = luma + 1.772 * cb
    green = (luma - 0.299 * red - 0.114 * blue) / 0.587
    return np.clip(np.round(np.stack([red, green, blue], -1)), 0, 255).astype(np.uint8)


def test_frame_parity_with_vllm(  # type: ignore[no-untyped-def]
    preprocessor: DaliVideoPreprocessor, hf_processor, clips: list[bytes]
) -> None:
    """>= 8 clips: frame indices and grids equal vLLM's; pixels within the bounds above."""
    assert len(CLIPS) >= 8
    result = preprocessor.preprocess(clips)  # batches of 4 videos of mixed sizes
    offsets = np.cumsum([0, *result.patch_counts()])
    report = []
    for index, (spec, data) in enumerate(zip(CLIPS, clips, strict=True)):
        frames, metadata = Qwen2VLVideoBackend.load_bytes(data)
        reference = hf_processor(videos=[frames], return_tensors="np")
        assert result.frame_indices[index] == metadata["frames_indices"], spec.name
        assert result.video_grid_thw[index].tolist() == reference["video_grid_thw"][0].tolist(), spec.name
        ours = result.pixel_values_videos[offsets[index] : offsets[index + 1]]
        theirs = np.asarray(reference["pixel_values_videos"])
        assert ours.shape == theirs.shape and ours.dtype == np.float32, spec.name

        vllm_diff = np.abs(ours - theirs)
        same_frames = hf_processor(videos=[decoded_like_dali(data, result.frame_indices[index])], return_tensors="np")
        transform_diff = np.abs(ours - np.asarray(same_frames["pixel_values_videos"]))
        report.append(
            f"{spec.name}: frames {result.frame_indices[index]} grid {result.video_grid_thw[index].tolist()} | "
            f"same frames: max {transform_diff.max() / LEVEL:.2f} mean {transform_diff.mean() / LEVEL:.3f} levels | "
            f"vs vLLM: max {vllm_diff.max() / LEVEL:.1f} mean {vllm_diff.mean() / LEVEL:.2f} levels"
        )
        assert transform_diff.max() <= IMAGE_MAX_TOLERANCE, report[-1]
        assert transform_diff.mean() <= IMAGE_MEAN_TOLERANCE, report[-1]
        assert vllm_diff.max() <= VLLM_MAX_TOLERANCE, report[-1]
        assert vllm_diff.mean() <= VLLM_MEAN_TOLERANCE, report[-1]
    print("\n".join(report))


def test_patchify_equals_processor_layout(transform: VideoTransformConfig, hf_processor) -> None:  # type: ignore[no-untyped-def]
    """Exact: random frames through our numpy patch layout and the processor's torch one."""
    rng = np.random.default_rng(0)
    for num_frames in (2, 3, 4, 7):
        frames = rng.standard_normal((num_frames, 3, 56, 84)).astype(np.float32)
        theirs, *_ = hf_processor.patchify(torch.from_numpy(frames)[None], 14, 2, 2)
        np.testing.assert_array_equal(patchify_video(frames, transform), theirs[0].numpy())


# ---------------------------------------------------------------------------------------------
# Bad videos (unit level; the server test checks the codes over gRPC)
# ---------------------------------------------------------------------------------------------


def test_zero_and_one_frame_errors(preprocessor: DaliVideoPreprocessor) -> None:
    one_frame = make_clip(ClipSpec("vp9", 64, 64, 5, 0.2))
    with pytest.raises(EpdError) as caught:
        preprocessor.preprocess([one_frame])
    assert caught.value.code is ErrorCode.INVALID_ARG
    assert "needs at least 2" in caught.value.message

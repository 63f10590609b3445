"""The ``cpu`` target's video preprocessing against vLLM's own video loading + transformers' processor.

Reference (what the ``llm`` model does with raw video bytes): vLLM's ``Qwen2VLVideoBackend``
(OpenCV decode, fps sampling; :mod:`python_backends.request.videos` says what it does) and
transformers' ``Qwen2VLVideoProcessor`` loaded from the checkpoint.

- Frame indices and ``video_grid_thw``: equal, always.
- Decoded frames: equal to vLLM's bit for bit. The ``cpu`` target decodes with OpenCV the way
  vLLM's loader does (:func:`python_backends.request.videos.read_sampled_frames`), not with DALI's CPU
  decoder, whose YUV->RGB conversion differs from OpenCV's by up to ~46 levels at sharp edges
  (mean 0.8-1.7) and flipped greedy tokens in 2 of 9 prompts
  (docs/benchmarks/video.md).
- Pixels (``pixel_values_videos``): DALI's resize + normalize and our patch layout against the
  processor's, from those same frames: within the image path's documented tolerance
  (tests/unit/test_preprocess_parity.py: <= 10 levels anywhere (border band), mean <= 0.25 level).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoVideoProcessor
from vllm.multimodal.video import Qwen2VLVideoBackend
from vllm.multimodal.video_decoders import VideoSourceMetadata, VideoTargetMetadata
from vllm.multimodal.video_decoders.opencv import OpenCVVideoBackendMixin

from builders.default_model import build_default_model
from python_backends.errors import EpdError, ErrorCode
from python_backends.preprocess.video_pipeline import VideoTransformConfig
from python_backends.preprocess.videos import DaliVideoPreprocessor, patchify_video
from python_backends.request.videos import (
    VideoLimits,
    VideoSamplingConfig,
    probe_video,
    read_sampled_frames,
    sample_frame_indices,
    torch_arange_float32,
)
from tests.videos import ClipSpec, make_clip

LEVEL = 1 / (255 * 0.26130258)  # one uint8 step after normalisation, smallest std (G)
IMAGE_MAX_TOLERANCE = 10 * LEVEL  # the image path's border-band bound
IMAGE_MEAN_TOLERANCE = 0.25 * LEVEL

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


def test_decoded_frames_equal_vllm(clips: list[bytes]) -> None:
    """>= 8 clips: our OpenCV read gives vLLM's loader's frames, indices and pixels, exactly."""
    sampling = VideoSamplingConfig()
    for spec, data in zip(CLIPS, clips, strict=True):
        frames, metadata = Qwen2VLVideoBackend.load_bytes(data, **sampling.loader_kwargs())
        probe = probe_video(data, 0)
        indices = sample_frame_indices(probe.total_frames, probe.fps, sampling)
        assert indices == metadata["frames_indices"], spec.name
        ours = read_sampled_frames(data, indices, 0)
        assert ours.dtype == frames.dtype and ours.shape == frames.shape, spec.name
        np.testing.assert_array_equal(ours, frames, spec.name)


def test_frame_parity_with_vllm(  # type: ignore[no-untyped-def]
    preprocessor: DaliVideoPreprocessor, hf_processor, clips: list[bytes]
) -> None:
    """>= 8 clips: frame indices and grids equal vLLM's; pixels within the image path's tolerance."""
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
        diff = np.abs(ours - theirs)
        report.append(
            f"{spec.name}: frames {result.frame_indices[index]} grid {result.video_grid_thw[index].tolist()} | "
            f"vs vLLM: max {diff.max() / LEVEL:.2f} mean {diff.mean() / LEVEL:.3f} levels"
        )
        assert diff.max() <= IMAGE_MAX_TOLERANCE, report[-1]
        assert diff.mean() <= IMAGE_MEAN_TOLERANCE, report[-1]
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

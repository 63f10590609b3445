"""Bad videos: each is refused with INVALID_ARG naming the problem, in bounded memory, and the
preprocessor keeps working afterwards (unit level; the server test checks codes over gRPC)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from builders.default_model import build_default_model
from python_backends.errors import EpdError, ErrorCode
from python_backends.preprocess.video_pipeline import VideoTransformConfig
from python_backends.preprocess.videos import DaliVideoPreprocessor
from python_backends.request.videos import VideoLimits, VideoSamplingConfig, video_bytes
from tests.videos import ClipSpec, bad_videos, make_clip

REPO_ROOT = Path(__file__).resolve().parents[2]

BAD_VIDEOS = bad_videos()


@pytest.fixture(scope="module")
def preprocessor() -> DaliVideoPreprocessor:
    transform = VideoTransformConfig.from_file(build_default_model())
    return DaliVideoPreprocessor.for_config(transform, limits=VideoLimits(max_video_seconds=10))


@pytest.mark.parametrize("name", list(BAD_VIDEOS))
def test_bad_video_is_invalid_arg(preprocessor: DaliVideoPreprocessor, name: str) -> None:
    make, words = BAD_VIDEOS[name]
    with pytest.raises(EpdError) as caught:
        preprocessor.preprocess([make_clip(ClipSpec("vp8", 64, 64, 5, 1)), make()])
    assert caught.value.code is ErrorCode.INVALID_ARG
    assert words in caught.value.message and "video[1]" in caught.value.message, caught.value.message
    # and it keeps working
    assert preprocessor.preprocess([make_clip(ClipSpec("vp9", 64, 64, 5, 1))]).video_grid_thw.tolist() == [[2, 4, 4]]


def test_limits(preprocessor: DaliVideoPreprocessor) -> None:
    clip = make_clip(ClipSpec("vp8", 64, 64, 5, 1))
    with pytest.raises(EpdError, match="above the limit of 2 \\(max_videos\\)"):
        preprocessor.preprocess([clip] * 3)
    small = DaliVideoPreprocessor.for_config(
        VideoTransformConfig.from_file(build_default_model()), limits=VideoLimits(max_video_bytes=100)
    )
    with pytest.raises(EpdError, match="max_video_bytes"):
        small.preprocess([clip])
    with pytest.raises(EpdError, match="is empty"):
        video_bytes(b"", 0)


def test_base64_video_accepted(preprocessor: DaliVideoPreprocessor) -> None:
    import base64

    clip = make_clip(ClipSpec("vp8", 64, 64, 5, 1))
    raw, encoded = preprocessor.preprocess([clip]), preprocessor.preprocess([base64.b64encode(clip)])
    assert raw.frame_indices == encoded.frame_indices
    assert (raw.pixel_values_videos == encoded.pixel_values_videos).all()


def test_max_frames_is_the_sampler_cap() -> None:
    transform = VideoTransformConfig.from_file(build_default_model())
    capped = DaliVideoPreprocessor.for_config(transform, sampling=VideoSamplingConfig(max_frames=6))
    result = capped.preprocess([make_clip(ClipSpec("vp8", 64, 64, 10, 5))])
    assert len(result.frame_indices[0]) == 6 and result.video_grid_thw.tolist()[0][0] == 3


_RSS_SCRIPT = """
import json, resource, sys
import psutil
from tests.videos import ClipSpec, bad_videos, make_clip
from python_backends.preprocess.video_pipeline import VideoTransformConfig
from python_backends.errors import EpdError
from python_backends.request.videos import VideoLimits
from python_backends.preprocess.videos import DaliVideoPreprocessor
transform = VideoTransformConfig.from_file(sys.argv[1])
pre = DaliVideoPreprocessor.for_config(transform, limits=VideoLimits(max_video_seconds=10))
pre.preprocess([make_clip(ClipSpec("vp8", 64, 64, 5, 1))])  # warm: the first run allocates DALI's buffers
inputs = {name: make() for name, (make, _) in bad_videos().items()}
rss_before = psutil.Process().memory_info().rss // 1024
peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for data in inputs.values():
    try:
        pre.preprocess([data])
    except EpdError:
        pass
peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"rss_before_kib": rss_before, "peak_before_kib": peak_before, "peak_after_kib": peak_after}))
"""


def test_bad_videos_in_bounded_memory() -> None:
    """A fresh process's peak RSS grows by < 64 MiB while it refuses every bad video (its peak
    before: imports and one small good clip; a 30000x30000 frame would need 2.5 GiB, a decoder
    that trusted any header would show it). Compared peak to peak: the RSS of the moment can
    drop when the shared machine reclaims pages, the peak cannot."""
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(build_default_model())],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    numbers = json.loads(out.stdout.strip().splitlines()[-1])
    grown_mib = (numbers["peak_after_kib"] - numbers["peak_before_kib"]) / 1024
    print(f"bad videos, RSS and peak RSS (KiB): {numbers}; peak grew by {grown_mib:.1f} MiB")
    assert grown_mib < 64, numbers


def test_video_encode_runs_the_pipeline_then_the_encoder_on_its_grid(preprocessor: DaliVideoPreprocessor) -> None:
    """The encoders' video step (python_backends/encode/videos.py): the preprocessed pixels of one
    video go to the vision encoder with the video's grid, rows come back per merged patch; a bad
    video is the preprocessing's INVALID_ARG, the encoder never called."""
    import asyncio

    import numpy as np

    from python_backends.encode.videos import VideoEncode

    calls: list[tuple[tuple[int, ...], list[list[int]]]] = []

    async def encode_pixels(pixels: np.ndarray, grid: np.ndarray) -> np.ndarray:
        calls.append((pixels.shape, grid.tolist()))
        t, h, w = grid[0]
        return np.ones((1, t * h * w // 4, 8), dtype=np.float32)

    encode = VideoEncode(preprocessor, encode_pixels)
    clip = make_clip(ClipSpec("vp9", 160, 120, 10, 2.0))
    expected = preprocessor.preprocess([clip])
    encoded = asyncio.run(encode(clip))
    assert encoded.grid_thw == tuple(expected.video_grid_thw[0].tolist()) == (2, 8, 12)
    # vit_encoder's shapes: the video's rows [t*h*w, patch_dim] and its grid [1, 3].
    assert calls == [((2 * 8 * 12, expected.pixel_values_videos.shape[1]), [[2, 8, 12]])]
    assert encoded.embeds.shape == (2 * 8 * 12 // 4, 8)
    make, words = BAD_VIDEOS["corrupt bytes"]
    with pytest.raises(EpdError) as caught:
        asyncio.run(encode(make()))
    assert caught.value.code is ErrorCode.INVALID_ARG and "video[0]" in caught.value.message
    assert len(calls) == 1


def test_encoder_and_epd_video_inputs() -> None:
    """What the encoders and epd check themselves (count, bytes, base64); the container checks
    are the preprocessing's (above)."""
    import base64

    import numpy as np

    from python_backends.encode.cached import parse_encoder_videos
    from python_backends.request.generate import GenerateRequest, raw_videos

    clip = make_clip(ClipSpec("vp8", 64, 64, 5, 1))
    as_sent = {"video": np.array([clip, base64.b64encode(clip)], dtype=np.object_)}
    assert parse_encoder_videos(as_sent, VideoLimits()) == [clip, clip]
    assert parse_encoder_videos({"image": np.array([b"x"], dtype=np.object_)}, VideoLimits()) is None
    cases = [
        (as_sent, None, "takes no video"),
        ({**as_sent, "image": np.array([b"x"], dtype=np.object_)}, VideoLimits(), "not both"),
        (as_sent, VideoLimits(max_videos=1), "above the limit of 1 (max_videos)"),
        (as_sent, VideoLimits(max_video_bytes=100), "max_video_bytes"),
        ({"video": np.array([b"not a video"], dtype=np.object_)}, VideoLimits(), "video[0] is neither"),
    ]
    for inputs, limits, words in cases:
        with pytest.raises(EpdError) as caught:
            parse_encoder_videos(inputs, limits)
        assert caught.value.code is ErrorCode.INVALID_ARG and words in caught.value.message, caught.value.message
    request = GenerateRequest("p", [], True, {}, True, videos=[base64.b64encode(clip), clip])
    assert raw_videos(request, VideoLimits()).videos == [clip, clip]
    small = GenerateRequest("p", [], True, {}, True, videos=[b"RIFF0000AVI ", clip])
    with pytest.raises(EpdError, match=r"video\[1\] has .*max_video_bytes"):
        raw_videos(small, VideoLimits(max_video_bytes=20))

"""``llm``'s video input without a server: parsing, limits from config parameters, header
checks before vLLM's loader, and the frames vLLM's own loader returns (docs/video.md)."""

from __future__ import annotations

import base64
import dataclasses

import numpy as np
import pytest

from python_backends import contract
from python_backends.engines.videos import VideoInputLimits, load_video, load_videos
from python_backends.errors import EpdError, ErrorCode
from python_backends.request.generate import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    RequestLimits,
    parse_generate_request,
)
from python_backends.request.videos import VideoLimits, VideoSamplingConfig, sample_frame_indices
from python_backends.runtime.model_params import ModelParameters
from tests.images import synthetic_image
from tests.videos import ClipSpec, bad_videos, make_clip

LIMITS = RequestLimits(max_videos=2)
# bad_videos()'s "over max_video_seconds" case is a 12 s clip against a 10 s limit.
VIDEO_LIMITS = VideoInputLimits(limits=VideoLimits(max_video_seconds=10))


def objects(*items: bytes) -> np.ndarray:
    return np.array(list(items), dtype=np.object_)


def request(text: str = "hi", *, videos: tuple[bytes, ...] = (), images: tuple[bytes, ...] = ()) -> dict:
    inputs = {contract.TEXT_INPUT: objects(text.encode())}
    if videos:
        inputs[contract.VIDEO] = objects(*videos)
    if images:
        inputs[contract.IMAGE] = objects(*images)
    return inputs


def test_videos_pass_parsing_unchecked_with_their_placeholders_after_the_images() -> None:
    parsed = parse_generate_request(request("Compare.", videos=(b"a", b"b")), LIMITS)
    assert parsed.videos == [b"a", b"b"]
    assert parsed.prompt == VIDEO_PLACEHOLDER * 2 + "Compare."
    # Images and videos both prepended: the images first.
    mixed = parse_generate_request(request("Both?", videos=(b"v",), images=(synthetic_image(32, 32, seed=1),)), LIMITS)
    assert mixed.prompt == IMAGE_PLACEHOLDER + VIDEO_PLACEHOLDER + "Both?"
    # A client's own placeholders are kept; a wrong count is refused.
    written = f"A {VIDEO_PLACEHOLDER} and text"
    assert parse_generate_request(request(written, videos=(b"v",)), LIMITS).prompt == written
    with pytest.raises(EpdError, match="1 <|video_pad|> placeholders but the request has 2 videos"):
        parse_generate_request(request(written, videos=(b"v", b"w")), LIMITS)


def test_video_count_and_models_without_video_are_refused_at_parse() -> None:
    with pytest.raises(EpdError, match=r"3 videos, above the limit of 2 \(max_videos\)") as caught:
        parse_generate_request(request(videos=(b"a", b"b", b"c")), LIMITS)
    assert caught.value.code is ErrorCode.INVALID_ARG
    with pytest.raises(EpdError, match="takes no video"):
        parse_generate_request(request(videos=(b"a",)), RequestLimits())
    with pytest.raises(EpdError, match="must be BYTES"):
        parse_generate_request({**request(), contract.VIDEO: np.zeros(3, np.uint8)}, LIMITS)


def test_limits_come_from_the_config_parameters() -> None:
    values = {
        contract.MAX_VIDEOS: "3",
        contract.MAX_VIDEO_BYTES: "1000",
        contract.MAX_VIDEO_SECONDS: "2.5",
        contract.MAX_FRAMES: "16",
        contract.VIDEO_CODECS: "vp9, mjpeg",
    }
    limits = VideoInputLimits.from_params(ModelParameters("llm", values))
    assert limits is not None
    assert limits.limits == VideoLimits(max_videos=3, max_video_bytes=1000, max_video_seconds=2.5)
    assert limits.sampling == VideoSamplingConfig(max_frames=16)
    assert limits.codecs == ("vp9", "mjpeg")
    assert VideoInputLimits.from_params(ModelParameters("llm", {contract.MAX_VIDEOS: "0"})) is None
    # The contract's defaults are the library's.
    defaults = VideoInputLimits.from_params(ModelParameters("llm", {}))
    assert defaults == VideoInputLimits()
    with pytest.raises(contract.ContractError, match="max_frames"):
        VideoInputLimits.from_params(ModelParameters("llm", {contract.MAX_FRAMES: "1000"}))


@pytest.mark.parametrize("name", list(bad_videos()))
def test_bad_video_is_invalid_arg_naming_the_problem(name: str) -> None:
    make, words = bad_videos()[name]
    with pytest.raises(EpdError) as caught:
        load_videos([make_clip(ClipSpec("vp8", 64, 64, 5, 1)), make()], VIDEO_LIMITS)
    assert caught.value.code is ErrorCode.INVALID_ARG
    assert words in caught.value.message and "video[1]" in caught.value.message, caught.value.message


def test_byte_limit_is_checked_before_anything_is_opened() -> None:
    clip = make_clip(ClipSpec("vp9", 64, 64, 5, 1))
    small = dataclasses.replace(VIDEO_LIMITS, limits=VideoLimits(max_video_bytes=len(clip) - 1))
    with pytest.raises(EpdError, match="max_video_bytes"):
        load_video(clip, 0, small)


@pytest.mark.parametrize(
    "spec", [ClipSpec("vp9", 320, 240, 30, 3.0), ClipSpec("mjpeg", 176, 144, 5, 8.0), ClipSpec("vp8", 96, 200, 24, 2.0)]
)
def test_vllm_loader_returns_the_frames_the_checks_counted(spec: ClipSpec) -> None:
    clip = make_clip(spec)
    frames, metadata = load_video(base64.b64encode(clip), 0, VIDEO_LIMITS)  # base64 accepted too
    expected = sample_frame_indices(spec.num_frames, spec.fps, VIDEO_LIMITS.sampling)
    assert frames.shape == (len(expected), spec.height, spec.width, 3) and frames.dtype == np.uint8
    assert metadata["frames_indices"] == expected
    assert metadata["do_sample_frames"] is False


def test_max_frames_reaches_vllm_loader() -> None:
    spec = ClipSpec("mjpeg", 64, 64, 30, 10.0)  # 20 frames at vLLM's 2 fps
    capped = dataclasses.replace(VIDEO_LIMITS, sampling=VideoSamplingConfig(max_frames=8))
    frames, metadata = load_video(make_clip(spec), 0, capped)
    assert len(frames) == 8 and len(metadata["frames_indices"]) == 8

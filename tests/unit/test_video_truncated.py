"""Truncated videos (issue 32): ``epd`` decides as ``llm`` does on the same bytes.

A file cut short is not refused as such: OpenCV opens what is left, vLLM's frame count is what
the stream holds (its seek to the end), and the sampler picks from that. ``llm`` (vLLM's loader)
serves the cut when every sampled frame decodes and refuses it when the stream ends, or breaks,
before one; ``epd``'s encoders decode the same frames with the same OpenCV calls
(``read_sampled_frames``). Both pass their decoder's result through one check,
``checked_decode``, after the one container check, ``checked_video``: same decision, same code,
same message. Here on VP9/VP8 WebM and MJPEG AVI cut at 1/10, 30 %, 1/3, 1/2, 2/3 and 99 %.
"""

from __future__ import annotations

import numpy as np
import pytest

from builders.default_model import build_default_model
from python_backends.engines import videos as llm_videos
from python_backends.engines.videos import VideoInputLimits, load_video
from python_backends.errors import EpdError, ErrorCode
from python_backends.preprocess import videos as epd_videos
from python_backends.preprocess.video_pipeline import VideoTransformConfig
from python_backends.preprocess.videos import DaliVideoPreprocessor
from python_backends.request import videos as shared
from python_backends.request.videos import VideoSamplingConfig, checked_decode, probe_video, read_sampled_frames
from tests.videos import ClipSpec, make_clip

CUTS = (1 / 10, 0.3, 1 / 3, 1 / 2, 2 / 3, 0.99)
SPECS = {
    "vp9 320x240 30 fps 3 s": ClipSpec("vp9", 320, 240, 30, 3.0, seed=11),
    "vp9 160x120 10 fps 3 s": ClipSpec("vp9", 160, 120, 10, 3.0),
    "vp8 96x200 24 fps 2 s": ClipSpec("vp8", 96, 200, 24, 2.0, seed=13),
    "mjpeg avi 176x144 5 fps 8 s": ClipSpec("mjpeg", 176, 144, 5, 8.0, seed=12),
}
LLM = VideoInputLimits()


def decision(run) -> tuple[str, object]:
    """("served", the frame indices) or (the error code, its message)."""
    try:
        return "served", run()
    except EpdError as error:
        return error.code.name, error.message


@pytest.fixture(scope="module")
def preprocessor() -> DaliVideoPreprocessor:
    return DaliVideoPreprocessor.for_config(VideoTransformConfig.from_file(build_default_model()))


@pytest.fixture(scope="module")
def decisions(preprocessor: DaliVideoPreprocessor) -> dict[tuple[str, float], tuple[tuple, tuple]]:
    """(clip, cut) -> (llm's decision, epd's decision) on the same bytes."""
    out = {}
    for name, spec in SPECS.items():
        clip = make_clip(spec)
        for keep in CUTS:
            cut = clip[: int(len(clip) * keep)]
            llm = decision(lambda cut=cut: load_video(cut, 0, LLM)[1]["frames_indices"])
            epd = decision(lambda cut=cut: preprocessor.preprocess([cut]).frame_indices[0])
            out[(name, keep)] = (llm, epd)
    return out


def test_epd_and_llm_decide_alike_on_every_cut(decisions) -> None:
    differ = {key: pair for key, pair in decisions.items() if pair[0] != pair[1]}
    assert not differ, differ


def test_the_cuts_cover_served_and_refused_truncations(decisions) -> None:
    """Not vacuous: both kinds occur, and a refusal says why (INVALID_ARG, never INTERNAL)."""
    outcomes = {llm[0] for llm, _ in decisions.values()}
    assert outcomes == {"served", "INVALID_ARG"}, outcomes
    # The first third of the 320x240 VP9 WebM keeps 15 whole frames: served, from 4 of them.
    assert decisions[("vp9 320x240 30 fps 3 s", 1 / 3)][1] == ("served", [0, 3, 7, 11])
    # The first 30 % of the 160x120 one: its header's 2 frames are not in the stream.
    assert decisions[("vp9 160x120 10 fps 3 s", 0.3)][1] == (
        "INVALID_ARG",
        "video[0] cannot be decoded: corrupt or truncated data (0 of 2 sampled frames read)",
    )
    # A WebM missing only its tail (cues, the last frames) is served from what it holds.
    assert decisions[("vp9 320x240 30 fps 3 s", 0.99)][1][0] == "served"


def test_both_paths_use_the_one_shared_check() -> None:
    assert llm_videos.checked_decode is shared.checked_decode and epd_videos.checked_decode is shared.checked_decode
    assert llm_videos.checked_video is shared.checked_video and epd_videos.checked_video is shared.checked_video


def test_read_sampled_frames_returns_what_vllms_loader_returns_on_a_cut_file() -> None:
    """Fewer frames than sampled, the same ones, bit for bit (the check refuses both alike)."""
    from vllm.multimodal.video import Qwen2VLVideoBackend

    clip = make_clip(SPECS["vp8 96x200 24 fps 2 s"])
    for keep in (0.3, 0.5):
        cut = clip[: int(len(clip) * keep)]
        indices = shared.sample_frame_indices(probe_video(cut, 0).total_frames, 24.0, VideoSamplingConfig())
        theirs, metadata = Qwen2VLVideoBackend.load_bytes(cut, **VideoSamplingConfig().loader_kwargs())
        ours = read_sampled_frames(cut, indices, 0)
        assert ours.shape == theirs.shape and np.array_equal(ours, theirs), keep
        assert len(metadata["frames_indices"]) == len(ours)


def test_checked_decode_refuses_short_and_failed_decodes() -> None:
    frames = np.zeros((2, 4, 4, 3), np.uint8)
    assert checked_decode(lambda: frames, len, 2, 1) is frames
    with pytest.raises(EpdError) as caught:
        checked_decode(lambda: frames[:1], len, 2, 1)
    assert caught.value.code is ErrorCode.INVALID_ARG
    assert caught.value.message == "video[1] cannot be decoded: corrupt or truncated data (1 of 2 sampled frames read)"

    def broken() -> np.ndarray:
        raise ValueError("could not broadcast input array from shape (8,8,3) into shape (4,4,3)")

    with pytest.raises(EpdError) as caught:
        checked_decode(broken, len, 2, 0)
    assert caught.value.code is ErrorCode.INVALID_ARG
    assert caught.value.message.startswith("video[0] cannot be decoded: ValueError: could not broadcast")
    # A coded error from the decoder keeps its code and words.
    coded = EpdError("video[0] cannot be opened: unknown container or corrupt header", ErrorCode.INVALID_ARG)

    def refused() -> np.ndarray:
        raise coded

    with pytest.raises(EpdError) as caught:
        checked_decode(refused, len, 2, 0)
    assert caught.value is coded

"""``llm`` with the ``video`` input over the wire (issue 16): generated clips streamed over gRPC
through vLLM's own video loader, bad videos refused with INVALID_ARG naming the problem, and
the server serving on afterwards.

Served alone (explicit model control: only ``llm`` loads, one vLLM engine) from the session's
generated repository, so this module costs one engine start.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import pytest

from builders.tritonserver import Ports, ServerOptions, TritonServer
from client.epd_client import SYSTEM_PROMPT, ClientError, GrpcClient, HttpClient
from python_backends.preprocess.video_pipeline import VideoTransformConfig
from python_backends.preprocess.videos import prepare_video
from python_backends.request.generate import IMAGE_PLACEHOLDER, VIDEO_PAD, VIDEO_PLACEHOLDER
from python_backends.request.videos import CPU_CODECS, VideoLimits, VideoSamplingConfig
from tests.images import synthetic_image
from tests.server.conftest import LOG_DIR, TEST_EXIT_TIMEOUT_S, serving
from tests.videos import ClipSpec, bad_videos, make_clip

pytestmark = pytest.mark.server

EXACT = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
CLIPS = {
    "vp9": ClipSpec("vp9", 320, 240, 30, 3.0, seed=1),
    "mjpeg": ClipSpec("mjpeg", 176, 144, 5, 8.0, seed=3),
    "vp8": ClipSpec("vp8", 96, 200, 24, 2.0, seed=5),
}


def video_prompt(text: str, num_videos: int, num_images: int = 0) -> str:
    vision = IMAGE_PLACEHOLDER * num_images + VIDEO_PLACEHOLDER * num_videos
    return (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{vision}{text}<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.fixture(scope="module")
def llm_alone(server_repository: Path) -> Iterator[TritonServer]:
    options = ServerOptions(
        server_repository,
        Ports.free(),
        extra_args=("--model-control-mode=explicit", "--load-model=llm"),
        exit_timeout_s=TEST_EXIT_TIMEOUT_S,
    )
    with serving(options, LOG_DIR / "llm-video.log") as running:
        yield running


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    return {name: make_clip(spec) for name, spec in CLIPS.items()}


@pytest.fixture(scope="module")
def expected_input_tokens(model_dir: Path):
    """What vLLM must count for a prompt: the text's tokens with each video's placeholder
    expanded to its ``t*h*w / merge**2`` tokens (grid from our sampler and resize)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    transform = VideoTransformConfig.from_file(model_dir)

    def count(prompt: str, videos: list[bytes]) -> int:
        pieces = prompt.split(VIDEO_PAD)
        assert len(pieces) == len(videos) + 1
        expanded = pieces[0]
        for video, piece in zip(videos, pieces[1:], strict=True):
            t, h, w = prepare_video(video, 0, transform, VideoSamplingConfig(), VideoLimits(), CPU_CODECS).grid_thw
            expanded += VIDEO_PAD * (t * h * w // 4) + piece
        return len(tokenizer(expanded)["input_ids"])

    return count


@pytest.fixture
def grpc_llm(llm_alone: TritonServer) -> Iterator[GrpcClient]:
    client = GrpcClient(llm_alone.grpc_url, "llm")
    yield client
    client.close()


@pytest.fixture
def http_llm(llm_alone: TritonServer) -> Iterator[HttpClient]:
    client = HttpClient(llm_alone.http_url, "llm")
    yield client
    client.close()


def test_clips_stream_through_llm_with_every_sampled_frame(grpc_llm, clips, expected_input_tokens):
    for name, clip in clips.items():
        prompt = video_prompt(f"Describe the {name} video.", 1)
        pieces: list[str] = []
        result = grpc_llm.generate(prompt, [], EXACT, on_text=pieces.append, videos=[clip])
        assert result.num_output_tokens == 12 and len(result.token_ids) == 12, name
        assert 1 < len(result.chunk_times) <= 12, name  # streamed
        assert "".join(pieces) == result.text
        # vLLM counted the video tokens of exactly the frames and size our sampler picks.
        assert result.num_input_tokens == expected_input_tokens(prompt, [clip]), name


def test_two_videos_a_video_and_an_image_and_base64(grpc_llm, http_llm, clips, expected_input_tokens):
    two = video_prompt("Compare the videos.", 2)
    result = grpc_llm.generate(two, [], EXACT, videos=[clips["vp9"], clips["vp8"]])
    assert result.num_input_tokens == expected_input_tokens(two, [clips["vp9"], clips["vp8"]])
    # A plain prompt gets the placeholders prepended, images first.
    image = synthetic_image(64, 64, seed=3)
    mixed = grpc_llm.generate("Video and picture?", [image], EXACT, videos=[clips["mjpeg"]])
    assert mixed.num_output_tokens == 12
    alone = grpc_llm.generate("Video and picture?", [image], EXACT)
    # Beyond its one placeholder token, the image adds the same tokens with or without the video.
    extra_image_tokens = alone.num_input_tokens - expected_input_tokens(IMAGE_PLACEHOLDER + "Video and picture?", [])
    assert extra_image_tokens > 0
    with_video = expected_input_tokens(IMAGE_PLACEHOLDER + VIDEO_PLACEHOLDER + "Video and picture?", [clips["mjpeg"]])
    assert mixed.num_input_tokens == with_video + extra_image_tokens
    # Same clip as raw bytes over gRPC and base64 over HTTP: the same greedy tokens.
    one = video_prompt("Once more.", 1)
    raw = grpc_llm.generate(one, [], EXACT, videos=[clips["vp8"]])
    assert http_llm.generate(one, [], EXACT, videos=[clips["vp8"]]).token_ids == raw.token_ids
    assert grpc_llm.generate(one, [], EXACT, videos=[base64.b64encode(clips["vp8"])]).token_ids == raw.token_ids


BAD = {
    **{name: (make, words) for name, (make, words) in bad_videos().items() if "max_video_seconds" not in name},
    # The served limit is the default, 60 s.
    "over max_video_seconds (61 s > 60 s)": (lambda: make_clip(ClipSpec("vp8", 64, 64, 5, 61)), "max_video_seconds"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_video_is_invalid_arg_and_the_server_keeps_serving(grpc_llm, http_llm, clips, name):
    make, words = BAD[name]
    bad = make()
    prompt = video_prompt("What happens?", 2)
    # gRPC streams carry the message (no code field); HTTP carries the code: 400 = INVALID_ARG.
    with pytest.raises(ClientError) as caught:
        grpc_llm.generate(prompt, [], EXACT, videos=[clips["vp8"], bad])
    assert words in str(caught.value) and "video[1]" in str(caught.value), str(caught.value)
    with pytest.raises(ClientError) as caught:
        http_llm.generate(prompt, [], EXACT, videos=[clips["vp8"], bad])
    assert words in str(caught.value) and caught.value.status == "400", str(caught.value)
    one = video_prompt("Still there?", 1)
    assert grpc_llm.generate(one, [], EXACT, videos=[clips["vp9"]]).num_output_tokens == 12


def test_too_many_videos_are_refused(grpc_llm, clips):
    with pytest.raises(ClientError, match=r"3 videos, above the limit of 2 \(max_videos\)"):
        grpc_llm.generate("Three?", [], EXACT, videos=[clips["vp8"]] * 3)

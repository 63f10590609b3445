"""``epd`` with the ``video`` input over gRPC streaming (issue 16, step 3), on the session server.

Equality: 8 prompts (1 video, 1 video + 1 image, 2 videos; VP8/VP9/MJPEG, 2-8 s, 5-30 fps,
96x200-640x360): ``epd``'s greedy tokens equal ``llm``'s (raw video through vLLM's own loader),
on the disaggregated path at the first call (every video encoded: decoded with OpenCV as vLLM
decodes, DALI resize/normalize, the same ViT, stored) and at the second (every item from the
store: 0 encodes), and on the colocated path from the store.

Bad videos: each is INVALID_ARG (the code read from the ``error`` output, as
tests/server/test_bad_inputs.py reads it) naming the problem and the video's index, and ``epd``
serves the next request. Truncated files: ``epd`` gives ``llm``'s answer on the same bytes
(the same tokens, or the same code and words; docs/video.md).

The store lives in the slot's tmpfs folder, emptied at the start of the session, and the images
carry a per-session note (new bytes, same pixels) in case another module sent the same picture:
the first call of each prompt is a real encode (checked: its ``encode`` timing is there, its
cache hits are only the items another prompt of this test stored before).
"""

from __future__ import annotations

import re
import secrets

import numpy as np
import pytest

from builders.stage_watch import peak_rss, server_processes
from builders.tritonserver import TritonServer
from client.epd_client import SYSTEM_PROMPT, ClientError, GrpcClient, HttpClient
from python_backends.contract import COLOCATED_PATH, DISAGGREGATED_PATH
from python_backends.request.generate import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER
from tests.images import synthetic_image, with_note
from tests.server.bad_input_cases import BadInput
from tests.server.conftest import open_node_store
from tests.server.test_bad_inputs import send
from tests.videos import ClipSpec, bad_videos, make_clip

pytestmark = pytest.mark.server

EXACT = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
CLIPS = {
    "vp9-320": ClipSpec("vp9", 320, 240, 30, 3.0, seed=11),
    "mjpeg-176": ClipSpec("mjpeg", 176, 144, 5, 8.0, seed=12),
    "vp8-96": ClipSpec("vp8", 96, 200, 24, 2.0, seed=13),
    "vp9-640": ClipSpec("vp9", 640, 360, 25, 4.0, seed=14),  # flipped a token with DALI's decoder
    "mjpeg-256": ClipSpec("mjpeg", 256, 256, 15, 3.0, seed=15),
    "vp9-160": ClipSpec("vp9", 160, 120, 10, 2.0, seed=16),
}
# A per-session note: new bytes (a new content key) for the session store, the same pixels.
_NOTE = secrets.token_hex(8).encode()
IMAGES = {
    "photo": with_note(synthetic_image(320, 240, seed=17), _NOTE),
    "small": with_note(synthetic_image(64, 96, seed=18), _NOTE),
}
# (name, videos, images)
PROMPTS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("1 video vp9 320x240", ("vp9-320",), ()),
    ("1 video mjpeg 176x144 8 s", ("mjpeg-176",), ()),
    ("1 video vp8 96x200", ("vp8-96",), ()),
    ("1 video vp9 640x360", ("vp9-640",), ()),
    ("1 video + 1 image", ("vp8-96",), ("photo",)),
    ("1 video + 1 image (mjpeg)", ("mjpeg-256",), ("small",)),
    ("2 videos", ("vp9-160", "vp9-640"), ()),
    ("2 videos (mjpeg, vp8)", ("mjpeg-256", "vp8-96"), ()),
)


def prompt_of(text: str, num_images: int, num_videos: int) -> str:
    vision = IMAGE_PLACEHOLDER * num_images + VIDEO_PLACEHOLDER * num_videos
    return (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{vision}{text}<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    return {name: make_clip(spec) for name, spec in CLIPS.items()}


def test_epd_equals_llm_on_video_prompts_first_call_and_from_the_store(
    llm: GrpcClient, epd: GrpcClient, clips: dict[str, bytes]
) -> None:
    store = open_node_store()
    stored: set[str] = set()  # items a previous prompt of this test stored
    report = []
    for name, video_names, image_names in PROMPTS:
        videos = [clips[v] for v in video_names]
        images = [IMAGES[i] for i in image_names]
        prompt = prompt_of(f"What happens in {name}?", len(images), len(videos))
        expected = llm.generate(prompt, images, EXACT, videos=videos)
        assert expected.num_output_tokens == 12, name
        items = {*(f"v:{v}" for v in video_names), *(f"i:{i}" for i in image_names)}
        entries_before = store.metrics()["entries"]
        first = epd.generate(prompt, images, EXACT, videos=videos, parameters={"path": DISAGGREGATED_PATH})
        new = items - stored
        assert first.cache_hits == len(items - new), name  # only what an earlier prompt stored
        assert ("encode" in first.timings_ms) == bool(new), name
        assert store.metrics()["entries"] == entries_before + len(new), name
        stored |= items
        again = epd.generate(prompt, images, EXACT, videos=videos, parameters={"path": DISAGGREGATED_PATH})
        assert again.cache_hits == len(items) and "encode" not in again.timings_ms, name  # 0 encodes
        colocated = epd.generate(prompt, images, EXACT, videos=videos, parameters={"path": COLOCATED_PATH})
        assert colocated.cache_hits == len(items) and "encode" not in colocated.timings_ms, name
        assert store.metrics()["entries"] == entries_before + len(new), name
        report.append(
            f"{name}: llm {expected.token_ids} | epd first {first.token_ids == expected.token_ids} "
            f"store {again.token_ids == expected.token_ids} colocated {colocated.token_ids == expected.token_ids} "
            f"| input tokens llm {expected.num_input_tokens} epd {first.num_input_tokens}"
        )
        print(report[-1])
        assert first.num_input_tokens == expected.num_input_tokens, report[-1]
        assert first.token_ids == expected.token_ids, report[-1]
        assert again.token_ids == expected.token_ids, report[-1]
        assert colocated.token_ids == expected.token_ids, report[-1]


BAD = {
    **{name: (make, words) for name, (make, words) in bad_videos().items() if "max_video_seconds" not in name},
    # The served limit is the default, 60 s.
    "over max_video_seconds (61 s > 60 s)": (lambda: make_clip(ClipSpec("vp8", 64, 64, 5, 61)), "max_video_seconds"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_video_on_epd_is_invalid_arg_and_epd_keeps_serving(
    server: TritonServer, epd: GrpcClient, clips: dict[str, bytes], name: str
) -> None:
    """The code from the ``error`` output (a gRPC stream carries an error as a message only:
    tests/server/test_bad_inputs.py), the message as a plain streaming client sees it too."""
    make, words = BAD[name]
    bad = make()
    prompt = prompt_of("What happens?", 0, 2)
    videos = ("BYTES", np.array([clips["vp8-96"], bad], dtype=np.object_))
    case = BadInput(name, "INVALID_ARG", words, extra={"video": videos})
    code, message, who = send(server, case)
    assert (code, who) == ("INVALID_ARG", "epd") and words in message and "video[1]" in message, (code, message)
    with pytest.raises(ClientError) as caught:
        epd.generate(prompt, [], EXACT, videos=[clips["vp8-96"], bad])
    assert words in str(caught.value) and "video[1]" in str(caught.value), str(caught.value)
    assert epd.generate(prompt_of("Still there?", 0, 1), [], EXACT, videos=[clips["vp9-160"]]).num_output_tokens == 12


def test_bad_videos_cost_every_server_process_bounded_memory(
    server: TritonServer, epd: GrpcClient, clips: dict[str, bytes]
) -> None:
    """Every bad video on both of epd's paths (the colocated one hands media to epd's own
    engine, the disaggregated one to the encoders and preprocessing): no process of the server
    (tritonserver, each stub, each vLLM engine core) raises its peak RSS by 128 MiB or more.
    Decoding the 30000x30000 frame alone would take 2.6 GiB (RGB)."""
    assert server.process is not None
    processes = server_processes(server.process.pid)
    before = {f"{p.role}#{p.pid}": peak_rss(p.pid) or 0 for p in processes}
    for make, words in BAD.values():
        for path in (COLOCATED_PATH, DISAGGREGATED_PATH):
            with pytest.raises(ClientError, match=re.escape(words)):
                epd.generate(prompt_of("What happens?", 0, 1), [], EXACT, videos=[make()], parameters={"path": path})
    grown_mib = {
        process: ((peak_rss(int(process.split("#")[1])) or 0) - peak) / 2**20 for process, peak in before.items()
    }
    print("\npeak RSS growth over every bad video on both paths (MiB): "
          + ", ".join(f"{process.split('#')[0]} {mib:.1f}" for process, mib in sorted(grown_mib.items())))  # fmt: skip
    assert max(grown_mib.values()) < 128, grown_mib
    assert epd.generate(prompt_of("Still there?", 0, 1), [], EXACT, videos=[clips["vp9-160"]]).num_output_tokens == 12


# Truncated files (issue 32): a cut file is not refused as such; ``epd`` decides as ``llm`` does on
# the same bytes (one container check and one check of the decoded frames, shared: docs/video.md).
# The first third of the 320x240 VP9 WebM holds 15 whole frames and 99 % of it all but its tail,
# the first half of the MJPEG AVI 20 frames: served by both, the same tokens. The first tenth of
# the 320x240 one and the first 30 % of a 3 s 160x120 one promise 2 frames the stream does not hold,
# the first third of the 160x120 one holds 1: refused by both, the same code and words.
TRUNCATED = {
    "vp9 320x240, first third of its bytes": (CLIPS["vp9-320"], 1 / 3),
    "vp9 320x240, first tenth": (CLIPS["vp9-320"], 1 / 10),
    "vp9 320x240, 99 %": (CLIPS["vp9-320"], 0.99),
    "vp9 160x120 3 s, first 30 %": (ClipSpec("vp9", 160, 120, 10, 3.0), 0.3),
    "vp9 160x120 3 s, first third": (ClipSpec("vp9", 160, 120, 10, 3.0), 1 / 3),
    "mjpeg 176x144, first half": (CLIPS["mjpeg-176"], 1 / 2),
}
# The stages an epd error passed through, in front of the words llm answers ("generate: encode: ").
_STAGES = re.compile(r"^(?:[a-z_]+: )+(?=video\[)")


def _answer(generate) -> tuple[str, str]:
    """("tokens", the token ids) or (the HTTP status / gRPC code, the message without epd's stage names)."""
    try:
        return "tokens", str(generate().token_ids)
    except ClientError as error:
        return str(error.status), _STAGES.sub("", str(error))


@pytest.mark.parametrize("name", list(TRUNCATED))
def test_truncated_video_gets_the_same_answer_from_epd_and_llm(
    server: TritonServer, epd: GrpcClient, name: str
) -> None:
    """Over HTTP (the code as its status: 400 = INVALID_ARG) on epd's default path, and over
    gRPC on the disaggregated one (the words)."""
    spec, keep = TRUNCATED[name]
    clip = make_clip(spec)
    cut = clip[: int(len(clip) * keep)]
    prompt = prompt_of("What happens?", 0, 1)
    llm_http, epd_http = HttpClient(server.http_url, "llm"), HttpClient(server.http_url, "epd")
    try:
        expected = _answer(lambda: llm_http.generate(prompt, [], EXACT, videos=[cut]))
        got = _answer(lambda: epd_http.generate(prompt, [], EXACT, videos=[cut]))
    finally:
        llm_http.close()
        epd_http.close()
    disaggregated = _answer(
        lambda: epd.generate(prompt, [], EXACT, videos=[cut], parameters={"path": DISAGGREGATED_PATH})
    )
    print(f"\n{name}: llm {expected} | epd {got} | epd disaggregated {disaggregated}")
    assert got == expected, name
    assert disaggregated[1] == expected[1], name

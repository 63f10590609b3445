"""Chat messages -> prompt, images and videos: the same prompt ``vllm serve`` renders (checked
against vLLM's own chat parsing and template code on the tiny checkpoint), images and videos in
message order, and the media policy (data URIs, file:// only under the media folder, never a
network fetch, a byte limit per kind)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from client.epd_client import chat_prompt
from client.openai_server.errors import OpenAIError
from client.openai_server.prompt import ChatRenderer, MediaPolicy, template_takes_parts
from client.openai_server.schemas import ChatCompletionRequest, Message
from python_backends.request.generate import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER
from python_backends.request.videos import VideoLimits
from tests.images import synthetic_image
from tests.videos import ClipSpec, make_clip

IMAGES = [synthetic_image(32 + 8 * i, 32, i) for i in range(3)]
CLIPS = [make_clip(ClipSpec("vp8", 64, 48, 5, 1.0, seed=30 + i)) for i in range(2)]


def data_uri(data: bytes, mime: str = "image/jpeg") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_uri(data)}}


def video_part(data: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": data_uri(data, "video/webm")}}


def messages(raw: list[dict]) -> list[Message]:
    return ChatCompletionRequest(model="llm", messages=raw).messages


@pytest.fixture(scope="module")
def renderer(model_dir: Path) -> ChatRenderer:
    return ChatRenderer.from_checkpoint(model_dir, MediaPolicy())


CHATS = {
    "text only": [{"role": "user", "content": "hello"}],
    "one image": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [image_part(IMAGES[0]), {"type": "text", "text": "What is it?"}]},
    ],
    "three images, text between": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                image_part(IMAGES[0]),
                {"type": "text", "text": "with"},
                image_part(IMAGES[1]),
                image_part(IMAGES[2]),
            ],
        }
    ],
    "multi-turn": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [image_part(IMAGES[0]), {"type": "text", "text": "and?"}]},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": "More?", "name": "bob"},
    ],
    "developer role, later system": [
        {"role": "developer", "content": "dev rules"},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "late system"},
    ],
    "empty content": [{"role": "user", "content": None}],
    "a video between texts, then an image": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "In"},
                video_part(CLIPS[0]),
                {"type": "text", "text": "and"},
                image_part(IMAGES[0]),
            ],
        },
    ],  # fmt: skip
    "videos across turns": [
        {"role": "user", "content": [video_part(CLIPS[0])]},
        {"role": "assistant", "content": "A clip."},
        {"role": "user", "content": [image_part(IMAGES[1]), video_part(CLIPS[1]), {"type": "text", "text": "Same?"}]},
    ],
}


def vllm_prompt(model_dir: Path, raw: list[dict]) -> str:
    """What `vllm serve` renders for these messages: vLLM's own parsing and template code."""
    from vllm.config import ModelConfig
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import resolve_chat_template_content_format, safe_apply_chat_template
    from vllm.tokenizers import get_tokenizer

    config = ModelConfig(model=str(model_dir), tokenizer=str(model_dir))
    tokenizer = get_tokenizer(str(model_dir))
    content_format = resolve_chat_template_content_format(
        chat_template=None, tools=None, given_format="auto", tokenizer=tokenizer, model_config=config
    )
    conversation, _, _ = parse_chat_messages(raw, config, content_format=content_format)
    return safe_apply_chat_template(config, tokenizer, conversation, tokenize=False, add_generation_prompt=True)


def test_prompts_are_the_ones_vllm_serve_renders(renderer: ChatRenderer, model_dir: Path):
    for name, raw in CHATS.items():
        assert renderer.render(messages(raw)).prompt == vllm_prompt(model_dir, raw), name


def test_a_one_turn_chat_is_the_clients_chat_prompt(renderer: ChatRenderer):
    # The prompt client.epd_client.chat_prompt builds (the tests' direct Triton calls) is the chat's.
    raw = CHATS["one image"][:1] + [
        {"role": "user", "content": [*map(image_part, IMAGES), {"type": "text", "text": "x"}]}
    ]
    rendered = renderer.render(messages(raw))
    assert rendered.prompt == chat_prompt("x", 3)
    assert rendered.images == IMAGES  # bytes as sent, in message order


def test_images_come_in_message_order_across_messages(renderer: ChatRenderer):
    raw = [
        {"role": "user", "content": [image_part(IMAGES[2])]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [image_part(IMAGES[0]), image_part(IMAGES[1])]},
    ]
    assert renderer.render(messages(raw)).images == [IMAGES[2], IMAGES[0], IMAGES[1]]


def test_a_video_part_is_the_video_placeholder_in_its_place(renderer: ChatRenderer):
    rendered = renderer.render(messages(CHATS["a video between texts, then an image"]))
    assert rendered.prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\nIn{VIDEO_PLACEHOLDER}and{IMAGE_PLACEHOLDER}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (rendered.images, rendered.videos) == ([IMAGES[0]], [CLIPS[0]])  # bytes as sent, each kind apart


def test_videos_come_in_message_order_apart_from_images(renderer: ChatRenderer):
    raw = [
        {"role": "user", "content": [video_part(CLIPS[1]), image_part(IMAGES[2])]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [image_part(IMAGES[0]), video_part(CLIPS[0])]},
    ]
    rendered = renderer.render(messages(raw))
    assert (rendered.images, rendered.videos) == ([IMAGES[2], IMAGES[0]], [CLIPS[1], CLIPS[0]])


def test_the_tiny_template_takes_parts_and_a_string_template_does_not():
    assert template_takes_parts("{% for m in messages %}{% for c in m['content'] %}{{ c }}{% endfor %}{% endfor %}")
    assert template_takes_parts("{% for m in messages %}{% for c in m.content %}{{ c }}{% endfor %}{% endfor %}")
    assert not template_takes_parts("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def _refusal(renderer: ChatRenderer, url: str) -> OpenAIError:
    raw = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(OpenAIError) as info:
        renderer.render(messages(raw))
    assert info.value.status == 400 and info.value.param == "messages[0].content[0].image_url"
    return info.value


@pytest.mark.parametrize(
    "url, fragment",
    [
        ("http://127.0.0.1:1/cat.jpg", "remote image URLs are not fetched"),
        ("https://example.com/cat.jpg", "remote image URLs are not fetched"),
        ("data:image/jpeg;base64,@@not base64@@", "not valid base64"),
        ("data:image/jpeg;base64,", "holds no data"),
        ("data:nonsense", "a data URI must look like"),
        ("ftp://host/cat.jpg", "must be a data: URI"),
        ("cat.jpg", "must be a data: URI"),
        ("file:///etc/hostname", "file:// image URLs are off"),
    ],
)
def test_bad_image_urls_are_400_without_a_fetch(renderer: ChatRenderer, url: str, fragment: str):
    assert fragment in _refusal(renderer, url).message


def test_an_image_over_the_byte_limit_is_refused_before_decoding(model_dir: Path):
    small = ChatRenderer.from_checkpoint(model_dir, MediaPolicy(max_image_bytes=1000))
    error = _refusal(small, data_uri(synthetic_image(256, 256, 1)))
    assert error.code == "image_too_large"


def test_file_urls_read_only_under_the_media_folder(model_dir: Path, tmp_path: Path):
    media = tmp_path / "media"
    media.mkdir()
    (media / "a.jpg").write_bytes(IMAGES[0])
    (tmp_path / "outside.jpg").write_bytes(IMAGES[1])
    (media / "link.jpg").symlink_to(tmp_path / "outside.jpg")
    renderer = ChatRenderer.from_checkpoint(model_dir, MediaPolicy(file_root=media))
    raw = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": (media / "a.jpg").as_uri()}}]}]
    assert renderer.render(messages(raw)).images == [IMAGES[0]]
    for escape in (f"file://{media}/../outside.jpg", (media / "link.jpg").as_uri(), "file://otherhost/a.jpg"):
        _refusal(renderer, escape)
    assert "cannot read" in _refusal(renderer, (media / "missing.jpg").as_uri()).message


@pytest.mark.parametrize("part", [image_part(IMAGES[0]), video_part(CLIPS[0])], ids=["image", "video"])
def test_media_only_in_user_messages(renderer: ChatRenderer, part: dict):
    raw = [{"role": "assistant", "content": [part]}]
    with pytest.raises(OpenAIError) as info:
        renderer.render(messages(raw))
    assert info.value.status == 400 and "only taken in user messages" in info.value.message
    assert info.value.param == f"messages[0].content[0].{part['type']}"


def _video_refusal(renderer: ChatRenderer, url: str) -> OpenAIError:
    raw = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "x"}, image_part(IMAGES[0]),
                                     {"type": "video_url", "video_url": {"url": url}}]},
    ]  # fmt: skip
    with pytest.raises(OpenAIError) as info:
        renderer.render(messages(raw))
    assert info.value.status == 400 and info.value.param == "messages[1].content[2].video_url", info.value.body()
    return info.value


@pytest.mark.parametrize(
    "url, fragment, code",
    [
        ("http://127.0.0.1:1/clip.webm", "remote video URLs are not fetched", "invalid_video_url"),
        ("https://example.com/clip.mp4", "remote video URLs are not fetched", "invalid_video_url"),
        ("data:video/webm;base64,@@not base64@@", "not valid base64", "invalid_video_url"),
        ("data:video/webm;base64,", "holds no data", "invalid_video_url"),
        ("data:nonsense", "a data URI must look like", "invalid_video_url"),
        ("ftp://host/clip.webm", "must be a data: URI", None),
        ("file:///etc/hostname", "file:// video URLs are off", None),
    ],
)
def test_bad_video_urls_are_400_naming_the_part(renderer: ChatRenderer, url: str, fragment: str, code: str | None):
    error = _video_refusal(renderer, url)
    assert fragment in error.message and error.code == code


def test_a_video_over_its_byte_limit_is_refused_before_decoding(model_dir: Path, monkeypatch: pytest.MonkeyPatch):
    clip = CLIPS[0]
    # The video limit is the video's own: an image of the same size passes.
    small = ChatRenderer.from_checkpoint(model_dir, MediaPolicy(max_video_bytes=len(clip)))
    assert small.render(messages([{"role": "user", "content": [video_part(clip)]}])).videos == [clip]
    big_image = synthetic_image(96, 96, 9)
    assert len(big_image) > len(clip)
    assert small.render(messages([{"role": "user", "content": [image_part(big_image)]}])).images == [big_image]
    # One byte over: refused after the base64 decode (the payload length cannot tell).
    tight = ChatRenderer.from_checkpoint(model_dir, MediaPolicy(max_video_bytes=len(clip) - 1))
    error = _video_refusal(tight, data_uri(clip, "video/webm"))
    assert error.code == "video_too_large" and f"has {len(clip)} bytes" in error.message
    # Far over: refused from the payload's length, base64 never decodes it.
    import client.openai_server.prompt as prompt

    payload, real_decode = base64.b64encode(clip).decode(), base64.b64decode

    def decode_but_not_the_video(data, *args, **kwargs):
        assert data != payload, "decoded a video over the limit"
        return real_decode(data, *args, **kwargs)

    monkeypatch.setattr(prompt.base64, "b64decode", decode_but_not_the_video)
    limited = ChatRenderer.from_checkpoint(model_dir, MediaPolicy(max_video_bytes=len(clip) // 2))
    assert _video_refusal(limited, data_uri(clip, "video/webm")).code == "video_too_large"


def test_the_video_limit_defaults_to_the_models_limit():
    assert MediaPolicy().max_video_bytes == VideoLimits().max_video_bytes == 64 << 20


def test_video_file_urls_read_only_under_the_media_folder_within_the_limit(model_dir: Path, tmp_path: Path):
    media = tmp_path / "media"
    media.mkdir()
    (media / "a.webm").write_bytes(CLIPS[0])
    (tmp_path / "outside.webm").write_bytes(CLIPS[1])
    renderer = ChatRenderer.from_checkpoint(model_dir, MediaPolicy(file_root=media))
    url = (media / "a.webm").as_uri()
    raw = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}]}]
    assert renderer.render(messages(raw)).videos == [CLIPS[0]]
    escape = f"file://{media}/../outside.webm"
    assert _video_refusal(renderer, escape).code == "invalid_video_url"
    small = ChatRenderer.from_checkpoint(model_dir, MediaPolicy(file_root=media, max_video_bytes=len(CLIPS[0]) - 1))
    assert _video_refusal(small, url).code == "video_too_large"

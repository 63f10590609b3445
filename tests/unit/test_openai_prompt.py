"""Chat messages -> prompt and images: the same prompt ``vllm serve`` renders (checked against
vLLM's own chat parsing and template code on the tiny checkpoint), images in message order, and
the media policy (data URIs, file:// only under the media folder, never a network fetch)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from client.epd_client import chat_prompt
from client.openai_server.errors import OpenAIError
from client.openai_server.prompt import ChatRenderer, MediaPolicy, template_takes_parts
from client.openai_server.schemas import ChatCompletionRequest, Message
from tests.images import synthetic_image

IMAGES = [synthetic_image(32 + 8 * i, 32, i) for i in range(3)]


def data_uri(data: bytes, mime: str = "image/jpeg") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_uri(data)}}


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


def test_images_only_in_user_messages(renderer: ChatRenderer):
    raw = [{"role": "assistant", "content": [image_part(IMAGES[0])]}]
    with pytest.raises(OpenAIError) as info:
        renderer.render(messages(raw))
    assert info.value.status == 400 and "only taken in user messages" in info.value.message

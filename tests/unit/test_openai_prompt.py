"""Chat messages -> prompt, images, videos and audio files: the same prompt ``vllm serve`` renders
(checked against vLLM's own chat parsing and template code on the tiny checkpoints), media in
message order, and the media policy (data URIs, file:// only under the media folder, never a
network fetch, a byte limit per kind, input_audio's formats)."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.audio_clips import tone, wav
from builders.default_model import DEFAULT_AUDIO_MODEL_DIR, build_default_model
from client.epd_client import chat_prompt
from client.openai_server.errors import OpenAIError
from client.openai_server.prompt import AUDIO_FORMATS, ChatRenderer, MediaPolicy, template_takes_parts
from client.openai_server.schemas import AudioUrlPart, ChatCompletionRequest, InputAudioPart, Message
from python_backends import contract
from python_backends.request.generate import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER
from python_backends.request.videos import VideoLimits
from tests.images import synthetic_image
from tests.videos import ClipSpec, make_clip

IMAGES = [synthetic_image(32 + 8 * i, 32, i) for i in range(3)]
CLIPS = [make_clip(ClipSpec("vp8", 64, 48, 5, 1.0, seed=30 + i)) for i in range(2)]
AUDIOS = [wav(tone(0.5 + 0.25 * i, 440.0, seed=40 + i)) for i in range(3)]


def data_uri(data: bytes, mime: str = "image/jpeg") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_uri(data)}}


def video_part(data: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": data_uri(data, "video/webm")}}


def input_audio_part(data: bytes, format: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode("ascii"), "format": format}}


def audio_url_part(data: bytes) -> dict:
    return {"type": "audio_url", "audio_url": {"url": data_uri(data, "audio/wav")}}


def messages(raw: list[dict]) -> list[Message]:
    return ChatCompletionRequest(model="llm", messages=raw).messages


@pytest.fixture(scope="module")
def renderer(model_dir: Path) -> ChatRenderer:
    return ChatRenderer.from_checkpoint(model_dir, MediaPolicy())


@pytest.fixture(scope="module")
def audio_dir() -> Path:
    """The tiny Qwen2-Audio checkpoint (its chat template: builders/tiny_audio.py)."""
    return build_default_model(DEFAULT_AUDIO_MODEL_DIR, recipe="qwen2-audio")


@pytest.fixture(scope="module")
def audio_renderer(audio_dir: Path) -> ChatRenderer:
    return ChatRenderer.from_checkpoint(audio_dir, MediaPolicy())


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


AUDIO_CHATS = {
    "one audio": [{"role": "user", "content": [input_audio_part(AUDIOS[0]), {"type": "text", "text": "What?"}]}],
    "both audio parts between texts": [
        {"role": "system", "content": "Listen."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "First"},
                audio_url_part(AUDIOS[0]),
                {"type": "text", "text": "then"},
                input_audio_part(AUDIOS[1]),
            ],
        },
    ],
    "audios across turns": [
        {"role": "user", "content": [audio_url_part(AUDIOS[2])]},
        {"role": "assistant", "content": "A tone."},
        {"role": "user", "content": [input_audio_part(AUDIOS[0]), {"type": "text", "text": "Same?"}]},
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


def test_audio_prompts_are_the_ones_vllm_serve_renders(audio_renderer: ChatRenderer, audio_dir: Path):
    for name, raw in AUDIO_CHATS.items():
        assert audio_renderer.render(messages(raw)).prompt == vllm_prompt(audio_dir, raw), name


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


@pytest.mark.parametrize(
    "part",
    [image_part(IMAGES[0]), video_part(CLIPS[0]), input_audio_part(AUDIOS[0]), audio_url_part(AUDIOS[0])],
    ids=["image", "video", "input_audio", "audio_url"],
)
def test_media_only_in_user_messages(renderer: ChatRenderer, part: dict):
    raw = [{"role": "assistant", "content": [part]}]
    with pytest.raises(OpenAIError) as info:
        renderer.render(messages(raw))
    assert info.value.status == 400 and "only taken in user messages" in info.value.message
    assert info.value.param == f"messages[0].content[0].{part['type']}"


def refused_undecoded(monkeypatch: pytest.MonkeyPatch, media: bytes, refusal: Callable[[], OpenAIError]) -> OpenAIError:
    """``refusal()``'s error, asserting that base64 never decoded ``media``'s payload on the way
    (over the limit by its length alone)."""
    import client.openai_server.prompt as prompt

    payload, real_decode = base64.b64encode(media).decode(), base64.b64decode

    def decode_but_not_the_media(data, *args, **kwargs):
        assert data != payload, "decoded media over the limit"
        return real_decode(data, *args, **kwargs)

    monkeypatch.setattr(prompt.base64, "b64decode", decode_but_not_the_media)
    return refusal()


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
    limited = ChatRenderer.from_checkpoint(model_dir, MediaPolicy(max_video_bytes=len(clip) // 2))
    refusal = refused_undecoded(monkeypatch, clip, lambda: _video_refusal(limited, data_uri(clip, "video/webm")))
    assert refusal.code == "video_too_large"


def test_the_video_limit_defaults_to_the_models_limit():
    assert MediaPolicy().max_video_bytes == VideoLimits().max_video_bytes == 64 << 20


def test_the_schema_takes_input_audio_and_audio_url_parts():
    raw = [{"role": "user", "content": [input_audio_part(AUDIOS[0], "mp3"), audio_url_part(AUDIOS[1])]}]
    first, second = messages(raw)[0].content  # type: ignore[misc]
    assert isinstance(first, InputAudioPart) and first.input_audio.format == "mp3"
    assert base64.b64decode(first.input_audio.data) == AUDIOS[0]
    assert isinstance(second, AudioUrlPart) and second.audio_url.url == data_uri(AUDIOS[1], "audio/wav")
    for extra in ({**input_audio_part(AUDIOS[0]), "url": "x"}, {"type": "input_audio", "input_audio": {"data": ""}}):
        with pytest.raises(ValueError):
            messages([{"role": "user", "content": [extra]}])


def test_audio_parts_are_the_audio_placeholder_and_come_in_message_order(audio_renderer: ChatRenderer):
    rendered = audio_renderer.render(messages(AUDIO_CHATS["audios across turns"]))
    assert rendered.audios == [AUDIOS[2], AUDIOS[0]]  # bytes as sent, both part kinds, in message order
    assert (rendered.images, rendered.videos) == ([], [])
    assert rendered.prompt.count(AUDIO_PLACEHOLDER) == 2
    assert (
        f"Audio 1: {AUDIO_PLACEHOLDER}\n" in rendered.prompt
        and f"Audio 2: {AUDIO_PLACEHOLDER}\nSame?" in rendered.prompt
    )
    # The prompt client.epd_client.chat_prompt builds for audio is the chat's.
    raw = [{"role": "user", "content": [input_audio_part(AUDIOS[0]), audio_url_part(AUDIOS[1]),
                                        {"type": "text", "text": "What?"}]}]  # fmt: skip
    assert audio_renderer.render(messages(raw)).prompt == chat_prompt("What?", 0, 2)


def test_audio_comes_apart_from_images_and_videos(renderer: ChatRenderer):
    raw = [{"role": "user", "content": [image_part(IMAGES[0]), input_audio_part(AUDIOS[1]), video_part(CLIPS[0]),
                                        audio_url_part(AUDIOS[0])]}]  # fmt: skip
    rendered = renderer.render(messages(raw))
    assert (rendered.images, rendered.videos, rendered.audios) == ([IMAGES[0]], [CLIPS[0]], [AUDIOS[1], AUDIOS[0]])


def _audio_refusal(renderer: ChatRenderer, part: dict) -> OpenAIError:
    raw = [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}]
    with pytest.raises(OpenAIError) as info:
        renderer.render(messages(raw))
    assert info.value.status == 400 and info.value.param.startswith(f"messages[0].content[1].{part['type']}")
    return info.value


@pytest.mark.parametrize(
    "part, fragment, code",
    [
        (input_audio_part(AUDIOS[0], "aac"), "not one of wav, mp3, flac, ogg, opus", "invalid_audio_format"),
        (input_audio_part(AUDIOS[0], "WAV"), "not one of", "invalid_audio_format"),
        ({"type": "input_audio", "input_audio": {"data": "@@not base64@@", "format": "wav"}}, "not valid base64",
         "invalid_input_audio"),
        ({"type": "input_audio", "input_audio": {"data": "data:audio/wav;base64,AAAA", "format": "wav"}},
         "not valid base64", "invalid_input_audio"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "mp3"}}, "holds no data", "invalid_input_audio"),
        ({"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,@@"}}, "not valid base64",
         "invalid_audio_url"),
        ({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}, "remote audio URLs are not fetched",
         "invalid_audio_url"),
        ({"type": "audio_url", "audio_url": {"url": "file:///etc/hostname"}}, "file:// audio URLs are off", None),
    ],
)  # fmt: skip
def test_bad_audio_parts_are_400_naming_the_part(renderer: ChatRenderer, part: dict, fragment: str, code: str | None):
    error = _audio_refusal(renderer, part)
    assert fragment in error.message and error.code == code, error.body()


def test_a_wrong_input_audio_format_names_the_format_field(renderer: ChatRenderer):
    error = _audio_refusal(renderer, input_audio_part(AUDIOS[0], "webm"))
    assert error.param == "messages[0].content[1].input_audio.format"
    assert all(name in error.message for name in AUDIO_FORMATS)


@pytest.mark.parametrize("make_part", [input_audio_part, audio_url_part], ids=["input_audio", "audio_url"])
def test_audio_over_its_byte_limit_is_refused_before_decoding(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                              make_part) -> None:  # fmt: skip
    clip = AUDIOS[2]
    exact = ChatRenderer.from_checkpoint(model_dir, MediaPolicy(max_audio_bytes=len(clip)))
    assert exact.render(messages([{"role": "user", "content": [make_part(clip)]}])).audios == [clip]
    tight = ChatRenderer.from_checkpoint(model_dir, MediaPolicy(max_audio_bytes=len(clip) - 1))
    error = _audio_refusal(tight, make_part(clip))
    assert error.code == "audio_too_large" and f"has {len(clip)} bytes" in error.message
    limited = ChatRenderer.from_checkpoint(model_dir, MediaPolicy(max_audio_bytes=len(clip) // 2))
    refusal = refused_undecoded(monkeypatch, clip, lambda: _audio_refusal(limited, make_part(clip)))
    assert refusal.code == "audio_too_large"


def test_the_audio_limit_defaults_to_the_models_limit():
    assert MediaPolicy().max_audio_bytes == contract.default_of(contract.MAX_AUDIO_BYTES) == 25 << 20


@pytest.mark.parametrize(("kind", "items", "suffix"), [("video", CLIPS, "webm"), ("audio", AUDIOS, "wav")])
def test_file_urls_read_only_under_the_media_folder_within_the_limit(
    model_dir: Path, tmp_path: Path, kind: str, items: list[bytes], suffix: str
) -> None:
    media = tmp_path / "media"
    media.mkdir()
    (media / f"a.{suffix}").write_bytes(items[0])
    (tmp_path / f"outside.{suffix}").write_bytes(items[1])

    def chat(url: str) -> list:
        return messages([{"role": "user", "content": [{"type": f"{kind}_url", f"{kind}_url": {"url": url}}]}])

    def refusal(renderer: ChatRenderer, url: str) -> OpenAIError:
        with pytest.raises(OpenAIError) as info:
            renderer.render(chat(url))
        assert info.value.status == 400 and info.value.param == f"messages[0].content[0].{kind}_url", info.value.body()
        return info.value

    renderer = ChatRenderer.from_checkpoint(model_dir, MediaPolicy(file_root=media))
    url = (media / f"a.{suffix}").as_uri()
    assert getattr(renderer.render(chat(url)), f"{kind}s") == [items[0]]
    assert refusal(renderer, f"file://{media}/../outside.{suffix}").code == f"invalid_{kind}_url"
    limit = {f"max_{kind}_bytes": len(items[0]) - 1}
    assert refusal(ChatRenderer.from_checkpoint(model_dir, MediaPolicy(file_root=media, **limit)), url).code == (
        f"{kind}_too_large"
    )



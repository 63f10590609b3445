"""Chat messages -> (prompt text, images, videos, audios): the checkpoint's chat template rendered
as ``vllm serve`` renders it, and the encoded images, videos and audio files, each in message order.

vLLM (``vllm/renderers/chat_utils.py`` and ``hf.py``) decides per template whether message content
goes in as a string or as OpenAI-style parts: a template that loops over ``message['content']``
gets parts, ``{"type": "text", "text": ...}`` for text, ``{"type": "image"}`` for each
``image_url`` part, ``{"type": "video"}`` for each ``video_url`` part and ``{"type": "audio"}`` for
each ``audio_url`` (vLLM's extensions) or OpenAI ``input_audio`` part (a string content becomes
one text part); any other template gets the texts joined with newlines
(and a chat with media is refused here). It then calls the tokenizer's
``apply_chat_template(..., add_generation_prompt=True, tokenize=False)``. This module does the
same, so the same chat gives the same prompt here and there.

Media come only from ``data:`` URIs, ``file://`` URLs under a configured folder or (audio)
``input_audio``'s base64, through one loader with a byte limit per kind: the server never fetches
from the network (a remote URL is a 400).
"""

from __future__ import annotations

import base64
import binascii
import re
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from client.openai_server.errors import OpenAIError, bad_request
from client.openai_server.media_files import FileRefused, FileTooLarge, read_media_file
from client.openai_server.schemas import InputAudio, InputAudioPart, MediaPart, Message, TextPart
from python_backends import contract

_DATA_URI = re.compile(r"\Adata:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,", re.I)


MediaKind = Literal["image", "video", "audio"]
# The kind of media each content part type carries.
PART_KINDS: dict[str, MediaKind] = {
    "image_url": "image",
    "video_url": "video",
    "audio_url": "audio",
    "input_audio": "audio",
}
# ``input_audio``'s formats: the containers the audio models decode (WAV, FLAC, MP3, Ogg Vorbis/Opus).
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus")


@dataclass(frozen=True)
class MediaPolicy:
    """Where media may come from. ``file_root``: the folder ``file://`` URLs may read (None: no
    files); ``max_image_bytes`` / ``max_video_bytes`` / ``max_audio_bytes``: refused before any
    decode (the models check their own limits too; these defaults are the models' defaults)."""

    file_root: Path | None = None
    max_image_bytes: int = int(contract.default_of(contract.MAX_IMAGE_BYTES))
    max_video_bytes: int = int(contract.default_of(contract.MAX_VIDEO_BYTES))
    max_audio_bytes: int = int(contract.default_of(contract.MAX_AUDIO_BYTES))

    def max_bytes(self, kind: MediaKind) -> int:
        return {"image": self.max_image_bytes, "video": self.max_video_bytes, "audio": self.max_audio_bytes}[kind]


def _too_large(kind: MediaKind, size: int, max_bytes: int, param: str) -> OpenAIError:
    return bad_request(f"the {kind} has {size} bytes, over the limit of {max_bytes}", param, f"{kind}_too_large")


def _sized(data: bytes, param: str, kind: MediaKind, max_bytes: int, invalid: str) -> bytes:
    if not data:
        raise bad_request(f"the {kind} holds no data", param, invalid)
    if len(data) > max_bytes:
        raise _too_large(kind, len(data), max_bytes, param)
    return data


def decode_base64(payload: str, param: str, kind: MediaKind, max_bytes: int, invalid: str) -> bytes:
    """Base64 media, refused from the payload's length alone when it would decode over the limit."""
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:  # over the limit before a byte is decoded
        raise bad_request(f"the {kind} is over the limit of {max_bytes} bytes", param, f"{kind}_too_large")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"the {kind} data is not valid base64: {exc}", param, invalid) from None
    return _sized(data, param, kind, max_bytes, invalid)


def decode_data_uri(url: str, param: str, kind: MediaKind, max_bytes: int) -> bytes:
    invalid = f"invalid_{kind}_url"
    match = _DATA_URI.match(url)
    if match is None:
        raise bad_request("a data URI must look like data:<mime type>;base64,<data>", param, invalid)
    payload = url[match.end() :]
    if match["b64"] is None:
        return _sized(urllib.parse.unquote_to_bytes(payload), param, kind, max_bytes, invalid)
    return decode_base64(payload, param, kind, max_bytes, invalid)


def read_file_url(url: str, param: str, kind: MediaKind, policy: MediaPolicy) -> bytes:
    """A ``file://`` URL's bytes: only a regular file under the media folder (``media_files.py``)."""
    if policy.file_root is None:
        raise bad_request(f"file:// {kind} URLs are off (the server was started without a media folder)", param)
    max_bytes = policy.max_bytes(kind)
    try:
        data = read_media_file(url, policy.file_root, max_bytes)
    except FileTooLarge as exc:
        raise _too_large(kind, exc.size, max_bytes, param) from None
    except FileRefused as exc:
        raise bad_request(str(exc), param, f"invalid_{kind}_url") from None
    return _sized(data, param, kind, max_bytes, f"invalid_{kind}_url")


def load_media(url: str, param: str, kind: MediaKind, policy: MediaPolicy) -> bytes:
    """The bytes of an ``image_url``, ``video_url`` or ``audio_url`` part, never fetched from the network."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_data_uri(url, param, kind, policy.max_bytes(kind))
    if scheme == "file":
        return read_file_url(url, param, kind, policy)
    if scheme in ("http", "https"):
        message = f"remote {kind} URLs are not fetched; send the {kind} as a data: URI"
        raise bad_request(message, param, f"invalid_{kind}_url")
    raise bad_request(f"the {kind} URL must be a data: URI (or a file:// URL under the media folder)", param)


def load_input_audio(audio: InputAudio, param: str, policy: MediaPolicy) -> bytes:
    """The bytes of OpenAI's ``input_audio`` part: base64 ``data`` in one of :data:`AUDIO_FORMATS`."""
    if audio.format not in AUDIO_FORMATS:
        message = f"the audio format {audio.format!r} is not one of {', '.join(AUDIO_FORMATS)}"
        raise bad_request(message, f"{param}.format", "invalid_audio_format")
    return decode_base64(audio.data, param, "audio", policy.max_bytes("audio"), "invalid_input_audio")


def load_part(part: MediaPart, param: str, policy: MediaPolicy) -> bytes:
    """The bytes of a media content part (its kind: ``PART_KINDS[part.type]``)."""
    if isinstance(part, InputAudioPart):
        return load_input_audio(part.input_audio, param, policy)
    url = getattr(part, part.type).url  # image_url.url, video_url.url, audio_url.url
    return load_media(url, param, PART_KINDS[part.type], policy)


def template_takes_parts(chat_template: str) -> bool:
    """vLLM's content-format detection, in short: does the template loop over a message's content?"""
    import jinja2
    import jinja2.nodes as nodes

    try:
        tree = jinja2.Environment().parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return True  # vLLM's default for a template it cannot parse ("auto" -> openai) would apply
    message_names = {
        loop.target.name
        for loop in tree.find_all(nodes.For)
        if isinstance(loop.iter, nodes.Name) and loop.iter.name == "messages" and isinstance(loop.target, nodes.Name)
    }
    for loop in tree.find_all(nodes.For):
        iterated = loop.iter
        if isinstance(iterated, nodes.Getitem) and isinstance(iterated.arg, nodes.Const):
            owner, key = iterated.node, iterated.arg.value
        elif isinstance(iterated, nodes.Getattr):
            owner, key = iterated.node, iterated.attr
        else:
            continue
        if key == "content" and isinstance(owner, nodes.Name) and owner.name in message_names:
            return True
    return False


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's fallback for a template without a developer role: developer messages become system
    messages, and when a system message is then not the first (or not the only) one, all system
    texts are merged, blank-line separated, into one system message at the front."""
    converted = [{**entry, "role": "system"} if entry["role"] == "developer" else entry for entry in conversation]
    systems = [i for i, entry in enumerate(converted) if entry["role"] == "system"]
    if not systems or systems == [0]:
        return converted
    texts = []
    for i in systems:
        content = converted[i].get("content", "")
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content if "text" in part)
        if content:
            texts.append(content)
    rest = [entry for entry in converted if entry["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


@dataclass(frozen=True)
class RenderedChat:
    prompt: str
    images: list[bytes]
    videos: list[bytes]
    audios: list[bytes] = field(default_factory=list)


class ChatRenderer:
    """Renders chats with one tokenizer's chat template (``tokenizer.apply_chat_template``)."""

    def __init__(self, tokenizer: Any, policy: MediaPolicy) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the checkpoint's tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.policy = policy
        self.takes_parts = template_takes_parts(tokenizer.chat_template)
        # vLLM's test for a template that knows the developer role; others get it as system.
        self.takes_developer = any(quoted in tokenizer.chat_template for quoted in ('"developer"', "'developer'"))

    @classmethod
    def from_checkpoint(cls, model_dir: Path, policy: MediaPolicy) -> ChatRenderer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(model_dir)), policy)

    def render(self, messages: Sequence[Message]) -> RenderedChat:
        conversation: list[dict[str, Any]] = []
        media: dict[MediaKind, list[bytes]] = {"image": [], "video": [], "audio": []}
        for m_index, message in enumerate(messages):
            content = message.content
            parts: list[TextPart | MediaPart] = (
                []
                if content is None
                else list(content)
                if isinstance(content, list)
                else [TextPart(type="text", text=content)]
            )
            converted: list[dict[str, Any]] = []
            for p_index, part in enumerate(parts):
                if isinstance(part, TextPart):
                    converted.append({"type": "text", "text": part.text})
                    continue
                kind = PART_KINDS[part.type]
                param = f"messages[{m_index}].content[{p_index}].{part.type}"
                if message.role != "user":
                    raise bad_request(f"{kind} parts are only taken in user messages", param)
                media[kind].append(load_part(part, param, self.policy))
                converted.append({"type": kind})  # vLLM's part for the template: {"type": "image" | "video" | "audio"}
            if self.takes_parts:
                entry: dict[str, Any] = {"role": message.role, "content": converted}
            elif any(part["type"] != "text" for part in converted):
                raise bad_request(
                    "this checkpoint's chat template takes no image, video or audio parts", f"messages[{m_index}]"
                )
            else:
                entry = {"role": message.role, "content": "\n".join(part["text"] for part in converted)}
            if message.name is not None:
                entry["name"] = message.name
            conversation.append(entry)
        if any(entry["role"] == "developer" for entry in conversation) and not self.takes_developer:
            conversation = _developer_as_system(conversation)
        try:
            prompt = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # a template's own raise_exception (e.g. roles out of order)
            raise bad_request(f"the chat template refused these messages: {exc}", "messages") from None
        try:
            str(prompt).encode("utf-8")  # lone surrogates survive JSON but not the wire
        except UnicodeEncodeError:
            raise bad_request("the messages are not valid Unicode text", "messages") from None
        return RenderedChat(str(prompt), media["image"], media["video"], media["audio"])

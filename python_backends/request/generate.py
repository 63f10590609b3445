"""The user-facing request shared by ``llm``, ``ensemble`` and ``epd``.

Inputs follow Triton's vllm_backend so its users feel at home: ``text_input``,
``image`` (one or more encoded images), ``stream``, ``sampling_parameters`` (JSON),
``exclude_input_in_output``. Parsing is plain numpy -> dataclass so it is unit-tested
without Triton; ``model.py`` only reads the tensors and maps errors to codes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from python_backends import contract
from python_backends.errors import invalid_arg
from python_backends.request.image_embeds import (
    EmbedsSpec,
    ImageEmbedsInput,
    parse_image_embeds,
)
from python_backends.request.images import ImageLimits, check_image_header, image_bytes
from python_backends.request.sampling import SamplingLimits, parse_sampling_parameters
from python_backends.request.videos import VideoLimits, sized_video_bytes
from python_backends.runtime.model_params import ModelParameters

IMAGE_PAD = "<|image_pad|>"
# An ``image`` item that names a pre-encoded image instead of carrying it (``epd`` only).
MM_HASH_PREFIX = b"mm_hash:"
_MM_HASH = re.compile(rb"mm_hash:([0-9a-f]{64})")
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PAD = "<|video_pad|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
# Qwen2-Audio's, as its chat template writes it per clip (vLLM expands <|AUDIO|> to the clip's tokens).
AUDIO_PAD = "<|AUDIO|>"
AUDIO_PLACEHOLDER = "<|audio_bos|><|AUDIO|><|audio_eos|>"


@dataclass(frozen=True)
class RequestLimits:
    images: ImageLimits = field(default_factory=ImageLimits)
    sampling: SamplingLimits = field(default_factory=SamplingLimits)
    # The checkpoint's sampling defaults (request/generation_defaults.py): a request's own values win.
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    max_prompt_chars: int = 200_000
    # Precomputed embeddings accepted (``image_embeds`` + ``image_grid_thw``) when set.
    image_embeds: EmbedsSpec | None = None
    # ``mm_hash:<key>`` image items accepted (models with an embedding store).
    accept_mm_hash: bool = False
    # ``video`` items accepted (up to this many). Their header checks and decode are
    # python_backends.engines.videos's on ``llm``, the encoders' video preprocessing on ``epd``.
    max_videos: int = 0
    # ``audio`` items accepted (up to this many; python_backends.request.audios decodes them).
    max_audios: int = 0


def request_limits(
    params: ModelParameters,
    image_embeds: EmbedsSpec | None = None,
    accept_mm_hash: bool = False,
    max_videos: int = 0,
    max_audios: int = 0,
    sampling_defaults: Mapping[str, Any] | None = None,
) -> RequestLimits:
    """The user-facing limits from a model's config.pbtxt parameters (llm, epd)."""
    return RequestLimits(
        images=ImageLimits(
            max_images=params.integer(contract.MAX_IMAGES),
            max_image_bytes=params.integer(contract.MAX_IMAGE_BYTES),
            max_image_pixels=params.integer(contract.MAX_IMAGE_PIXELS),
        ),
        sampling=SamplingLimits.from_params(params),
        sampling_defaults=dict(sampling_defaults or {}),
        image_embeds=image_embeds,
        accept_mm_hash=accept_mm_hash,
        max_videos=max_videos,
        max_audios=max_audios,
    )


@dataclass(frozen=True)
class CachedImage:
    """An image already in the embedding store, named by its ``mm_hash`` (the content key a
    warm-up encode returned)."""

    mm_hash: str


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str  # with one image placeholder per image, in order
    images: list[bytes | CachedImage]  # encoded images (not decoded yet) or pre-encoded ones
    stream: bool
    sampling: dict[str, Any]  # keyword arguments for vllm.SamplingParams
    exclude_input_in_output: bool
    # Instead of ``images``: the vision encoder's output for every image, validated.
    image_embeds: ImageEmbedsInput | None = None
    # Encoded videos: as sent (raw or base64) from parse_generate_request, which checks only
    # their count; ``llm`` checks and loads them, ``epd`` takes raw bytes (raw_videos) and its
    # encoders check the containers.
    videos: list[bytes] = field(default_factory=list)
    # Encoded audio clips as sent (raw or base64); ``llm`` decodes them (request/audios.py).
    audios: list[bytes] = field(default_factory=list)


def _scalar(inputs: Mapping[str, np.ndarray], name: str) -> Any | None:
    array = inputs.get(name)
    if array is None:
        return None
    if array.size != 1:
        raise invalid_arg(f"input '{name}' must hold exactly one element, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _bool(inputs: Mapping[str, np.ndarray], name: str) -> bool | None:
    value = _scalar(inputs, name)
    if value is None:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise invalid_arg(f"input '{name}' must be BOOL")
    return bool(value)


def _text(value: Any, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise invalid_arg(f"input '{name}' is not valid UTF-8") from None
    if isinstance(value, str):
        return value
    raise invalid_arg(f"input '{name}' must be BYTES (a UTF-8 string)")


def with_image_placeholders(text: str, num_images: int) -> str:
    """The prompt for vLLM: placeholders as the client wrote them, or prepended.

    A client that formats its own (chat) prompt writes one
    ``<|vision_start|><|image_pad|><|vision_end|>`` per image where it wants it; a plain
    text prompt gets them in front, in image order.
    """
    written = text.count(IMAGE_PAD)
    if written == num_images:
        return text
    if written == 0:
        return IMAGE_PLACEHOLDER * num_images + text
    raise invalid_arg(
        f"text_input has {written} {IMAGE_PAD} placeholders but the request has "
        f"{num_images} images; write one per image or none"
    )


def with_video_placeholders(text: str, num_videos: int) -> str:
    """As :func:`with_image_placeholders`, for ``<|video_pad|>``: the client's, or prepended."""
    return _with_placeholders(text, num_videos, VIDEO_PAD, VIDEO_PLACEHOLDER, "videos")


def with_audio_placeholders(text: str, num_audios: int) -> str:
    """As :func:`with_image_placeholders`, for ``<|AUDIO|>``: the client's, or prepended."""
    return _with_placeholders(text, num_audios, AUDIO_PAD, AUDIO_PLACEHOLDER, "audios")


def _with_placeholders(text: str, count: int, pad: str, placeholder: str, what: str) -> str:
    written = text.count(pad)
    if written == count:
        return text
    if written == 0:
        return placeholder * count + text
    raise invalid_arg(
        f"text_input has {written} {pad} placeholders but the request has {count} {what}; "
        f"write one per {what[:-1]} or none"
    )


def _encoded_items(inputs: Mapping[str, np.ndarray], name: str, what: str, limit: int) -> list[bytes]:
    """The items of a BYTES media input (``image``, ``video``) as sent, at most ``limit``
    (``max_images``, ``max_videos``; 0: the model takes none)."""
    array = inputs.get(name)
    if array is None:
        return []
    if array.dtype != np.object_:
        raise invalid_arg(f"input '{name}' must be BYTES (encoded {what})")
    items = [bytes(item) if isinstance(item, (bytes, np.bytes_)) else b"" for item in array.reshape(-1)]
    if items and not limit:
        raise invalid_arg(f"this model takes no {what[:-1]} (max_{what} is 0)")
    if len(items) > limit:
        raise invalid_arg(f"request has {len(items)} {what}, above the limit of {limit} (max_{what})")
    return items


def _image_item(item: bytes, index: int, limits: RequestLimits) -> bytes | CachedImage:
    if not item.startswith(MM_HASH_PREFIX):
        return image_bytes(item, index)
    if not limits.accept_mm_hash:
        raise invalid_arg(f"image {index}: mm_hash references are served by epd; send the image bytes to this model")
    match = _MM_HASH.fullmatch(item.strip())
    if match is None:
        raise invalid_arg(f"image {index}: an mm_hash reference is 'mm_hash:' + 64 lowercase hex characters")
    return CachedImage(match.group(1).decode())


def _media_taken(limits: RequestLimits) -> str:
    """What a model takes besides text, in words: "image or video", "audio"."""
    counts = (("image", limits.images.max_images), ("video", limits.max_videos), ("audio", limits.max_audios))
    kinds = [kind for kind, count in counts if count] or ["media"]
    return " or ".join(kinds) if len(kinds) < 3 else f"{', '.join(kinds[:-1])} or {kinds[-1]}"


def parse_generate_request(
    inputs: Mapping[str, np.ndarray], limits: RequestLimits
) -> GenerateRequest:
    text_value = _scalar(inputs, contract.TEXT_INPUT)
    if text_value is None:
        raise invalid_arg("missing required input 'text_input'")
    text = _text(text_value, contract.TEXT_INPUT)
    if len(text) > limits.max_prompt_chars:
        raise invalid_arg(
            f"text_input has {len(text)} characters, above the limit of {limits.max_prompt_chars}"
        )

    embeds = parse_image_embeds(inputs, limits.image_embeds, limits.images.max_images)
    raw_images = _encoded_items(inputs, contract.IMAGE, "images", limits.images.max_images)
    images = [_image_item(item, i, limits) for i, item in enumerate(raw_images)]
    num_images = len(images) + (embeds.num_images if embeds is not None else 0)
    videos = _encoded_items(inputs, contract.VIDEO, "videos", limits.max_videos)
    audios = _encoded_items(inputs, contract.AUDIO, "audios", limits.max_audios)
    if not text and not num_images and not videos and not audios:
        raise invalid_arg(f"text_input is empty and no {_media_taken(limits)} was given")

    stream = bool(_bool(inputs, contract.STREAM))
    exclude = _bool(inputs, contract.EXCLUDE_INPUT_IN_OUTPUT)
    if exclude is None:
        exclude = stream  # as vllm_backend: full text when not streaming, deltas when streaming
    if stream and not exclude:
        raise invalid_arg("exclude_input_in_output=false is not allowed when streaming")

    sampling_raw = _scalar(inputs, contract.SAMPLING_PARAMETERS)
    sampling = parse_sampling_parameters(
        None if sampling_raw is None else _text(sampling_raw, contract.SAMPLING_PARAMETERS),
        limits.sampling,
        limits.sampling_defaults,
    )
    return GenerateRequest(
        # Videos' placeholders go in first so that, prepended, images come before videos.
        prompt=with_image_placeholders(
            with_video_placeholders(with_audio_placeholders(text, len(audios)), len(videos)), num_images
        ),
        images=images,
        stream=stream,
        sampling=sampling,
        exclude_input_in_output=exclude,
        image_embeds=embeds,
        videos=videos,
        audios=audios,
    )


def check_image_headers(request: GenerateRequest, limits: RequestLimits) -> None:
    """Header checks (bytes, pixels, aspect ratio) of every image sent as bytes, at the edge,
    so that a bad image is refused with its own index before any stage works on the request
    (``epd``; ``llm`` checks while decoding)."""
    for index, image in enumerate(request.images):
        if isinstance(image, bytes):
            check_image_header(image, index, limits.images)


def raw_videos(request: GenerateRequest, limits: VideoLimits) -> GenerateRequest:
    """``request`` with its videos as raw container bytes (base64 decoded), each within
    ``max_video_bytes`` (``epd``: content keys are taken over the raw bytes, as its encoders
    take them, so a video sent either way is one store entry)."""
    return replace(request, videos=[sized_video_bytes(item, i, limits) for i, item in enumerate(request.videos)])

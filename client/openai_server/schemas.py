"""The chat-completions request the API accepts, as pydantic models (FastAPI's OpenAPI schema
comes from them, and Schemathesis fuzzes from that schema).

Unknown fields are refused (``extra="forbid"``), so a misspelt parameter is a 400 that names it,
never a silent default. Besides OpenAI's sampling fields, a few of vLLM's own extensions are
taken as ``vllm serve`` takes them (``top_k``, ``min_tokens``, ``ignore_eos``, ...).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# vLLM's bound for ``seed`` (a C long); beyond it the engine would fail instead of the request.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageUrl(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(_Strict):
    type: Literal["image_url"]
    image_url: ImageUrl


class VideoUrl(_Strict):
    url: str


class VideoUrlPart(_Strict):
    """vLLM's extension: an encoded video file (``data:`` URI or ``file://`` URL)."""

    type: Literal["video_url"]
    video_url: VideoUrl


class AudioUrl(_Strict):
    url: str


class AudioUrlPart(_Strict):
    """vLLM's extension: an encoded audio file (``data:`` URI or ``file://`` URL)."""

    type: Literal["audio_url"]
    audio_url: AudioUrl


class InputAudio(_Strict):
    data: str = Field(description="the encoded audio file, base64")
    format: str = Field(description="the file's format: wav, mp3, flac, ogg or opus")


class InputAudioPart(_Strict):
    """OpenAI's audio part: a base64 audio file and its format."""

    type: Literal["input_audio"]
    input_audio: InputAudio


MediaPart = ImageUrlPart | VideoUrlPart | AudioUrlPart | InputAudioPart
ContentPart = Annotated[TextPart | MediaPart, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool | None = False


class ChatCompletionRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    user: str | None = None
    # vLLM's extensions (what `vllm serve` also accepts).
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    return_token_ids: bool | None = False  # the choice's ``token_ids``, as vLLM answers it

    def sampling_parameters(self) -> dict[str, Any]:
        """The ``sampling_parameters`` JSON for Triton (the models' names are vLLM's)."""
        params: dict[str, Any] = {}
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is not None:
            params["max_tokens"] = max_tokens
        for name in (
            "temperature",
            "top_p",
            "seed",
            "stop",
            "presence_penalty",
            "frequency_penalty",
            "top_k",
            "min_tokens",
            "repetition_penalty",
            "ignore_eos",
            "stop_token_ids",
            "skip_special_tokens",
        ):
            value = getattr(self, name)
            if value is not None:
                params[name] = value
        return params


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: str | None
    token_ids: list[int] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "triton-epd"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

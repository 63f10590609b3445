"""The chat-completions request the API accepts, as pydantic models (FastAPI's OpenAPI schema
comes from them, and Schemathesis fuzzes from that schema).

Unknown fields are refused (``extra="forbid"``), so a misspelt parameter is a 400 that names it,
never a silent default. Besides OpenAI's sampling fields (``response_format``, ``logprobs``, ``n``,
...), a few of vLLM's own extensions are taken as ``vllm serve`` takes them (``top_k``,
``min_tokens``, ``ignore_eos``, ``structured_outputs``, ``prompt_logprobs``, ...). The checks across
fields that ``vllm serve`` makes are :meth:`ChatCompletionRequest.check`'s.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from client.openai_server.errors import bad_request

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


class JsonSchema(_Strict):
    """OpenAI's ``response_format.json_schema`` (``schema`` is a pydantic name, hence the alias)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


# vLLM's StructuredOutputsParams: exactly one of these constrains the output.
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` (``json`` is a pydantic name, hence the alias)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="an EBNF grammar")
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None

    def constraints(self) -> list[str]:
        given = self.model_dump(by_alias=True, exclude_none=True)
        return [name for name in CONSTRAINTS if name in given]


class ChatCompletionRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    n: int | None = Field(1, ge=1, le=128)  # OpenAI's bound; the model's max_n is Triton's to check
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    user: str | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)  # the model's max_logprobs is Triton's to check
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions (what `vllm serve` also accepts).
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    return_token_ids: bool | None = False  # the choice's ``token_ids``, as vLLM answers it
    structured_outputs: StructuredOutputs | None = None
    prompt_logprobs: int | None = Field(None, ge=0)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    def check(self) -> None:
        """The checks across fields that ``vllm serve`` makes (its words), each a 400 naming its field."""
        if self.top_logprobs and not self.logprobs:
            raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        if self.prompt_logprobs and self.stream:
            raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        response_format = self.response_format
        if response_format is not None and response_format.type == "json_schema":
            if response_format.json_schema is None:
                message = "When response_format type is 'json_schema', the 'json_schema' field must be provided."
                raise bad_request(message, "response_format")
            if response_format.json_schema.schema_ is None:
                message = "When response_format type is 'json_schema', 'json_schema.schema' must be provided."
                raise bad_request(message, "response_format.json_schema.schema")
        if self.structured_outputs is not None:
            if response_format is not None and response_format.type != "text":
                message = "You can only use one of 'response_format' and 'structured_outputs', not both."
                raise bad_request(message, "structured_outputs")
            constraints = self.structured_outputs.constraints()
            if len(constraints) != 1:
                kind = f"multiple are specified: {constraints}" if constraints else "none are specified"
                message = f"You can only use one kind of structured outputs constraint ({', '.join(CONSTRAINTS)}) "
                raise bad_request(f"{message}but {kind}.", "structured_outputs")
        invalid = [token for token in self.logit_bias or {} if not _is_int(token)]
        if invalid:
            message = f"logit_bias contains key(s) that cannot be converted to integer token IDs: {invalid!r}"
            raise bad_request(message, "logit_bias")

    def structured_outputs_parameter(self) -> dict[str, Any] | None:
        """``structured_outputs`` for vLLM: ``response_format``'s constraint, else the request's own."""
        response_format = self.response_format
        if response_format is None or response_format.type == "text":
            if self.structured_outputs is None:
                return None
            return self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        if response_format.type == "json_object":
            return {"json_object": True}
        assert response_format.json_schema is not None  # check() answered 400 otherwise
        return {"json": response_format.json_schema.schema_}

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
            "prompt_logprobs",
            "allowed_token_ids",
            "bad_words",
        ):
            value = getattr(self, name)
            if value is not None:
                params[name] = value
        if self.n is not None and self.n != 1:
            params["n"] = self.n
        if self.logprobs:
            params["logprobs"] = self.top_logprobs or 0
        if self.logit_bias is not None:  # clamped to OpenAI's range, as vLLM does
            params["logit_bias"] = {
                str(int(token)): min(100.0, max(-100.0, bias)) for token, bias in self.logit_bias.items()
            }
        structured_outputs = self.structured_outputs_parameter()
        if structured_outputs is not None:
            params["structured_outputs"] = structured_outputs
        return params


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


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


class LogProb(BaseModel):
    """One token's log probability, OpenAI's shape: the token, its logprob and its UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogProbs(LogProb):
    """A generated token and the most likely tokens at its position (``top_logprobs`` of them)."""

    top_logprobs: list[LogProb] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogProbs] | None = None


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    # vLLM's: one entry per prompt token (the first null), {"<token id>": {logprob, rank, decoded_token}}.
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "triton-epd"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

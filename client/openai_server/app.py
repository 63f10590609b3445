"""The FastAPI app: ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``.

A chat is checked and rendered first (400 before anything reaches Triton), then forwarded.
Streamed or not, the app waits for Triton's first response before it answers, so an error the
model raises before its first token (a bad image, video or audio file, a parameter out of range) is an HTTP error
with its status; a later one ends the SSE stream with an ``error`` event. Usage counts are
Triton's ``num_input_tokens`` / ``num_output_tokens``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from client.openai_server.errors import OpenAIError, bad_request, internal, model_not_found, not_ready
from client.openai_server.prompt import ChatRenderer
from client.openai_server.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Choice,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponseMessage,
    Usage,
)
from client.openai_server.triton_backend import ChatBackend, ChatRequest, Chunk

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in ((400, "bad request"), (404, "unknown model"), (503, "Triton not ready"))
}


def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    first = exc.errors()[0] if exc.errors() else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if first.get("type") == "extra_forbidden":
        return bad_request(f"unknown parameter '{param}'", param, "unknown_parameter")
    if first.get("type") == "json_invalid":
        return bad_request("the request body is not valid JSON", None, "invalid_json")
    return bad_request(f"{param or 'body'}: {first.get('msg', 'invalid value')}", param, "invalid_value")


# The tenant (Triton request parameter ``tenant``: it scopes the embedding cache, README "Tenants").
# A gateway in front sets the header; without it, OpenAI's ``user`` (the end user's id) is the tenant.
TENANT_HEADER = "X-Tenant"


def request_tenant(header: str | None, user: str | None) -> str | None:
    """The header's tenant, else ``user``'s; None when neither names one. Triton checks the value
    (1-256 characters, no control characters) and answers 400 otherwise."""
    return header or user or None


def create_app(backend: ChatBackend, renderer: ChatRenderer) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await backend.close()

    app = FastAPI(title="triton-epd OpenAI-compatible API", version="0.1.0", lifespan=lifespan)
    started = int(time.time())

    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, exc: OpenAIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return _error_response(OpenAIError(exc.status_code, str(exc.detail), kind))

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = await backend.ready_models()
        return JSONResponse({"ready_models": ready}, status_code=200 if ready else 503)

    @app.get("/v1/models", response_model=ModelList, responses={503: ERRORS[503]})
    async def models() -> ModelList:
        ready = await backend.ready_models()
        if not ready:
            raise not_ready("no chat model is ready on Triton")
        return ModelList(data=[ModelCard(id=model, created=started) for model in ready])

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        if body.n not in (None, 1):
            raise bad_request("only n=1 is supported", "n")
        state = await backend.model_state(body.model)
        if state is None:
            raise model_not_found(body.model, await backend.ready_models())
        if not state:
            raise not_ready(f"model '{body.model}' is not ready on Triton")
        chat = renderer.render(body.messages)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        tenant = request_tenant(request.headers.get(TENANT_HEADER), body.user)
        parameters = {"tenant": tenant} if tenant else None
        chunks = backend.generate(
            ChatRequest(
                body.model,
                chat.prompt,
                chat.images,
                body.sampling_parameters(),
                request_id,
                parameters,
                chat.videos,
                chat.audios,
            )
        )
        first = await _first_chunk(chunks)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _sse(chunks, first, request_id, body.model, include_usage, bool(body.return_token_ids))
            return StreamingResponse(events, media_type="text/event-stream")
        return await _whole(chunks, first, request_id, body.model, bool(body.return_token_ids))

    return app


async def _first_chunk(chunks: AsyncIterator[Chunk]) -> Chunk | None:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None
    except BaseException:
        await chunks.aclose()  # type: ignore[attr-defined]
        raise


class _Totals:
    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    def add(self, chunk: Chunk) -> None:
        if chunk.num_input_tokens is not None:
            self.prompt_tokens = chunk.num_input_tokens
        if chunk.num_output_tokens is not None:
            self.completion_tokens = chunk.num_output_tokens
        self.finish_reason = chunk.finish_reason or self.finish_reason

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
        )


async def _whole(
    chunks: AsyncIterator[Chunk], first: Chunk | None, request_id: str, model: str, with_token_ids: bool
) -> ChatCompletion:
    totals, text, token_ids = _Totals(), [], []
    try:
        chunk = first
        while chunk is not None:
            totals.add(chunk)
            text.append(chunk.text)
            token_ids.extend(chunk.token_ids)
            chunk = await anext(chunks, None)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    message = ResponseMessage(content="".join(text))
    return ChatCompletion(
        id=request_id,
        created=int(time.time()),
        model=model,
        choices=[
            Choice(message=message, finish_reason=totals.finish_reason, token_ids=token_ids if with_token_ids else None)
        ],
        usage=totals.usage(),
    )


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _sse(
    chunks: AsyncIterator[Chunk],
    first: Chunk | None,
    request_id: str,
    model: str,
    include_usage: bool,
    with_token_ids: bool = False,
) -> AsyncIterator[str]:
    """OpenAI's stream: a role delta, one delta per Triton response with text, the finish reason,
    then (``include_usage``) a usage chunk with no choices, then ``[DONE]``. Closed early (the
    client went away), it closes ``chunks``, which cancels the Triton request."""
    created = int(time.time())
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}

    def choice(delta: dict[str, Any], finish_reason: str | None = None, token_ids: list[int] | None = None) -> str:
        entry: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        if with_token_ids and token_ids is not None:
            entry["token_ids"] = token_ids
        return _event({**base, "choices": [entry]})

    totals = _Totals()
    try:
        yield choice({"role": "assistant", "content": ""})
        chunk = first
        while chunk is not None:
            totals.add(chunk)
            if chunk.text or (with_token_ids and chunk.token_ids):  # a token may end inside a character
                yield choice({"content": chunk.text}, token_ids=chunk.token_ids)
            chunk = await anext(chunks, None)
        yield choice({}, totals.finish_reason)
        if include_usage:
            yield _event({**base, "choices": [], "usage": totals.usage().model_dump()})
    except OpenAIError as exc:
        yield _event(exc.body())
    except Exception as exc:  # never a broken stream without a word
        yield _event(internal(f"internal error: {type(exc).__name__}").body())
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    yield "data: [DONE]\n\n"

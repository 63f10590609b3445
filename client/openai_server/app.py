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
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from client.openai_server.auth import ApiKeyMiddleware, ApiKeys, caller_of
from client.openai_server.errors import OpenAIError, bad_request, internal, model_not_found, not_ready
from client.openai_server.prompt import ChatRenderer
from client.openai_server.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponseMessage,
    Usage,
)
from client.openai_server.triton_backend import ChatBackend, ChatRequest, Chunk
from python_backends.request.tenants import sign_tenant

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in (
        (400, "bad request"),
        (401, "no or an incorrect API key"),
        (404, "unknown model"),
        (503, "Triton not ready"),
    )
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
# With API keys configured it is the key's (``auth.py``: header and ``user`` ignored). Without keys,
# a gateway in front sets the header; without it, OpenAI's ``user`` (the end user's id) is the tenant.
TENANT_HEADER = "X-Tenant"


def request_tenant(header: str | None, user: str | None) -> str | None:
    """The header's tenant, else ``user``'s; None when neither names one. Triton checks the value
    (1-256 characters, no control characters) and answers 400 otherwise."""
    return header or user or None


def create_app(
    backend: ChatBackend, renderer: ChatRenderer, api_keys: ApiKeys | None = None, tenant_secret: bytes | None = None
) -> FastAPI:
    """The app; with ``api_keys`` configured, every route but ``/health`` needs one of them and
    the tenant is the key's. With ``tenant_secret`` (the deployment's, ``--tenant-secret-file``)
    the tenant goes to Triton signed, as a Triton with that secret requires."""
    keys_required = api_keys is not None and api_keys.enabled

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await backend.close()

    app = FastAPI(title="triton-epd OpenAI-compatible API", version="0.1.0", lifespan=lifespan)
    started = int(time.time())
    if keys_required and api_keys is not None:
        app.add_middleware(ApiKeyMiddleware, keys=api_keys)

    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, exc: OpenAIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {503: "service_unavailable"}.get(exc.status_code, "invalid_request_error" if exc.status_code < 500
                                                 else "internal_error")  # fmt: skip
        # limits.BodyRefused names its code (request_too_large, server_busy)
        return _error_response(OpenAIError(exc.status_code, str(exc.detail), kind, code=getattr(exc, "code", None)))

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = await backend.ready_models()
        return JSONResponse({"ready_models": ready}, status_code=200 if ready else 503)

    @app.get("/v1/models", response_model=ModelList, responses={401: ERRORS[401], 503: ERRORS[503]})
    async def models() -> ModelList:
        ready = await backend.ready_models()
        if not ready:
            raise not_ready("no chat model is ready on Triton")
        return ModelList(data=[ModelCard(id=model, created=started) for model in ready])

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        body.check()
        state = await backend.model_state(body.model)
        if state is None:
            raise model_not_found(body.model, await backend.ready_models())
        if not state:
            raise not_ready(f"model '{body.model}' is not ready on Triton")
        chat = renderer.render(body.messages)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if keys_required:  # the key's tenant; a header or ``user`` cannot name another's space
            caller = caller_of(request.scope)
            tenant = caller.tenant if caller is not None else None
        else:
            tenant = request_tenant(request.headers.get(TENANT_HEADER), body.user)
        if tenant and tenant_secret is not None:
            tenant = sign_tenant(tenant_secret, tenant)
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
        shape = _Shape(body.n or 1, bool(body.return_token_ids), (body.top_logprobs or 0) if body.logprobs else None)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _sse(chunks, first, request_id, body.model, include_usage, shape=shape)
            return StreamingResponse(events, media_type="text/event-stream")
        return await _whole(chunks, first, request_id, body.model, shape)

    return app


async def _first_chunk(chunks: AsyncIterator[Chunk]) -> Chunk | None:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None
    except BaseException:
        await chunks.aclose()  # type: ignore[attr-defined]
        raise


@dataclass(frozen=True)
class _Shape:
    """What the answer holds: ``n`` choices, their ``token_ids`` or not, and their ``logprobs``
    with ``top_logprobs`` alternatives each (None: no logprobs)."""

    n: int = 1
    with_token_ids: bool = False
    top_logprobs: int | None = None


# vLLM's floor for a logprob (-inf is not JSON).
MIN_LOGPROB = -9999.0


def _logprob(token_id: str, entry: dict[str, Any]) -> dict[str, Any]:
    """One entry in OpenAI's shape; a token without its text is ``token_id:<id>``, as vLLM names it."""
    token = entry.get("decoded_token")
    logprob = max(float(entry.get("logprob", MIN_LOGPROB)), MIN_LOGPROB)
    if token is None:
        return {"token": f"token_id:{token_id}", "logprob": logprob, "bytes": None}
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", errors="replace"))}


def _openai_logprobs(entries: list[Any] | None, token_ids: list[int], top: int) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content`` for one response's tokens: each sampled token (the entry
    keyed by its id; the first entry when the ids are missing) and the ``top`` most likely
    entries by rank."""
    content = []
    for position, entry in enumerate(entries or []):
        if not entry:
            continue
        key = str(token_ids[position]) if position < len(token_ids) else ""
        if key not in entry:
            key = next(iter(entry))
        by_rank = sorted(entry.items(), key=lambda item: item[1].get("rank") or float("inf"))
        alternatives = [_logprob(token_id, alternative) for token_id, alternative in by_rank[:top]]
        content.append({**_logprob(key, entry[key]), "top_logprobs": alternatives})
    return content


@dataclass
class _Sequence:
    """One of the ``n`` sequences so far."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None


class _Totals:
    def __init__(self, shape: _Shape) -> None:
        self.shape = shape
        self.prompt_tokens = 0
        self.prompt_logprobs: list[Any] | None = None
        self.sequences = {index: _Sequence() for index in range(shape.n)}

    def add(self, chunk: Chunk) -> list[dict[str, Any]]:
        """Takes ``chunk`` in; answers its tokens' logprobs in OpenAI's shape (empty if not asked)."""
        sequence = self.sequences.setdefault(chunk.index, _Sequence())
        if chunk.num_input_tokens is not None:
            self.prompt_tokens = chunk.num_input_tokens
        if chunk.num_output_tokens is not None:
            sequence.completion_tokens = chunk.num_output_tokens
        sequence.finish_reason = chunk.finish_reason or sequence.finish_reason
        if self.prompt_logprobs is None:
            self.prompt_logprobs = chunk.prompt_logprobs
        sequence.text.append(chunk.text)
        sequence.token_ids.extend(chunk.token_ids)
        if self.shape.top_logprobs is None:
            return []
        logprobs = _openai_logprobs(chunk.logprobs, chunk.token_ids, self.shape.top_logprobs)
        sequence.logprobs.extend(logprobs)
        return logprobs

    def usage(self) -> Usage:
        completion_tokens = sum(sequence.completion_tokens for sequence in self.sequences.values())
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=self.prompt_tokens + completion_tokens,
        )


async def _whole(
    chunks: AsyncIterator[Chunk], first: Chunk | None, request_id: str, model: str, shape: _Shape = _Shape()
) -> ChatCompletion:
    totals = _Totals(shape)
    try:
        chunk = first
        while chunk is not None:
            totals.add(chunk)
            chunk = await anext(chunks, None)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    choices = [
        Choice(
            index=index,
            message=ResponseMessage(content="".join(sequence.text)),
            logprobs=None
            if shape.top_logprobs is None
            else ChoiceLogprobs.model_validate({"content": sequence.logprobs}),
            finish_reason=sequence.finish_reason,
            token_ids=sequence.token_ids if shape.with_token_ids else None,
        )
        for index, sequence in sorted(totals.sequences.items())
    ]
    return ChatCompletion(
        id=request_id,
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=totals.usage(),
        prompt_logprobs=totals.prompt_logprobs,
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
    shape: _Shape | None = None,
) -> AsyncIterator[str]:
    """OpenAI's stream: a role delta per choice, one delta per Triton response with text (tagged
    with its choice's index, with its tokens' logprobs when asked), a finish chunk per choice as
    its sequence ends, then (``include_usage``) a usage chunk with no choices, then ``[DONE]``.
    Closed early (the client went away), it closes ``chunks``, which cancels the Triton request."""
    shape = shape or _Shape(with_token_ids=with_token_ids)
    created = int(time.time())
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}

    def choice(
        index: int,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        token_ids: list[int] | None = None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> str:
        entry: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish_reason}
        if logprobs is not None:
            entry["logprobs"] = {"content": logprobs}
        if shape.with_token_ids and token_ids is not None:
            entry["token_ids"] = token_ids
        return _event({**base, "choices": [entry]})

    totals = _Totals(shape)
    finished: set[int] = set()
    try:
        for index in range(shape.n):
            yield choice(index, {"role": "assistant", "content": ""})
        chunk = first
        while chunk is not None:
            logprobs = totals.add(chunk)
            # a token may end inside a character: its delta has no text but its id and logprob
            if chunk.text or (shape.with_token_ids and chunk.token_ids) or logprobs:
                asked = logprobs if shape.top_logprobs is not None else None
                yield choice(chunk.index, {"content": chunk.text}, token_ids=chunk.token_ids, logprobs=asked)
            if chunk.finish_reason and chunk.index not in finished:
                finished.add(chunk.index)
                yield choice(chunk.index, {}, chunk.finish_reason)
            chunk = await anext(chunks, None)
        for index, sequence in sorted(totals.sequences.items()):
            if index not in finished:
                yield choice(index, {}, sequence.finish_reason)
        if include_usage:
            yield _event({**base, "choices": [], "usage": totals.usage().model_dump()})
    except OpenAIError as exc:
        yield _event(exc.body())
    except Exception as exc:  # never a broken stream without a word
        yield _event(internal(f"internal error: {type(exc).__name__}").body())
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    yield "data: [DONE]\n\n"

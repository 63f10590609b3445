"""The Triton side of the API: one chat = one request on its own gRPC stream to ``epd`` or ``llm``.

Uses tritonclient's asyncio gRPC client. Every stream ends by the rule of
``client/grpc_streams.py``: read to Triton's close after the final response; closing the response
generator early (the HTTP client went away, the app is stopping) gives the request up: the model's
in-band abort where it takes one, the stream drained in the background, and a gRPC cancel (which
Triton turns into a cancellation of the request: the model aborts it in the engine and releases
what it holds) only if the stream is still open after the grace. Never a cancel at once: Triton
2.51 can leak a model reference on a cancel near a stream's start or end.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from client.epd_client import build_inputs
from client.grpc_streams import GRACE_S, InBandAbort, StreamEnds
from client.openai_server.errors import OpenAIError, from_triton_message, not_ready

# The user-facing models that take a chat prompt and media (``ensemble`` takes exactly one image).
CHAT_MODELS = ("epd", "llm")
log = logging.getLogger("openai_server")


@dataclass(frozen=True)
class ChatRequest:
    """One chat as Triton gets it: the model, the rendered prompt, the images in message order,
    the sampling parameters, the request id, the Triton request parameters (the tenant), the
    videos in message order (the ``video`` input) and the audio files in message order (the
    ``audio`` input)."""

    model: str
    prompt: str
    images: Sequence[bytes]
    sampling: dict[str, Any]
    request_id: str
    parameters: dict[str, Any] | None = None
    videos: Sequence[bytes] = ()
    audios: Sequence[bytes] = ()


@dataclass
class Chunk:
    """One Triton response: new text of sequence ``index`` (of the request's ``n``), the counts,
    the finish reason once that sequence ends and, when asked, the log probabilities in
    vllm_backend's layout: ``logprobs`` one entry per token of ``token_ids``, ``prompt_logprobs``
    (the first response only) one per prompt token, each ``{"<token id>": {"logprob", "rank",
    "decoded_token"}}``."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    finish_reason: str | None = None
    index: int = 0
    logprobs: list[Any] | None = None
    prompt_logprobs: list[Any] | None = None


class ChatBackend(Protocol):
    async def model_state(self, model: str) -> bool | None:
        """True: ready; False: served but not ready; None: not one of the chat models."""
        ...

    async def ready_models(self) -> list[str]: ...

    def generate(self, request: ChatRequest) -> AsyncIterator[Chunk]: ...

    async def close(self) -> None: ...


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def _first(result: Any, name: str) -> Any:
    array = result.as_numpy(name)
    return None if array is None or array.size == 0 else array.reshape(-1)[0]


def _json_list(result: Any, name: str) -> list[Any] | None:
    text = _text(_first(result, name) or "")
    return json.loads(text) if text else None


def chunk_of(result: Any) -> tuple[Chunk, bool]:
    """(the chunk, whether it is the request's last response)."""
    response = result.get_response()
    names = {output.name for output in response.outputs}
    chunk = Chunk()
    if "text_output" in names:
        chunk.text = "".join(_text(x) for x in result.as_numpy("text_output").reshape(-1))
    if "output_token_ids" in names:
        chunk.token_ids = [int(t) for t in result.as_numpy("output_token_ids").reshape(-1)]
    if "num_input_tokens" in names:
        chunk.num_input_tokens = int(_first(result, "num_input_tokens"))
    if "num_output_tokens" in names:
        chunk.num_output_tokens = int(_first(result, "num_output_tokens"))
    if "finish_reason" in names:
        chunk.finish_reason = _text(_first(result, "finish_reason")) or None
    if "output_index" in names:
        chunk.index = int(_first(result, "output_index"))
    if "logprobs" in names:
        chunk.logprobs = _json_list(result, "logprobs")
    if "prompt_logprobs" in names:
        chunk.prompt_logprobs = _json_list(result, "prompt_logprobs")
    final = response.parameters.get("triton_final_response")
    return chunk, bool(final is not None and final.bool_param)


class TritonChatBackend:
    def __init__(self, grpc_url: str, models: Sequence[str] = CHAT_MODELS) -> None:
        import tritonclient.grpc as grpcclient
        import tritonclient.grpc.aio as grpcaio

        self.grpc_url = grpc_url
        self.models = tuple(models)
        self._grpc = grpcclient
        self._grpcaio = grpcaio
        self._client: Any = None
        self._aborts: InBandAbort | None = None
        self.stream_ends = StreamEnds()

    @property
    def client(self) -> Any:
        # Made on first use, inside the serving event loop: a grpc.aio channel belongs to the loop
        # it was made in, and the app's loop starts after the backend is built.
        if self._client is None:
            self._client = self._grpcaio.InferenceServerClient(self.grpc_url)
        return self._client

    @property
    def aborts(self) -> InBandAbort:
        if self._aborts is None:
            self._aborts = InBandAbort(self.client, self._grpc)
        return self._aborts

    async def close(self) -> None:
        if self._client is not None:
            await self.stream_ends.wait(GRACE_S + 1.0)  # the streams still draining, then the channel
            await self._client.close()
            self._client = None
            self._aborts = None

    async def model_state(self, model: str) -> bool | None:
        if model not in self.models:
            return None
        try:
            return bool(await self.client.is_model_ready(model, client_timeout=10))
        except Exception as exc:
            log.warning("readiness of '%s' at %s unknown: %s", model, self.grpc_url, exc)
            return False

    async def ready_models(self) -> list[str]:
        return [model for model in self.models if await self.model_state(model)]

    async def generate(self, request: ChatRequest) -> AsyncIterator[Chunk]:
        inputs = build_inputs(
            self._grpc,
            request.prompt,
            request.images,
            True,
            request.sampling,
            None,
            videos=request.videos,
            audios=request.audios,
        )
        abort = None
        if await self.aborts.supported(request.model):
            inputs.append(self.aborts.request_id_input(request.request_id))
            abort = self.aborts.for_request(request.model, request.request_id, self.stream_ends)

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield {
                "model_name": request.model,
                "inputs": inputs,
                "request_id": request.request_id,
                "parameters": request.parameters,
            }

        try:
            responses = self.client.stream_infer(one_request())
        except Exception as exc:
            raise not_ready(f"cannot reach Triton at {self.grpc_url}: {exc}") from None
        finished = False
        try:
            while True:
                try:
                    result, error = await responses.__anext__()
                except StopAsyncIteration:
                    finished = True
                    return
                except OpenAIError:
                    raise
                except Exception as exc:  # the stream itself failed (Triton gone, stopping)
                    raise not_ready(f"Triton stream to '{request.model}' failed: {exc}") from None
                if error is not None:
                    finished = True
                    raise from_triton_message(error.message() if hasattr(error, "message") else str(error))
                chunk, final = chunk_of(result)
                yield chunk
                if final:
                    finished = True
                    return
        finally:
            # Done: wait for Triton's close. Stopped early: abort in-band, drain, cancel after the
            # grace, in a task of its own (a cancelled caller must not cut that short).
            await self.stream_ends.close_stream(responses, finished, abort)

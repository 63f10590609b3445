"""``epd``'s colocated path: one vLLM engine in epd's own process does prefill and decode.

Why in epd's process: a path that relays another model's tokens over BLS pays a Triton
response hop per token, and on 2 shared cores that hop alone made epd's decode longer than
llm's whole decode (docs/benchmarks/encode.md). Here the engine's chunks are epd's
responses, as they are ``llm``'s, so the path costs what ``llm`` costs plus the store lookup.

Images, after the shared hash and lookup (``epd/references.py``):

- every image in the store: handed to the engine as embeddings (vLLM's ``enable_mm_embeds``:
  ``image_embeds`` + ``image_grid_thw``, with the content key as the item's identity), so a
  hit never re-encodes;
- no image in the store: the media go to the engine, which encodes them itself (as ``llm``
  does; vLLM's own encoder and prefix caches serve repeats). Each item carries its content key
  as its vLLM identity (``multi_modal_uuids``), so vLLM does not hash the pixels again, and an
  image whose processed pixels the engine still holds (its processor cache, by that key) goes
  as ``None``: no decode, no processing, no copy (docs/benchmarks/serving-paths.md);
- some of each: the missing ones are encoded by the encoder models first (into the store) and
  all go in as embeddings, because vLLM takes one form per modality in a prompt;
- with ``colocated_encodes = encoders`` (the E|PD topology), every image the store lacks goes to
  the encoder models, new or not: the engine never encodes, as vLLM's 1E+1PD, so the encoders
  can run on processors of their own (docs/benchmarks/epd-pays.md).

Videos and audio clips always go through the encoder models and the store (and then every item
of the request goes in as embeddings): the engine's own video loading and audio decoding are
``llm``'s baseline, and a stored video or clip must skip decode and encode on every path.

Timings (on the last chunk): ``prefill`` is the time to the first token (the engine's own
encode included), ``decode`` the rest.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any, Protocol

from python_backends.engines.generation import GenerationChunk, ms_since
from python_backends.engines.prompt import stored_embeds, vllm_prompt
from python_backends.epd.references import ImageReferences, LeasedReferences
from python_backends.errors import EpdError, stage_error
from python_backends.request.generate import GenerateRequest
from python_backends.request.images import ImageLimits, decode_images


class ColocatedEngine(Protocol):
    """What the path needs of its engine (``python_backends.engines.llm.LlmEngine``; a fake in
    the unit tests). Runs on epd's event loop."""

    def generate_prompt(
        self, prompt: dict[str, Any], request: GenerateRequest, request_id: str
    ) -> AsyncGenerator[GenerationChunk, None]: ...

    def holds_media(self, uuid: str) -> bool: ...

    async def abort(self, request_id: str) -> None: ...


class ColocatedPath:
    """``encoders_encode``: the images the store lacks always go to the encoder models and every
    image reaches the engine as embeddings (the E|PD topology: vLLM's 1E+1PD, the encoders on
    processors of their own), never as media."""

    def __init__(
        self, engine: ColocatedEngine, references: ImageReferences, limits: ImageLimits, encoders_encode: bool = False
    ) -> None:
        self.engine = engine
        self.references = references
        self.limits = limits
        self.encoders_encode = encoders_encode

    async def _prompt(
        self,
        request: GenerateRequest,
        leased: LeasedReferences,
        encoder: str | None,
        timings: dict[str, float],
        engine_held: bool = True,
    ) -> tuple[dict[str, Any], bool]:
        """vLLM's input for the request, and whether an item went as None (``engine_held``: the
        media the engine holds go as None)."""
        if not request.images and not request.videos and not request.audios:
            return vllm_prompt(request.prompt), False
        engine_encodes = not (leased.found or request.videos or request.audios or self.encoders_encode)
        if engine_encodes:  # the engine encodes the media
            keys = leased.keys[: leased.num_images]
            held = {key for key in keys if engine_held and self.engine.holds_media(key)}
            to_decode = [leased.missing[key] for key in keys if key not in held]
            decoded = iter(await asyncio.to_thread(decode_images, to_decode, self.limits) if to_decode else ())
            media = [None if key in held else next(decoded) for key in keys]
            return vllm_prompt(request.prompt, mm_data={"image": media}, mm_uuids={"image": keys}), bool(held)
        await self.references.encode_missing(leased, encoder, timings)
        images = [stored_embeds(self.references.store, ref) for ref in leased.references]
        return vllm_prompt(request.prompt, images), False

    async def run(
        self,
        request: GenerateRequest,
        request_id: str,
        leased: LeasedReferences,
        timings: dict[str, float],
        encoder: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Serve one request whose images were looked up into ``leased``; the last chunk carries
        the timings and cache counts. Closing early aborts the engine's request."""
        start = time.perf_counter()
        first_at: float | None = None
        finished = False
        try:
            async with aclosing(self._chunks(request, request_id, leased, encoder, timings)) as chunks:
                async for chunk in chunks:
                    if first_at is None:
                        first_at = time.perf_counter()
                        timings["prefill"] = (first_at - start) * 1000.0
                    if chunk.finished:
                        finished = True
                        timings["decode"] = ms_since(first_at)
                        yield leased.measured(chunk, timings)
                    else:
                        yield chunk
        except EpdError as exc:
            raise stage_error("generate", exc) from None
        finally:
            if not finished:
                await self.engine.abort(request_id)

    async def _chunks(
        self,
        request: GenerateRequest,
        request_id: str,
        leased: LeasedReferences,
        encoder: str | None,
        timings: dict[str, float],
    ) -> AsyncGenerator[GenerationChunk, None]:
        """The engine's chunks. An item sent as None can leave the engine's cache between the check
        and vLLM's processing, which then refuses the request before any token: then, once, the
        prompt is built again with every item's media."""
        prompt, held = await self._prompt(request, leased, encoder, timings)
        stream = self.engine.generate_prompt(prompt, request, request_id)
        try:
            if held:
                try:
                    first = await anext(stream)
                except EpdError:
                    await stream.aclose()
                    prompt, _ = await self._prompt(request, leased, encoder, timings, engine_held=False)
                    stream = self.engine.generate_prompt(prompt, request, request_id)
                    first = await anext(stream)
                yield first
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()

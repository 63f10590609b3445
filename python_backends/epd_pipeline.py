"""The ``epd`` orchestrator: hash -> lookup -> encode -> prefill -> decode, Triton-free.

Who calls what: the ``epd`` model (``model_repository/epd/1/model.py``) builds one
:class:`EpdPipeline` in ``initialize`` with the node's :class:`EmbeddingStore` and a
:class:`StageClient` that reaches the other models through BLS
(``python_backends/epd_triton.py``); per request it iterates :meth:`EpdPipeline.run` on its
event loop and turns each :class:`EpdChunk` into a response. Unit tests pass a scripted fake
``StageClient`` instead (tests/unit/test_epd_pipeline.py).

The fixed sequence of steps, per request:

1. **hash**: ``content_key(image bytes, preprocessing config, encoder version)`` per image.
2. **lookup**: ``store.claim`` per distinct key: HIT (a leased reference at once), PRODUCE
   (this request encodes it) or JOIN (another request is encoding it; wait for it).
3. **encode** the PRODUCE keys, all at once (one ``encode`` call per image, concurrently: the
   encode models' dynamic batcher packs them), and write each result into the store
   (``fulfil``; ``abandon`` on failure so joined waiters get the error, not a hang). The
   orchestrator writes the store because it holds the single-flight claim (see the README);
   from here on only references (<= 1 KB each) travel.
4. **prefill** with the prompt and the references (max_tokens=1): the first token and the KV
   transfer parameters. Streaming requests get the first token at once.
5. **decode** with the references and the transfer parameters: tokens 2..N.

Whatever happens (finish, failure, cancellation), every lease this request took is released
and a started decode is aborted. A failing stage becomes one :class:`EpdError` whose message
names the stage; errors that already carry a code keep it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from python_backends.errors import EpdError, ErrorCode
from python_backends.generate_request import GenerateRequest
from python_backends.llm_engine import GenerationChunk
from python_backends.store import (
    Claim,
    ClaimKind,
    EmbeddingStore,
    EntryMeta,
    Reference,
    content_key,
)

log = logging.getLogger(__name__)

STAGES = ("hash", "lookup", "encode", "prefill", "decode")
DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default


@dataclass(frozen=True)
class EncodedImage:
    """What ``encode`` returns for one image."""

    embeds: np.ndarray  # [tokens, hidden]
    grid_thw: tuple[int, int, int]


@dataclass(frozen=True)
class PrefillOutput:
    """What ``prefill`` returns: the first token and, unless the request is done, the KV
    transfer parameters for ``decode`` (a <= 1 KB JSON string)."""

    token_ids: list[int]
    text: str
    num_input_tokens: int
    finish_reason: str | None  # set when the request ends with the first token
    transfer_params: str  # "" when nothing is left to decode


@dataclass(frozen=True)
class DecodeOutput:
    """One ``decode`` response: new tokens (deltas when streaming)."""

    token_ids: list[int]
    text: str
    num_output_tokens: int  # total so far, the first token included
    finish_reason: str | None
    finished: bool


class StageClient(Protocol):
    """How the orchestrator reaches the stages. Implemented with BLS in ``epd_triton.py``
    and by a scripted fake in the unit tests. Methods run on the ``epd`` event loop."""

    async def encode(self, image: bytes) -> EncodedImage: ...

    async def prefill(self, prompt: str, references: Sequence[bytes], sampling: Mapping[str, Any]) -> PrefillOutput: ...

    def decode(
        self,
        request_id: str,
        references: Sequence[bytes],
        transfer_params: str,
        sampling: Mapping[str, Any],
        stream: bool,
    ) -> AsyncIterator[DecodeOutput]: ...

    async def abort_decode(self, request_id: str) -> None: ...

    async def discard_transfer(self, transfer_params: str) -> None: ...


@dataclass(frozen=True)
class KeyConfig:
    """What the content key covers besides the media bytes."""

    preprocess_config: Mapping[str, Any]
    encoder_version: str


@dataclass
class EpdChunk:
    """One response to the client: a generation chunk plus what the pipeline measured."""

    chunk: GenerationChunk
    timings_ms: dict[str, float] = field(default_factory=dict)
    cache_hits: int = 0


@dataclass
class _Media:
    """The references of one request, in image order, and the leases to give back."""

    references: list[Reference] = field(default_factory=list)
    leases: list[Reference] = field(default_factory=list)
    cache_hits: int = 0
    encoded: int = 0


def _stage_error(stage: str, exc: BaseException) -> EpdError:
    if isinstance(exc, EpdError):
        return EpdError(f"{stage}: {exc.message}", exc.code)
    return EpdError(f"{stage} failed: {type(exc).__name__}", ErrorCode.INTERNAL)


class EpdPipeline:
    def __init__(
        self,
        store: EmbeddingStore,
        stages: StageClient,
        keys: KeyConfig,
        *,
        run_blocking: Callable[..., Any] | None = None,
    ) -> None:
        self.store = store
        self.stages = stages
        self.keys = keys
        # Store calls are short LMDB transactions; waiting for another request's encode is
        # not, so it runs off the loop (``run_blocking(fn, *args)`` -> awaitable).
        self._run_blocking = run_blocking or (lambda fn, *args: asyncio.to_thread(fn, *args))

    async def run(self, request: GenerateRequest, request_id: str) -> AsyncIterator[EpdChunk]:
        """Serve one request. Closing the iterator early (client cancelled) aborts decode and
        releases every lease, like finishing does."""
        timings: dict[str, float] = {}
        media = _Media()
        decode_started = False
        unclaimed_transfer = ""  # prefilled KV that no decode has taken yet
        try:
            start = time.perf_counter()
            keys = [content_key(image, self.keys.preprocess_config, self.keys.encoder_version) for image in request.images]
            timings["hash"] = _ms(start)
            await self._references(request.images, keys, media, timings)

            start = time.perf_counter()
            sampling = dict(request.sampling)
            wire_refs = [ref.to_bytes() for ref in media.references]
            try:
                first = await self.stages.prefill(request.prompt, wire_refs, sampling)
            except Exception as exc:  # noqa: BLE001 - one coded error names the stage
                raise _stage_error("prefill", exc) from None
            timings["prefill"] = _ms(start)
            unclaimed_transfer = first.transfer_params
            prefix = "" if request.exclude_input_in_output else request.prompt
            done = not first.transfer_params
            first_chunk = GenerationChunk(
                text=prefix + first.text,
                token_ids=list(first.token_ids),
                num_input_tokens=first.num_input_tokens,
                num_output_tokens=len(first.token_ids),
                finish_reason=first.finish_reason if done else None,
                finished=done,
            )
            if done or request.stream:
                yield EpdChunk(first_chunk, dict(timings) if done else {}, media.cache_hits)
            if done:
                return

            start = time.perf_counter()
            decode_started = True
            unclaimed_transfer = ""  # decode owns it now (it deletes it when it ends)
            text, token_ids = first_chunk.text, list(first_chunk.token_ids)
            try:
                async for out in self.stages.decode(request_id, wire_refs, first.transfer_params, sampling, request.stream):
                    if out.finished:
                        timings["decode"] = _ms(start)
                        decode_started = False
                    chunk = GenerationChunk(
                        text=out.text,
                        token_ids=list(out.token_ids),
                        num_input_tokens=first.num_input_tokens,
                        num_output_tokens=out.num_output_tokens,
                        finish_reason=out.finish_reason,
                        finished=out.finished,
                    )
                    if request.stream:
                        yield EpdChunk(chunk, dict(timings) if out.finished else {}, media.cache_hits)
                    else:
                        text += out.text
                        token_ids += out.token_ids
                        if out.finished:
                            chunk.text, chunk.token_ids = text, token_ids
                            yield EpdChunk(chunk, dict(timings), media.cache_hits)
            except Exception as exc:  # noqa: BLE001 - one coded error names the stage
                raise _stage_error("decode", exc) from None
        finally:
            if unclaimed_transfer:  # the client left between prefill and decode
                try:
                    await self.stages.discard_transfer(unclaimed_transfer)
                except Exception:
                    log.warning("could not discard the KV transfer of %s", request_id, exc_info=True)
            if decode_started:
                try:
                    await self.stages.abort_decode(request_id)
                except Exception:
                    log.warning("could not abort decode of %s", request_id, exc_info=True)
            self._release(media)

    async def _references(
        self, images: Sequence[bytes], keys: Sequence[str], media: _Media, timings: dict[str, float]
    ) -> None:
        """Steps 2 and 3: a leased reference per image, encoding only what no one has."""
        start = time.perf_counter()
        found: dict[str, Reference] = {}
        produce: dict[str, tuple[Claim, bytes]] = {}
        join: dict[str, Claim] = {}
        try:
            for key, image in zip(keys, images):
                if key in found or key in produce or key in join:
                    continue
                claim = self.store.claim(key)
                if claim.kind is ClaimKind.HIT:
                    assert claim.reference is not None
                    found[key] = claim.reference
                    media.leases.append(claim.reference)
                    media.cache_hits += 1
                elif claim.kind is ClaimKind.PRODUCE:
                    produce[key] = (claim, image)
                else:
                    join[key] = claim
        except EpdError as exc:
            self._abandon(produce.values(), exc)
            raise _stage_error("lookup", exc) from None
        timings["lookup"] = _ms(start)

        start = time.perf_counter()
        if produce:
            try:
                results = await asyncio.gather(
                    *(self.stages.encode(image) for _, image in produce.values()), return_exceptions=True
                )
            except asyncio.CancelledError as exc:  # the client went away: free the claims
                self._abandon(produce.values(), exc)
                raise
            failure: BaseException | None = None
            for (key, (claim, _)), result in zip(produce.items(), results):
                if isinstance(result, BaseException):
                    self.store.abandon(claim, result)
                    failure = failure or result
                    continue
                try:
                    ref = self.store.fulfil(
                        claim, result.embeds, EntryMeta(modality="image", grid_thw=result.grid_thw)
                    )
                except EpdError as exc:
                    self.store.abandon(claim, exc)
                    failure = failure or exc
                    continue
                found[key] = ref
                media.leases.append(ref)
                media.encoded += 1
            if failure is not None:
                raise _stage_error("encode", failure)
        for key, claim in join.items():
            try:
                ref = await self._run_blocking(self.store.wait_for, claim)
                if ref is None:  # the producer vanished: produce it ourselves
                    ref = await self._encode_one(key, images[list(keys).index(key)])
                else:
                    media.cache_hits += 1
            except EpdError as exc:
                raise _stage_error("encode", exc) from None
            found[key] = ref
            media.leases.append(ref)
        if produce or join:
            timings["encode"] = _ms(start)
        media.references = [found[key] for key in keys]

    async def _encode_one(self, key: str, image: bytes) -> Reference:
        claim = self.store.claim(key)
        if claim.kind is ClaimKind.HIT:
            assert claim.reference is not None
            return claim.reference
        if claim.kind is ClaimKind.JOIN:
            ref = await self._run_blocking(self.store.wait_for, claim)
            if ref is None:
                raise EpdError(f"embedding {key[:16]} could not be produced", ErrorCode.UNAVAILABLE)
            return ref
        try:
            result = await self.stages.encode(image)
            return self.store.fulfil(claim, result.embeds, EntryMeta(modality="image", grid_thw=result.grid_thw))
        except BaseException as exc:
            self.store.abandon(claim, exc)
            raise

    def _abandon(self, claims: Any, exc: BaseException) -> None:
        for claim, _ in claims:
            self.store.abandon(claim, exc)

    def _release(self, media: _Media) -> None:
        for ref in media.leases:
            try:
                self.store.release(ref)
            except Exception:
                log.warning("could not release lease %s", ref.lease_id, exc_info=True)
        media.leases.clear()


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0

"""The ``epd`` orchestrator: hash -> lookup -> encode -> prefill -> decode, Triton-free.

Who calls what: the ``epd`` model (``model_repository/epd/1/model.py``) builds one
:class:`EpdPipeline` in ``initialize`` with the node's :class:`EmbeddingStore` and a
:class:`StageClient` that reaches the other models through BLS
(``python_backends/triton_edge/bls.py``); per request it iterates :meth:`EpdPipeline.run` on
its event loop and turns each :class:`GenerationChunk` into a response. Unit tests pass a scripted fake
``StageClient`` instead (tests/unit/test_epd_pipeline.py).

The fixed sequence of steps, per request:

1. **hash**: the content key of each image (media bytes + preprocessing config + encoder
   version). An image sent as ``mm_hash:<key>`` (pre-encoded, see ``cached_encoder.py``) is
   its key already. With a tenant (Triton request parameter ``tenant``) under the ``isolated``
   policy, both are taken into that tenant's key space (``store.keys.tenant_key``), so no
   hit, join or ``mm_hash`` crosses tenants (``python_backends/tenants.py``).
2. **lookup** (node-wide cache only): a stored key is a hit at once, leased for this request,
   with no call to any encoder. A ``mm_hash`` that is not stored is NOT_FOUND, with a hint.
3. **encode**: every other image goes to one encoder model (``encoder_<i>``), all at once;
   the encoder claims the key in the store (single-flight across every process), encodes
   misses through the ``encode`` ensemble, writes the store and returns a reference leased
   for this process. Which encoder: the one a request pins (Triton request parameter
   ``encoder``), else the key's home (key modulo the number of encoders: the same image
   always meets the same encoder, which matters for per-instance caches).
4. **prefill** with the prompt and the references (max_tokens=1): the first token and the KV
   transfer parameters. Streaming requests get the first token at once.
5. **decode** with the references and the transfer parameters: tokens 2..N.

The hit check runs once per image: epd's ``lookup`` in step 2 (it counts the hit; a miss is
counted by the claim that follows, hence ``count_miss=False``). The encoder's ``claim`` in step 3
is the single-flight point, not a second check: it finds the key stored only when another
request stored it in between (or for callers that skip step 2: clients pre-encoding media, and
per-instance caches). A reference is parsed and verified once per process by the store.

Whatever happens (finish, failure, cancellation), every lease this request took is released
and a started decode is aborted. A failing stage becomes one :class:`EpdError` whose message
names the stage; errors that already carry a code keep it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from python_backends.errors import EpdError, ErrorCode
from python_backends.generate_request import CachedImage, GenerateRequest
from python_backends.generation import GenerationChunk
from python_backends.store import EmbeddingStore, KeyConfig, Reference, tenant_key
from python_backends.tenants import key_space

log = logging.getLogger(__name__)



class StageClient(Protocol):
    """How the orchestrator reaches the stages. Implemented with BLS in ``triton_edge/bls.py``
    and by a scripted fake in the unit tests. Methods run on the ``epd`` event loop. ``prefill``
    answers one chunk: the first token and the KV ``transfer_params`` ("" when nothing is left to
    decode); ``decode`` streams tokens 2..N (``num_output_tokens`` counts the first one too)."""

    async def encode_reference(
        self, encoder: str, image: bytes, lease_owner: int, tenant: str | None = None
    ) -> tuple[bytes, bool]:
        """One image through encoder model ``encoder``: its reference (leased for the process
        ``lease_owner``) and whether the store already had it (or another request made it).
        ``tenant``: the request's tenant, passed on as the encoder's request parameter."""
        ...

    async def prefill(
        self, prompt: str, references: Sequence[bytes], sampling: Mapping[str, Any]
    ) -> GenerationChunk: ...

    def decode(
        self,
        request_id: str,
        references: Sequence[bytes],
        transfer_params: str,
        sampling: Mapping[str, Any],
        stream: bool,
    ) -> AsyncIterator[GenerationChunk]: ...

    async def abort_decode(self, request_id: str) -> None: ...

    async def discard_transfer(self, transfer_params: str) -> None: ...


@dataclass
class _LeasedReferences:
    """One request's image references, in image order, and the leases it must give back."""

    references: list[Reference] = field(default_factory=list)
    leases: list[Reference] = field(default_factory=list)
    cache_hits: int = 0
    fast_hits: int = 0

    def measured(self, chunk: GenerationChunk, timings: dict[str, float]) -> GenerationChunk:
        """``chunk`` as the request's last: with the timings and the cache counts."""
        chunk.timings_ms, chunk.cache_hits, chunk.fast_hits = dict(timings), self.cache_hits, self.fast_hits
        return chunk


def pinned_encoder(request_parameters: str | None) -> str | None:
    """The encoder model a request pins (Triton request parameter ``encoder``), if any."""
    if not request_parameters:
        return None
    try:
        parameters = json.loads(request_parameters)
    except ValueError:
        return None  # Triton gives JSON; anything else carries no pin
    value = parameters.get("encoder") if isinstance(parameters, dict) else None
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise EpdError("request parameter 'encoder' must be the name of an encoder model", ErrorCode.INVALID_ARG)
    return value


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
        encoders: Sequence[str],
        *,
        node_cache: bool = True,
        tenant_policy: str = "isolated",
    ) -> None:
        if not encoders:
            raise ValueError("epd needs at least one encoder model")
        self.store = store
        self.stages = stages
        self.keys = keys
        self.encoders = list(encoders)
        # Per-instance caches (``node_cache=False``) hold keys only their encoder can compute:
        # every image then goes to its encoder, which is what that setting is for.
        self.node_cache = node_cache
        key_space(None, tenant_policy)  # an unknown policy fails here, at load
        self.tenant_policy = tenant_policy

    def encoder_for(self, key: str, pinned: str | None = None) -> str:
        """The encoder model an image goes to: the pinned one, else the key's home."""
        if pinned is None:
            return self.encoders[int(key[:16], 16) % len(self.encoders)]
        if pinned in self.encoders:
            return pinned
        raise EpdError(f"unknown encoder {pinned!r}; this epd serves {', '.join(self.encoders)}", ErrorCode.INVALID_ARG)

    async def run(
        self, request: GenerateRequest, request_id: str, encoder: str | None = None, tenant: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        """Serve one request (``encoder``: pin its images' encodes to that encoder model;
        ``tenant``: the checked tenant whose key space its images and ``mm_hash`` references use,
        under the ``isolated`` policy). The last chunk carries the timings and cache counts.
        Closing the iterator early (client cancelled) aborts decode and releases every lease,
        like finishing does."""
        timings: dict[str, float] = {}
        leased = _LeasedReferences()
        decode_started = False
        unclaimed_transfer = ""  # prefilled KV that no decode has taken yet
        try:
            if encoder is not None:
                self.encoder_for("0" * 16, encoder)  # an unknown name fails before any work
            start = time.perf_counter()
            space = key_space(tenant, self.tenant_policy)
            keys = [
                tenant_key(im.mm_hash if isinstance(im, CachedImage) else self.keys.key(im), space)
                for im in request.images
            ]
            timings["hash"] = _ms(start)
            await self._references(request.images, keys, encoder, leased, timings, tenant)

            start = time.perf_counter()
            sampling = dict(request.sampling)
            wire_refs = [ref.to_bytes() for ref in leased.references]
            try:
                first = await self.stages.prefill(request.prompt, wire_refs, sampling)
            except Exception as exc:  # one coded error names the stage
                raise _stage_error("prefill", exc) from None
            timings["prefill"] = _ms(start)
            transfer = unclaimed_transfer = first.transfer_params
            done = not transfer
            first.text = ("" if request.exclude_input_in_output else request.prompt) + first.text
            first.num_output_tokens = len(first.token_ids)
            first.finish_reason = first.finish_reason if done else None
            first.finished, first.transfer_params = done, ""
            if done:
                yield leased.measured(first, timings)
                return
            if request.stream:
                yield first

            start = time.perf_counter()
            decode_started = True
            unclaimed_transfer = ""  # decode owns it now (it deletes it when it ends)
            text, token_ids = first.text, list(first.token_ids)
            try:
                async for chunk in self.stages.decode(request_id, wire_refs, transfer, sampling, request.stream):
                    chunk.num_input_tokens = first.num_input_tokens
                    if chunk.finished:
                        timings["decode"] = _ms(start)
                        decode_started = False
                    if not request.stream:
                        text, token_ids = text + chunk.text, token_ids + chunk.token_ids
                        chunk.text, chunk.token_ids = text, token_ids
                    if chunk.finished:
                        yield leased.measured(chunk, timings)
                    elif request.stream:
                        yield chunk
            except Exception as exc:  # one coded error names the stage
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
            self._release(leased)

    async def _references(
        self,
        images: Sequence[bytes | CachedImage],
        keys: Sequence[str],
        pinned: str | None,
        leased: _LeasedReferences,
        timings: dict[str, float],
        tenant: str | None = None,
    ) -> None:
        """Steps 2 and 3: a leased reference per image, encoding only what no one has."""
        start = time.perf_counter()
        found: dict[str, Reference] = {}
        to_encode: dict[str, bytes] = {}
        try:
            for index, (key, image) in enumerate(zip(keys, images, strict=True)):
                if key in found or key in to_encode:
                    continue
                if isinstance(image, CachedImage):
                    found[key] = self._cached(key, index)
                elif self.node_cache and (ref := self.store.lookup(key, count_miss=False)) is not None:
                    found[key] = ref
                else:
                    to_encode[key] = image
                    continue
                leased.leases.append(found[key])
                leased.cache_hits += 1
                leased.fast_hits += 1
        except EpdError as exc:
            raise _stage_error("lookup", exc) from None
        timings["lookup"] = _ms(start)

        if to_encode:
            start = time.perf_counter()
            indices = {key: keys.index(key) for key in to_encode}
            await self._encode(to_encode, indices, pinned, found, leased, tenant)
            timings["encode"] = _ms(start)
        leased.references = [found[key] for key in keys]

    def _cached(self, key: str, index: int) -> Reference:
        """The entry an ``mm_hash:`` item names (``key``: already in the request's key space).
        The message names the item by index, never by hash or tenant, so that every miss reads
        the same: another tenant's image is indistinguishable from one no one sent."""
        ref = self.store.lookup(key)
        if ref is None:
            raise EpdError(
                f"image[{index}] names an mm_hash that is not in the embedding cache (never encoded, evicted or "
                "encoded by another encoder version); send the image bytes instead",
                ErrorCode.NOT_FOUND,
            )
        return ref

    async def _encode(
        self,
        to_encode: Mapping[str, bytes],
        indices: Mapping[str, int],
        pinned: str | None,
        found: dict[str, Reference],
        leased: _LeasedReferences,
        tenant: str | None = None,
    ) -> None:
        """All misses at once, each through its encoder; leases are recorded as soon as each
        answer arrives, so a failure or cancellation releases every one that was taken."""
        owner = os.getpid()

        async def one(key: str, image: bytes) -> None:
            try:
                encoder = self.encoder_for(key, pinned)
                wire, cache_hit = await self.stages.encode_reference(encoder, image, owner, tenant)
            except EpdError as exc:  # the encoder saw one image: name it as the client did
                raise EpdError(exc.message.replace("image[0]", f"image[{indices[key]}]", 1), exc.code) from None
            ref = self.store.parse_reference(wire)
            leased.leases.append(ref)
            found[key] = ref
            leased.cache_hits += int(cache_hit)

        tasks = [asyncio.ensure_future(one(key, image)) for key, image in to_encode.items()]
        try:
            await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
        except asyncio.CancelledError:
            # The BLS calls run on; their leases must be recorded before ``run`` releases.
            await asyncio.wait(tasks)
            raise
        failures = [error for t in tasks if (error := t.exception()) is not None]
        if failures:
            raise _stage_error("encode", failures[0])

    def _release(self, leased: _LeasedReferences) -> None:
        for ref in leased.leases:
            try:
                self.store.release(ref)
            except Exception:
                log.warning("could not release lease %s", ref.lease_id, exc_info=True)
        leased.leases.clear()


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0

"""``epd``'s disaggregated path: encoders -> prefill -> KV transfer -> decode (Triton-free).

After the shared hash and lookup (``epd/references.py``), per request:

3. **encode** the images the store lacks through the encoder models (references, leased).
4. **prefill** with the prompt and the references (max_tokens=1): the first token and the KV
   transfer parameters. Streaming requests get the first token at once.
5. **decode** with the references and the transfer parameters: tokens 2..N.

Whatever happens (finish, failure, cancellation), a started decode is aborted and prefilled KV
that no decode took is discarded (the pipeline releases the leases). A failing stage becomes one
:class:`EpdError` whose message names the stage; errors that already carry a code keep it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from typing import Any, Protocol

from python_backends.engines.generation import GenerationChunk, ms_since
from python_backends.epd.references import ImageReferences, LeasedReferences
from python_backends.errors import stage_error
from python_backends.request.generate import GenerateRequest

log = logging.getLogger(__name__)


class StageClient(Protocol):
    """How the orchestrator reaches the stages. Implemented with BLS in ``triton_edge/bls.py``
    and by a scripted fake in the unit tests. Methods run on the ``epd`` event loop. ``prefill``
    answers one chunk: the first token and the KV ``transfer_params`` ("" when nothing is left to
    decode); ``decode`` streams tokens 2..N (``num_output_tokens`` counts the first one too).

    A client that picks each image's encoder itself (remote encoder servers:
    ``scaleout/remote.RemoteEncoderStages``) has a true ``routes_images`` attribute; the BLS
    client has none: the pipeline picks for it."""

    async def encode_reference(
        self, encoder: str | None, image: bytes, lease_owner: int, tenant: str | None = None, modality: str = "image"
    ) -> tuple[bytes, bool]:
        """One image (or video: ``modality``) through encoder model ``encoder``: its reference
        (leased for the process ``lease_owner``) and whether the store already had it (or
        another request made it). ``encoder`` is None only for an unpinned image sent to a
        client that routes images itself. ``tenant``: the request's checked tenant, passed on as
        the encoder's request parameter (re-signed where there is a tenant secret:
        ``request.tenants.tenant_parameter``)."""
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


class DisaggregatedPath:
    def __init__(self, stages: StageClient, references: ImageReferences) -> None:
        self.stages = stages
        self.references = references

    async def run(
        self,
        request: GenerateRequest,
        request_id: str,
        leased: LeasedReferences,
        timings: dict[str, float],
        encoder: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Serve one request whose images were looked up into ``leased``; the last chunk carries
        the timings and cache counts. A request for ``n`` sequences sends each through prefill and
        decode on its own, concurrently, as vLLM runs its ``n`` (sequence ``i`` with ``seed + i``),
        their chunks tagged with their index."""
        await self.references.encode_missing(leased, encoder, timings)
        wire_refs = [ref.to_bytes() for ref in leased.references]
        n = int(request.sampling.get("n", 1) or 1)
        sequences = [
            self._sequence(request, f"{request_id}-{i}" if n > 1 else request_id, wire_refs, timings, i)
            for i in range(n)
        ]
        async with aclosing(merged(sequences)) as chunks:
            async for chunk in chunks:
                yield leased.measured(chunk, timings) if chunk.finished else chunk

    async def _sequence(
        self, request: GenerateRequest, request_id: str, wire_refs: list[bytes], timings: dict[str, float], index: int
    ) -> AsyncGenerator[GenerationChunk, None]:
        """Sequence ``index`` of the request: prefill, then decode; its last chunk is ``finished``."""
        decode_started = False
        unclaimed_transfer = ""  # prefilled KV that no decode has taken yet
        sampling = sequence_sampling(request.sampling, index)
        try:
            start = time.perf_counter()
            try:
                first = await self.stages.prefill(request.prompt, wire_refs, sampling)
            except Exception as exc:  # one coded error names the stage
                raise stage_error("prefill", exc) from None
            timings["prefill"] = ms_since(start)
            transfer = unclaimed_transfer = first.transfer_params
            done = not transfer
            first.text = ("" if request.exclude_input_in_output else request.prompt) + first.text
            first.num_output_tokens = len(first.token_ids)
            first.finish_reason = first.finish_reason if done else None
            first.finished, first.transfer_params, first.index = done, "", index
            if done or request.stream:
                yield first
            if done:
                return

            start = time.perf_counter()
            decode_started = True
            unclaimed_transfer = ""  # decode owns it now (it deletes it when it ends)
            whole = first
            try:
                async for chunk in self.stages.decode(request_id, wire_refs, transfer, sampling, request.stream):
                    chunk.num_input_tokens, chunk.index = first.num_input_tokens, index
                    if chunk.finished:
                        timings["decode"] = ms_since(start)
                        decode_started = False
                    if not request.stream:
                        chunk = joined(whole, chunk)
                        whole = chunk
                    if chunk.finished or request.stream:
                        yield chunk
            except Exception as exc:  # one coded error names the stage
                raise stage_error("decode", exc) from None
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


def sequence_sampling(sampling: Mapping[str, Any], index: int) -> dict[str, Any]:
    """The sampling parameters of sequence ``index`` of a request for ``n``: one sequence, with
    ``seed + index`` as vLLM seeds its ``n`` (vllm/v1/engine/parallel_sampling.py)."""
    one = {key: value for key, value in sampling.items() if key != "n"}
    if index and one.get("seed") is not None:
        one["seed"] += index
    return one


def joined(head: GenerationChunk, tail: GenerationChunk) -> GenerationChunk:
    """``tail`` with ``head``'s text, tokens and logprobs in front (a non-streamed answer)."""
    tail.text, tail.token_ids = head.text + tail.text, head.token_ids + tail.token_ids
    if head.logprobs is not None or tail.logprobs is not None:
        tail.logprobs = (head.logprobs or []) + (tail.logprobs or [])
    tail.prompt_logprobs = head.prompt_logprobs
    return tail


async def merged(sequences: Sequence[AsyncIterator[GenerationChunk]]) -> AsyncGenerator[GenerationChunk, None]:
    """The chunks of several sequences as they come; ``finished`` only on the last sequence's last
    chunk (the others keep their finish reason). Closing it early cancels every sequence (each then
    aborts its decode and drops its transfer)."""
    if len(sequences) == 1:
        async for chunk in sequences[0]:
            yield chunk
        return
    queue: asyncio.Queue[tuple[GenerationChunk | None, BaseException | None]] = asyncio.Queue()

    async def pump(sequence: AsyncIterator[GenerationChunk]) -> None:
        try:
            async for chunk in sequence:
                await queue.put((chunk, None))
            await queue.put((None, None))
        except Exception as exc:
            await queue.put((None, exc))

    tasks = [asyncio.ensure_future(pump(sequence)) for sequence in sequences]
    running, finished = len(tasks), 0
    try:
        while running:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                running -= 1
                continue
            chunk = item
            if chunk.finished:  # each sequence's last chunk
                finished += 1
                chunk.finished = finished == len(sequences)
            yield chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

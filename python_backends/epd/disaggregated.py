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

import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
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
        client that routes images itself. ``tenant``: the request's tenant, passed on as the
        encoder's request parameter."""
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
        the timings and cache counts."""
        decode_started = False
        unclaimed_transfer = ""  # prefilled KV that no decode has taken yet
        try:
            await self.references.encode_missing(leased, encoder, timings)
            start = time.perf_counter()
            sampling = dict(request.sampling)
            wire_refs = [ref.to_bytes() for ref in leased.references]
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
                        timings["decode"] = ms_since(start)
                        decode_started = False
                    if not request.stream:
                        text, token_ids = text + chunk.text, token_ids + chunk.token_ids
                        chunk.text, chunk.token_ids = text, token_ids
                    if chunk.finished:
                        yield leased.measured(chunk, timings)
                    elif request.stream:
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

"""What differs between the KV connectors, behind one object an engine picks when it starts.

Who calls it: ``pd/engines.py``. ``PrefillEngine`` / ``DecodeEngine`` take
:func:`kv_transfer` of their connector once (in ``__init__``) and never ask which connector it
is per request. Two kinds:

- :class:`FolderTransfer` (``TransferIdConnector``, the cpu default): the connector itself
  writes the KV and the manifest into the node folder inside the prefill engine, compares the
  multimodal hashes inside the decode engine, and deletes the transfer once decoded.
- :class:`EngineHeldTransfer` (vLLM's ``NixlConnector``, the gpu target): the KV stays in the
  prefill engine's blocks until Nixl's decode side reads them; the prefill wrapper writes the
  transfer's record (manifest, first token) into the node folder itself, and decode checks the
  images' identities and removes that record.

Also here: :class:`PrefillResult` (what prefill returns, whichever connector) and the sampling
parameters of a request that carries ``kv_transfer_params``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from python_backends.engines.async_llm import input_rejections, output_kind, sampling_params
from python_backends.engines.generation import GenerationChunk, wire_logprobs
from python_backends.engines.prompt import ImageEmbeds
from python_backends.errors import EpdError, ErrorCode, invalid_arg
from python_backends.pd import manifest as mf
from python_backends.pd import transfer as tx
from python_backends.request.sampling import DEFAULT_MAX_TOKENS

# Records of transfers that a connector other than TransferIdConnector moves: swept by prefill.
RECORD_SWEEP_S, RECORD_MAX_AGE_S = 30.0, 300.0


def kv_sampling_params(sampling: Mapping[str, Any], kv_params: dict[str, Any], **overrides: Any) -> Any:
    """vLLM's sampling parameters of one side of the split, carrying the connector's
    ``kv_transfer_params`` (in ``extra_args``, where vLLM's connectors read them)."""
    extra_args = {**(sampling.get("extra_args") or {}), "kv_transfer_params": kv_params}
    return sampling_params(sampling, **overrides, extra_args=extra_args)


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    first_text: str
    num_prompt_tokens: int
    finish_reason: str | None  # "stop" when the first token already ends the request
    transfer: tx.TransferParams | None  # None when nothing is left to decode
    logprobs: list[Any] | None = None  # the first token's, when the request asks (wire_logprobs)
    prompt_logprobs: list[Any] | None = None  # the prompt's, when the request asks

    @property
    def needs_decode(self) -> bool:
        return self.transfer is not None

    def chunk(self) -> GenerationChunk:
        """The prefill model's one response: the first token and, when decode follows, the
        transfer parameters (the ``prefill`` stage's stream ends here either way)."""
        return GenerationChunk(
            text=self.first_text,
            token_ids=[self.first_token_id],
            num_input_tokens=self.num_prompt_tokens,
            num_output_tokens=1,
            finish_reason=self.finish_reason,
            finished=True,
            transfer_params=self.transfer.to_json() if self.transfer is not None else "",
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )


def image_identity(image: ImageEmbeds) -> str:
    """The identity decode must match for a connector that does not check multimodal inputs
    itself (Nixl): the store key, else a digest of the embeddings and grid."""
    if image.uuid:
        return image.uuid
    import hashlib

    import torch

    digest = hashlib.sha256(f"{image.grid_thw}{image.embeds.dtype}{tuple(image.embeds.shape)}".encode())
    digest.update(image.embeds.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + digest.hexdigest()


class FolderTransfer:
    """TransferIdConnector: the KV and its manifest in the node folder, written by the connector."""

    name = tx.TRANSFER_ID_CONNECTOR

    async def prefill(
        self,
        engine: Any,
        store: Path,
        prompt: dict[str, Any],
        images: Sequence[ImageEmbeds],
        sampling: dict[str, Any],
        transfer_id: str,
        request_id: str,
    ) -> PrefillResult:
        """Run the prompt with max_tokens=1; the connector writes the KV and the manifest."""
        max_tokens = sampling.get("max_tokens", DEFAULT_MAX_TOKENS)
        params = kv_sampling_params(
            sampling, {tx.KEY_TRANSFER_ID: transfer_id}, max_tokens=1,
            min_tokens=min(int(sampling.get("min_tokens", 0) or 0), 1), output_kind=output_kind(False),
        )  # fmt: skip
        final = None
        with input_rejections("prefill engine"):
            async for output in engine.generate(prompt, params, request_id):
                final = output
        if final is None or not final.outputs or not final.outputs[0].token_ids:
            mf.remove_transfer(store, transfer_id)
            raise EpdError("prefill produced no token", ErrorCode.INTERNAL)
        completion = final.outputs[0]
        kv = final.kv_transfer_params or {}
        if completion.finish_reason == "error" or not kv.get("epd_committed"):
            mf.remove_transfer(store, transfer_id)
            raise EpdError("prefill could not store its KV cache for decode", ErrorCode.INTERNAL)
        first = int(completion.token_ids[0])
        num_prompt = len(final.prompt_token_ids or [])
        done = completion.finish_reason == "stop" or max_tokens <= 1
        transfer = None
        if done:
            mf.remove_transfer(store, transfer_id)
        else:
            transfer = tx.TransferParams(
                transfer_id=transfer_id,
                num_prompt_tokens=int(kv[tx.KEY_NUM_TOKENS]),
                first_token_id=first,
                digest=str(kv[tx.KEY_DIGEST]),
            )
            mf.write_first_token(store, transfer_id, first)
        return PrefillResult(
            first_token_id=first,
            first_text=completion.text,
            num_prompt_tokens=num_prompt,
            finish_reason=completion.finish_reason if done else None,
            transfer=transfer,
            logprobs=wire_logprobs(completion.logprobs),
            prompt_logprobs=wire_logprobs(final.prompt_logprobs),
        )

    def images_match(self, images: Sequence[ImageEmbeds], manifest: mf.Manifest) -> bool:
        """The count only: the connector compares the multimodal hashes itself, in the engine."""
        return len(images) == len(manifest.mm_hashes)

    def after_decode(self, store: Path, transfer_id: str) -> None:
        """Nothing: the connector deletes the transfer it loaded (single use)."""

    def load_error(self, store: Path, params: tx.TransferParams) -> EpdError:
        """Why the decode engine could not load the transfer: gone, or not this prompt's."""
        try:
            mf.read_manifest(store, params.transfer_id)
        except EpdError as exc:
            if exc.code == ErrorCode.NOT_FOUND:
                return exc
        return invalid_arg(
            f"decode could not load KV transfer {params.transfer_id}: the image embeddings or "
            "prompt differ from what prefill saw, or the transfer is damaged"
        )


class EngineHeldTransfer:
    """A vLLM connector that keeps the KV in the prefill engine until decode reads it (Nixl)."""

    def __init__(self, name: str = tx.NIXL_CONNECTOR) -> None:
        self.name = name
        self._last_sweep = 0.0

    async def prefill(
        self,
        engine: Any,
        store: Path,
        prompt: dict[str, Any],
        images: Sequence[ImageEmbeds],
        sampling: dict[str, Any],
        transfer_id: str,
        request_id: str,
    ) -> PrefillResult:
        """The request asks for ``{"do_remote_decode": true}`` and runs two steps, so that the
        first token's KV is computed too: decode's prompt is the prompt plus that token (it
        continues from prefill's token, also under random sampling), and Nixl's decode side
        refuses to hold more KV blocks than the prefill side hands over. The second token is
        dropped (a request that ends at its first token leaves its blocks to Nixl's lease,
        ``kv_lease_duration``). What the connector returns becomes the ``kv_transfer_params`` of the
        transfer parameters as-is (less the P-side cache count, which vLLM would report as
        decode's ``num_cached_tokens``: that count is decode's proof of loading); the node
        folder gets the manifest (prompt ids, placeholders, image identities, the digest of
        those parameters) and the first token, which decode checks like TransferIdConnector's.
        """
        max_tokens = int(sampling.get("max_tokens", DEFAULT_MAX_TOKENS) or DEFAULT_MAX_TOKENS)
        steps = 2 if max_tokens >= 2 else 1
        params = kv_sampling_params(
            sampling, {"do_remote_decode": True} if steps == 2 else {}, max_tokens=steps,
            min_tokens=min(int(sampling.get("min_tokens", 0) or 0), steps), output_kind=output_kind(True),
        )  # fmt: skip
        head = final = None
        with input_rejections("prefill engine"):
            async for output in engine.generate(prompt, params, request_id):
                if head is None:
                    head = output
                final = output
        if head is None or final is None or not head.outputs or not head.outputs[0].token_ids:
            raise EpdError("prefill produced no token", ErrorCode.INTERNAL)
        first = head.outputs[0]
        token = int(first.token_ids[0])
        # Two tokens in one delta when this loop fell behind: the first one's text on its own.
        text = first.text if len(first.token_ids) == 1 else engine.get_tokenizer().decode([token])
        prompt_ids = list(head.prompt_token_ids or [])
        finished_at_first = head.finished and len(first.token_ids) == 1
        logprobs = wire_logprobs(first.logprobs[:1] if first.logprobs is not None else None)
        prompt_logprobs = wire_logprobs(head.prompt_logprobs)
        if steps == 1 or finished_at_first:
            reason = first.finish_reason if finished_at_first else "length"
            return PrefillResult(token, text, len(prompt_ids), reason or "length", None, logprobs, prompt_logprobs)
        kv = dict(final.kv_transfer_params or {})
        kv.pop(tx.NIXL_REPORTED_CACHE_KEY, None)
        if final.outputs[0].finish_reason == "error" or kv.get("do_remote_prefill") is not True:
            raise EpdError(f"prefill got no {self.name} transfer parameters for decode", ErrorCode.INTERNAL)
        placeholders: list[tuple[int, int]] = []
        if images:
            try:
                placeholders = mf.placeholder_runs(
                    prompt_ids, _image_token_id(engine), [int(img.embeds.shape[0]) for img in images]
                )
            except ValueError as exc:
                raise EpdError(f"prefill cannot describe the prompt for decode: {exc}", ErrorCode.INTERNAL) from None
        manifest = mf.Manifest(
            transfer_id=transfer_id, token_ids=prompt_ids, mm_hashes=[image_identity(img) for img in images],
            chunks=[], layers=[], block_size=0, created=time.time(), mm_placeholders=placeholders,
            connector=self.name, kv_params_digest=tx.kv_params_digest(kv),
        )  # fmt: skip
        self._sweep_records(store)
        mf.write_manifest(store, manifest)
        mf.write_first_token(store, transfer_id, token)
        transfer = tx.TransferParams(
            transfer_id, len(prompt_ids), token, manifest.digest, connector=self.name, kv_transfer_params=kv
        )
        try:  # what decode will be handed must pass decode's own parsing
            checked = tx.TransferParams.parse(transfer.to_json())
        except EpdError as exc:
            mf.remove_transfer(store, transfer_id)
            raise EpdError(f"prefill made unusable transfer parameters: {exc.message}", ErrorCode.INTERNAL) from None
        return PrefillResult(token, text, len(prompt_ids), None, checked, logprobs, prompt_logprobs)

    def _sweep_records(self, store: Path, now: float | None = None) -> None:
        """Remove records no decode took (client gone, BLS crashed), as TransferIdConnector's
        producer sweeps its transfers: at most every RECORD_SWEEP_S, those older than
        RECORD_MAX_AGE_S (Nixl has released their blocks long before, by its lease)."""
        now = time.time() if now is None else now
        if now - self._last_sweep >= RECORD_SWEEP_S:
            self._last_sweep = now
            mf.sweep_expired(store, RECORD_MAX_AGE_S, now)

    def images_match(self, images: Sequence[ImageEmbeds], manifest: mf.Manifest) -> bool:
        """The connector does not check multimodal inputs: the images' identities must be the
        ones prefill recorded."""
        return len(images) == len(manifest.mm_hashes) and [image_identity(img) for img in images] == manifest.mm_hashes

    def after_decode(self, store: Path, transfer_id: str) -> None:
        """Remove the record: single use, as TransferIdConnector makes its transfers."""
        mf.remove_transfer(store, transfer_id)

    def load_error(self, store: Path, params: tx.TransferParams) -> EpdError:
        """The prefill engine released or lost the blocks."""
        return EpdError(
            f"decode could not read KV transfer {params.transfer_id} from the prefill engine "
            f"({params.connector}): its lease expired or the prefill engine is gone; retry the request",
            ErrorCode.UNAVAILABLE,
        )


def _image_token_id(engine: Any) -> int:
    """The token vLLM expands into one placeholder per embedding row (Qwen2-VL's image pad)."""
    hf_config = getattr(engine.model_config, "hf_config", None)
    token = getattr(hf_config, "image_token_id", None)
    if not isinstance(token, int):
        raise ValueError("the model config names no image_token_id")
    return token


KvTransfer = FolderTransfer | EngineHeldTransfer


def kv_transfer(connector: str) -> KvTransfer:
    """The connector's behaviour, for one engine (a KV-holding connector keeps sweep state)."""
    if connector == tx.TRANSFER_ID_CONNECTOR:
        return FolderTransfer()
    return EngineHeldTransfer(connector)

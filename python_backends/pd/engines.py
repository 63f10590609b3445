"""Prefill and decode vLLM engines with KV transfer between them (Triton-free).

Who calls what:

- ``prefill`` model (python backend, one process per instance): ``PrefillEngine.start``
  once in ``initialize`` with the engine args from its JSON (pass them through
  :func:`python_backends.pd.engine_args.pd_engine_args`, or write the result of it into the
  JSON), then :meth:`PrefillEngine.prefill` per request. It returns the first token at once and
  the :class:`TransferParams` (a small JSON object: the transfer's id, digest and first token, and
  the KV connector's own ``kv_transfer_params``) that the BLS hands to ``decode``, whichever
  connector moves the KV (TransferIdConnector through the node folder, NixlConnector GPU to GPU).
- ``decode`` model (decoupled python backend): ``DecodeEngine.start`` once, then
  :meth:`DecodeEngine.decode` per request; it yields tokens 2..N. It needs the same
  image embeddings as prefill (they identify the request's multimodal inputs and give
  Qwen2-VL's M-RoPE positions), but it never runs the vision encoder and computes exactly
  one new position before decoding.
- The BLS: if the client goes away between the two calls, call
  :meth:`DecodeEngine.discard` (or let the producer's expiry sweep remove it).

What the decode side does with the transfer parameters: parse and validate them
(INVALID_ARG), find the committed transfer (NOT_FOUND when unknown, consumed or expired),
check the digest against the manifest (INVALID_ARG when altered), then submit the prefilled
prompt's token ids plus the first token, so decode *continues* from prefill's first token
(also under random sampling) instead of sampling its own. On the first output it checks
``num_cached_tokens`` covers the whole transferred prompt -- prefix caching is off on the
decode engine, so those tokens can only have come from the connector -- and raises
INTERNAL otherwise: a silent recompute is treated as a failure, not a fallback. What differs
per connector (who writes the transfer's record, who checks the images, who removes it, what a
failed load means) is the engine's :mod:`python_backends.pd.kv_transfer` object, picked once.

Sampling across the split: prefill runs the client's sampling parameters with
``max_tokens=1``; decode runs them with ``max_tokens - 1`` and ``min_tokens - 1``. Because
the first token is part of decode's prompt, ``presence_penalty``/``frequency_penalty`` do
not count it as an output token there (``repetition_penalty`` does); a stop string that
spans the first and second token is not detected. Everything here runs on the engine's
event loop thread.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from python_backends.engines.async_llm import (
    input_rejections,
    output_kind,
    shut_down_engine,
    start_async_llm,
    unfinished_requests,
)
from python_backends.engines.generation import GenerationChunk, wire_logprobs
from python_backends.engines.prompt import ImageEmbeds, vllm_prompt
from python_backends.errors import EpdError, ErrorCode, invalid_arg
from python_backends.pd import manifest as mf
from python_backends.pd import transfer as tx
from python_backends.pd.engine_args import CONNECTOR_NAME, Role, check_engine_args
from python_backends.pd.grammar import decode_extra_args
from python_backends.pd.kv_transfer import PrefillResult, kv_sampling_params, kv_transfer
from python_backends.request.sampling import DEFAULT_MAX_TOKENS


def one_sequence(sampling: Mapping[str, Any] | None) -> dict[str, Any]:
    """``sampling`` of a split request, which is one sequence: ``epd`` sends each of a request's
    ``n`` sequences through prefill and decode on its own (``epd/disaggregated.py``)."""
    sampling = dict(sampling or {})
    if int(sampling.pop("n", 1) or 1) != 1:
        raise invalid_arg("prefill and decode serve one sequence (n = 1); epd sends each of n on its own")
    return sampling


def primed_prompt_text(tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool) -> str:
    """The text vLLM's streaming detokenizer wrongly puts before decode's first piece, or "".

    vLLM primes ``tokenizers.decoders.DecodeStream`` with the request's prompt ids. Decode's
    prompt ends with prefill's token; when that token ends inside a UTF-8 character (byte-level
    BPE, e.g. the first byte of a CJK character), DecodeStream (tokenizers 0.23) keeps no prefix
    and its first complete step returns the whole prompt's text (special tokens skipped) before
    the new character. That text is decode(prompt ids without the first token): strip it.
    ``tokenizer``: the Rust ``tokenizers.Tokenizer`` (vLLM's ``renderer.tokenizer._tokenizer``).
    """
    if tokenizer is None or not prompt_ids:
        return ""
    # A character is at most 4 bytes: the last 8 tokens tell whether the prompt ends inside one.
    if not tokenizer.decode(list(prompt_ids[-8:]), skip_special_tokens).endswith("\ufffd"):
        return ""
    return str(tokenizer.decode(list(prompt_ids[:-1]), skip_special_tokens))


def strip_primed_prompt(text: str, primed: str) -> str:
    return text[len(primed) :] if primed and text.startswith(primed) else text


class KvEngine:
    """A vLLM AsyncLLM with a KV connector in ``ROLE``. Methods run on the event loop thread."""

    ROLE: Role

    def __init__(self, engine: Any, store: Path, connector: str = CONNECTOR_NAME) -> None:
        self.engine = engine
        self.store = store
        self.connector = connector
        self.kv = kv_transfer(connector)  # what differs per connector, chosen once

    @classmethod
    async def start(cls, engine_args: Mapping[str, Any]) -> Self:
        store = check_engine_args(engine_args, cls.ROLE)
        connector = str(engine_args["kv_transfer_config"]["kv_connector"])
        return cls(await start_async_llm(engine_args), store, connector)

    def unfinished_requests(self) -> int:
        return unfinished_requests(self.engine)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def shutdown(self) -> None:
        shut_down_engine(self.engine)


class PrefillEngine(KvEngine):
    """The KV producer: prompt + embeddings -> first token + a committed transfer."""

    ROLE = "prefill"

    async def prefill(
        self,
        prompt: str | Sequence[int],
        images: Sequence[ImageEmbeds] = (),
        sampling: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> PrefillResult:
        """Run the prompt and commit its KV as a transfer (how: the connector's ``kv`` object).

        ``cache_salt`` (vLLM's) keeps this request off prefix-cache entries of other salts.
        """
        transfer_id = tx.new_transfer_id()
        request = vllm_prompt(prompt, images, cache_salt=cache_salt)
        return await self.kv.prefill(
            self.engine, self.store, request, images, one_sequence(sampling), transfer_id, request_id or transfer_id
        )


class DecodeEngine(KvEngine):
    """The KV consumer: loads a transfer instead of computing the prompt, streams the rest."""

    ROLE = "decode"

    def resolve(
        self, transfer_params: str | bytes | Mapping[str, Any] | tx.TransferParams
    ) -> tuple[tx.TransferParams, mf.Manifest]:
        """Validate transfer parameters against the committed transfer (no engine work)."""
        params = (
            transfer_params
            if isinstance(transfer_params, tx.TransferParams)
            else tx.TransferParams.parse(transfer_params)
        )
        manifest = mf.read_manifest(self.store, params.transfer_id)
        mf.check_manifest(params, manifest, mf.read_first_token(self.store, params.transfer_id))
        return params, manifest

    def discard(self, transfer_params: str | bytes | Mapping[str, Any] | tx.TransferParams) -> bool:
        """Drop a transfer that will not be decoded (client cancelled between the stages)."""
        params = (
            transfer_params
            if isinstance(transfer_params, tx.TransferParams)
            else tx.TransferParams.parse(transfer_params)
        )
        return mf.remove_transfer(self.store, params.transfer_id)

    async def decode(
        self,
        transfer_params: str | bytes | Mapping[str, Any] | tx.TransferParams,
        images: Sequence[ImageEmbeds] = (),
        sampling: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        stream: bool = True,
    ) -> AsyncIterator[GenerationChunk]:
        """Yield tokens 2..N of the request that prefill started."""
        params, manifest = self.resolve(transfer_params)
        if not self.kv.images_match(images, manifest):
            raise invalid_arg(
                f"the transfer was prefilled with {len(manifest.mm_hashes)} image(s); decode got "
                f"{len(images)} that differ: send decode the same image embeddings as prefill"
            )
        try:
            async for chunk in self._decode(params, manifest, images, sampling, request_id, stream):
                yield chunk
        finally:
            self.kv.after_decode(self.store, params.transfer_id)

    async def _decode(
        self,
        params: tx.TransferParams,
        manifest: mf.Manifest,
        images: Sequence[ImageEmbeds],
        sampling: Mapping[str, Any] | None,
        request_id: str | None,
        stream: bool,
    ) -> AsyncIterator[GenerationChunk]:
        sampling = one_sequence(sampling)
        max_tokens = int(sampling.get("max_tokens", DEFAULT_MAX_TOKENS) or DEFAULT_MAX_TOKENS)
        if max_tokens < 2:
            raise invalid_arg("nothing to decode: max_tokens < 2 is served by prefill alone")
        structured = sampling.pop("structured_outputs", None)
        if structured is not None:  # prefill began the grammar: decode continues it (pd/grammar.py)
            continued = decode_extra_args(structured, [params.first_token_id], self.engine)
            sampling["extra_args"] = {**(sampling.get("extra_args") or {}), **continued}
        vllm_params = kv_sampling_params(
            sampling,
            params.connector_params(),
            max_tokens=max_tokens - 1,
            min_tokens=max(int(sampling.get("min_tokens", 0) or 0) - 1, 0),
            output_kind=output_kind(stream),
            prompt_logprobs=None,  # prefill's answer carries the prompt's
        )
        token_ids = mf.collapse_placeholders(manifest.token_ids, manifest.mm_placeholders)
        prompt = vllm_prompt(token_ids + [params.first_token_id], images)
        request_id = request_id or f"decode-{params.transfer_id}"
        skip_special = vllm_params.skip_special_tokens
        primed = primed_prompt_text(self._rust_tokenizer(), prompt["prompt_token_ids"], skip_special)
        produced = 1  # prefill's first token
        first = True
        with input_rejections("decode engine"):
            async for output in self.engine.generate(prompt, vllm_params, request_id):
                completion = output.outputs[0]
                if completion.finish_reason == "error":
                    raise self.kv.load_error(self.store, params)
                cached = int(output.num_cached_tokens or 0)
                if first and cached < manifest.num_tokens:
                    await self.engine.abort(request_id)
                    raise EpdError(
                        f"decode computed {manifest.num_tokens - cached} prompt tokens itself "
                        "instead of loading them: the KV transfer was not used",
                        ErrorCode.INTERNAL,
                    )
                first = False
                produced = 1 + len(completion.token_ids) if not stream else produced + len(completion.token_ids)
                text = completion.text
                if primed and text:  # the first text out: the only one the priming bug can touch
                    text, primed = strip_primed_prompt(text, primed), ""
                yield GenerationChunk(
                    text=text,
                    token_ids=list(completion.token_ids),
                    num_output_tokens=produced,
                    finish_reason=completion.finish_reason,
                    finished=output.finished,
                    num_cached_tokens=cached,
                    logprobs=wire_logprobs(completion.logprobs),
                )

    def _rust_tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` vLLM's detokenizer steps (None: no fast tokenizer)."""
        renderer = getattr(self.engine, "renderer", None)
        return getattr(getattr(renderer, "tokenizer", None), "_tokenizer", None)

"""Prefill and decode vLLM engines with KV transfer between them (Triton-free).

Who calls what:

- ``prefill`` model (python backend, one process per instance): ``PrefillEngine.start``
  once in ``initialize`` with the engine args from its JSON (pass them through
  :func:`pd_engine_args`, or write the result of it into the JSON), then
  :meth:`PrefillEngine.prefill` per request. It returns the first token at once and the
  :class:`TransferParams` (a small JSON object: the transfer's id, digest and first token, and
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
INTERNAL otherwise: a silent recompute is treated as a failure, not a fallback.

Sampling across the split: prefill runs the client's sampling parameters with
``max_tokens=1``; decode runs them with ``max_tokens - 1`` and ``min_tokens - 1``. Because
the first token is part of decode's prompt, ``presence_penalty``/``frequency_penalty`` do
not count it as an output token there (``repetition_penalty`` does); a stop string that
spans the first and second token is not detected. Everything here runs on the engine's
event loop thread.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Self

from python_backends.engines.generation import GenerationChunk
from python_backends.engines.llm import input_rejections, shut_down_engine, unfinished_requests
from python_backends.errors import EpdError, ErrorCode, invalid_arg
from python_backends.pd import transfer as tx
from python_backends.request.sampling import DEFAULT_MAX_TOKENS

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
CONNECTOR_NAME = tx.TRANSFER_ID_CONNECTOR
CONNECTOR_MODULE = "python_backends.pd.connector"
NIXL_CONNECTOR = tx.NIXL_CONNECTOR
# The connectors a target may choose (builders/targets.py, PdServing.kv_connector) -> the module
# that holds it (None: vLLM's own). TransferIdConnector is the cpu default: files in a tmpfs
# folder, keyed by our transfer id. NixlConnector (vLLM 0.32, ``nixl`` package) moves KV
# GPU-to-GPU on one node (UCX/NVLink) without a host copy. Both serve the same epd transfer
# parameters (:class:`tx.TransferParams`, the connector's own ``kv_transfer_params`` inside) and
# the same checks on the decode side; the node folder (``store_path``) holds every transfer's
# record (manifest, first token) and, for TransferIdConnector only, its KV too.
KV_CONNECTORS: dict[str, str | None] = {CONNECTOR_NAME: CONNECTOR_MODULE, NIXL_CONNECTOR: None}
_KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
# Records of transfers that a connector other than TransferIdConnector moves: swept by prefill.
RECORD_SWEEP_S, RECORD_MAX_AGE_S = 30.0, 300.0


@dataclass(frozen=True)
class ImageEmbeds:
    """One image's precomputed embeddings, as the encoder produced them."""

    embeds: torch.Tensor  # [num_tokens, hidden] (num_tokens = t*h*w / merge**2)
    grid_thw: tuple[int, int, int]
    # A stable identity of these embeddings (the store's content key), given to vLLM as
    # ``multi_modal_uuids``. Needed across processes: vLLM 0.32 hashes an embeddings item
    # as a dict whose key order follows a set (Python's per-process hash seed), so the
    # prefill and decode processes can compute different hashes for the same tensors and
    # the connector then refuses the transfer ("multimodal inputs differ"). Measured: 2 of
    # 4 server starts. Empty: let vLLM hash (fine within one process).
    uuid: str = ""
    # "image" or "video" (a video's embeddings: its frames' tokens, grid t = frames / 2).
    modality: str = "image"


def _by_modality(items: Sequence[ImageEmbeds]) -> dict[str, list[ImageEmbeds]]:
    groups: dict[str, list[ImageEmbeds]] = {}
    for item in items:
        groups.setdefault(item.modality, []).append(item)
    return groups


def multi_modal_data(items: Sequence[ImageEmbeds]) -> dict[str, Any] | None:
    """vLLM's ``enable_mm_embeds`` input per modality: embeddings concatenated, grids stacked
    (``image_embeds`` + ``image_grid_thw``, ``video_embeds`` + ``video_grid_thw``), each
    modality's items in their prompt order."""
    if not items:
        return None
    import torch

    data: dict[str, Any] = {}
    for modality, group in _by_modality(items).items():
        embeds = torch.cat([item.embeds for item in group], dim=0)
        grids = torch.tensor([list(item.grid_thw) for item in group], dtype=torch.int64)
        data[modality] = {f"{modality}_embeds": embeds, f"{modality}_grid_thw": grids}
    return data


def multi_modal_uuids(items: Sequence[ImageEmbeds]) -> dict[str, Any] | None:
    """vLLM's ``multi_modal_uuids`` when every item has an identity, else None."""
    if not items or not all(item.uuid for item in items):
        return None
    return {modality: [item.uuid for item in group] for modality, group in _by_modality(items).items()}


def pd_engine_args(
    base: Mapping[str, Any], role: Role, store_path: str | Path, connector: str = CONNECTOR_NAME
) -> dict[str, Any]:
    """Engine args for one role from the colocated ones (``llm``'s JSON).

    Adds the connector config (``connector``: a key of :data:`KV_CONNECTORS`) and
    ``enable_mm_embeds``; the decode role also turns prefix caching off (its cached-token count
    is the proof that KV came from the connector).
    """
    if role not in _KV_ROLE:
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    if connector not in KV_CONNECTORS:
        raise ValueError(f"kv connector must be one of {sorted(KV_CONNECTORS)}, got {connector!r}")
    args = copy.deepcopy(dict(base))
    args["enable_mm_embeds"] = True
    ktc: dict[str, Any] = {"kv_connector": connector, "kv_role": _KV_ROLE[role], "kv_load_failure_policy": "fail"}
    # Nixl reads only the extra keys it knows; store_path is the wrappers' record folder there.
    ktc["kv_connector_extra_config"] = {"store_path": str(store_path)}
    if connector == CONNECTOR_NAME:
        ktc["kv_connector_module_path"] = CONNECTOR_MODULE
    else:
        ktc["kv_buffer_device"] = "cuda"  # GPU to GPU, no host copy
    args["kv_transfer_config"] = ktc
    if role == "decode":
        args["enable_prefix_caching"] = False
    check_engine_args(args, role)
    return args


def check_engine_args(args: Mapping[str, Any], role: Role) -> Path:
    """Refuse engine args that would let decode recompute silently; returns the node's transfer
    folder (``store_path``: every connector's records, TransferIdConnector's KV too)."""
    where = f"{role} engine args"
    ktc = args.get("kv_transfer_config")
    if not isinstance(ktc, Mapping):
        raise ValueError(f"{where}: kv_transfer_config is missing (build them with pd_engine_args)")
    connector = ktc.get("kv_connector")
    if connector not in KV_CONNECTORS or ktc.get("kv_connector_module_path") != KV_CONNECTORS[connector]:
        choices = ", ".join(f"{name!r} from {module or 'vLLM'!r}" for name, module in KV_CONNECTORS.items())
        raise ValueError(f"{where}: kv_connector must be one of {choices} (see python_backends/pd/__init__.py for why)")
    if ktc.get("kv_role") != _KV_ROLE[role]:
        raise ValueError(f"{where}: kv_role must be {_KV_ROLE[role]!r}, got {ktc.get('kv_role')!r}")
    if ktc.get("kv_load_failure_policy", "fail") != "fail":
        raise ValueError(f"{where}: kv_load_failure_policy must be 'fail' (a failed load must not recompute)")
    store = (ktc.get("kv_connector_extra_config") or {}).get("store_path")
    if not store:
        raise ValueError(f"{where}: kv_connector_extra_config.store_path is missing")
    if not args.get("enable_mm_embeds"):
        raise ValueError(f"{where}: enable_mm_embeds must be true (images arrive as embeddings)")
    if role == "decode" and args.get("enable_prefix_caching", True) is not False:
        raise ValueError(f"{where}: enable_prefix_caching must be false on decode")
    return Path(store)


async def _start_async_llm(engine_args: Mapping[str, Any]) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))


def _sampling_params(sampling: Mapping[str, Any], overrides: Mapping[str, Any], kv_params: dict[str, Any]) -> Any:
    from vllm import SamplingParams

    values = {**sampling, **overrides}
    values["extra_args"] = {**(values.get("extra_args") or {}), "kv_transfer_params": kv_params}
    try:
        return SamplingParams(**values)
    except (ValueError, TypeError) as exc:
        raise invalid_arg(f"invalid sampling_parameters: {exc}") from None


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


def _output_kind(stream: bool) -> Any:
    from vllm.sampling_params import RequestOutputKind

    return RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    first_text: str
    num_prompt_tokens: int
    finish_reason: str | None  # "stop" when the first token already ends the request
    transfer: tx.TransferParams | None  # None when nothing is left to decode

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


class KvEngine:
    """A vLLM AsyncLLM with a KV connector in ``ROLE``. Methods run on the event loop thread."""

    ROLE: Role

    def __init__(self, engine: Any, store: Path, connector: str = CONNECTOR_NAME) -> None:
        self.engine = engine
        self.store = store
        self.connector = connector

    @classmethod
    async def start(cls, engine_args: Mapping[str, Any]) -> Self:
        store = check_engine_args(engine_args, cls.ROLE)
        connector = str(engine_args["kv_transfer_config"]["kv_connector"])
        return cls(await _start_async_llm(engine_args), store, connector)

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
        """Run the prompt with max_tokens=1 and commit its KV as a transfer.

        ``cache_salt`` (vLLM's) keeps this request off prefix-cache entries of other salts.
        """
        sampling = dict(sampling or {})
        transfer_id = tx.new_transfer_id()
        vllm_prompt: dict[str, Any] = (
            {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}
        )
        mm = multi_modal_data(images)
        if mm:
            vllm_prompt["multi_modal_data"] = mm
            uuids = multi_modal_uuids(images)
            if uuids:
                vllm_prompt["multi_modal_uuids"] = uuids
        if cache_salt:
            vllm_prompt["cache_salt"] = cache_salt
        if self.connector == CONNECTOR_NAME:
            return await self._prefill_to_folder(vllm_prompt, sampling, transfer_id, request_id or transfer_id)
        return await self._prefill_in_engine(vllm_prompt, images, sampling, transfer_id, request_id or transfer_id)

    async def _prefill_to_folder(
        self, vllm_prompt: dict[str, Any], sampling: dict[str, Any], transfer_id: str, request_id: str
    ) -> PrefillResult:
        """TransferIdConnector: the connector writes the KV and the manifest into the node folder."""
        max_tokens = sampling.get("max_tokens", DEFAULT_MAX_TOKENS)
        params = _sampling_params(
            sampling,
            {"max_tokens": 1, "min_tokens": min(int(sampling.get("min_tokens", 0) or 0), 1),
             "output_kind": _output_kind(False)},
            {tx.KEY_TRANSFER_ID: transfer_id},
        )
        final = None
        with input_rejections("prefill engine"):
            async for output in self.engine.generate(vllm_prompt, params, request_id):
                final = output
        if final is None or not final.outputs or not final.outputs[0].token_ids:
            tx.remove_transfer(self.store, transfer_id)
            raise EpdError("prefill produced no token", ErrorCode.INTERNAL)
        completion = final.outputs[0]
        kv = final.kv_transfer_params or {}
        if completion.finish_reason == "error" or not kv.get("epd_committed"):
            tx.remove_transfer(self.store, transfer_id)
            raise EpdError("prefill could not store its KV cache for decode", ErrorCode.INTERNAL)
        first = int(completion.token_ids[0])
        num_prompt = len(final.prompt_token_ids or [])
        done = completion.finish_reason == "stop" or max_tokens <= 1
        transfer = None
        if done:
            tx.remove_transfer(self.store, transfer_id)
        else:
            transfer = tx.TransferParams(
                transfer_id=transfer_id,
                num_prompt_tokens=int(kv[tx.KEY_NUM_TOKENS]),
                first_token_id=first,
                digest=str(kv[tx.KEY_DIGEST]),
            )
            tx.write_first_token(self.store, transfer_id, first)
        return PrefillResult(
            first_token_id=first,
            first_text=completion.text,
            num_prompt_tokens=num_prompt,
            finish_reason=completion.finish_reason if done else None,
            transfer=transfer,
        )

    async def _prefill_in_engine(
        self,
        vllm_prompt: dict[str, Any],
        images: Sequence[ImageEmbeds],
        sampling: dict[str, Any],
        transfer_id: str,
        request_id: str,
    ) -> PrefillResult:
        """A vLLM connector that keeps the KV in this engine until decode reads it (Nixl).

        The request asks for ``{"do_remote_decode": true}`` and runs two steps, so that the
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
        params = _sampling_params(
            sampling,
            {"max_tokens": steps, "min_tokens": min(int(sampling.get("min_tokens", 0) or 0), steps),
             "output_kind": _output_kind(True)},
            {"do_remote_decode": True} if steps == 2 else {},
        )
        head = final = None
        with input_rejections("prefill engine"):
            async for output in self.engine.generate(vllm_prompt, params, request_id):
                if head is None:
                    head = output
                final = output
        if head is None or final is None or not head.outputs or not head.outputs[0].token_ids:
            raise EpdError("prefill produced no token", ErrorCode.INTERNAL)
        first = head.outputs[0]
        token = int(first.token_ids[0])
        # Two tokens in one delta when this loop fell behind: the first one's text on its own.
        text = first.text if len(first.token_ids) == 1 else self.engine.get_tokenizer().decode([token])
        prompt_ids = list(head.prompt_token_ids or [])
        finished_at_first = head.finished and len(first.token_ids) == 1
        if steps == 1 or finished_at_first:
            reason = first.finish_reason if finished_at_first else "length"
            return PrefillResult(token, text, len(prompt_ids), reason or "length", None)
        kv = dict(final.kv_transfer_params or {})
        kv.pop(tx.NIXL_REPORTED_CACHE_KEY, None)
        if final.outputs[0].finish_reason == "error" or kv.get("do_remote_prefill") is not True:
            raise EpdError(f"prefill got no {self.connector} transfer parameters for decode", ErrorCode.INTERNAL)
        placeholders: list[tuple[int, int]] = []
        if images:
            try:
                placeholders = tx.placeholder_runs(
                    prompt_ids, self._image_token_id(), [int(img.embeds.shape[0]) for img in images]
                )
            except ValueError as exc:
                raise EpdError(f"prefill cannot describe the prompt for decode: {exc}", ErrorCode.INTERNAL) from None
        manifest = tx.Manifest(
            transfer_id=transfer_id, token_ids=prompt_ids, mm_hashes=[image_identity(img) for img in images],
            chunks=[], layers=[], block_size=0, created=time.time(), mm_placeholders=placeholders,
            connector=self.connector, kv_params_digest=tx.kv_params_digest(kv),
        )  # fmt: skip
        self._sweep_records()
        tx.write_manifest(self.store, manifest)
        tx.write_first_token(self.store, transfer_id, token)
        transfer = tx.TransferParams(
            transfer_id, len(prompt_ids), token, manifest.digest, connector=self.connector, kv_transfer_params=kv
        )
        try:  # what decode will be handed must pass decode's own parsing
            checked = tx.TransferParams.parse(transfer.to_json())
        except EpdError as exc:
            tx.remove_transfer(self.store, transfer_id)
            raise EpdError(f"prefill made unusable transfer parameters: {exc.message}", ErrorCode.INTERNAL) from None
        return PrefillResult(token, text, len(prompt_ids), None, checked)

    def _sweep_records(self, now: float | None = None) -> None:
        """Remove records no decode took (client gone, BLS crashed), as TransferIdConnector's
        producer sweeps its transfers: at most every RECORD_SWEEP_S, those older than
        RECORD_MAX_AGE_S (Nixl has released their blocks long before, by its lease)."""
        now = time.time() if now is None else now
        if now - getattr(self, "_last_sweep", 0.0) >= RECORD_SWEEP_S:
            self._last_sweep = now
            tx.sweep_expired(self.store, RECORD_MAX_AGE_S, now)

    def _image_token_id(self) -> int:
        """The token vLLM expands into one placeholder per embedding row (Qwen2-VL's image pad)."""
        hf_config = getattr(self.engine.model_config, "hf_config", None)
        token = getattr(hf_config, "image_token_id", None)
        if not isinstance(token, int):
            raise ValueError("the model config names no image_token_id")
        return token


class DecodeEngine(KvEngine):
    """The KV consumer: loads a transfer instead of computing the prompt, streams the rest."""

    ROLE = "decode"

    def resolve(
        self, transfer_params: str | bytes | Mapping[str, Any] | tx.TransferParams
    ) -> tuple[tx.TransferParams, tx.Manifest]:
        """Validate transfer parameters against the committed transfer (no engine work)."""
        params = (
            transfer_params
            if isinstance(transfer_params, tx.TransferParams)
            else tx.TransferParams.parse(transfer_params)
        )
        manifest = tx.read_manifest(self.store, params.transfer_id)
        tx.check_manifest(params, manifest, tx.read_first_token(self.store, params.transfer_id))
        return params, manifest

    def discard(self, transfer_params: str | bytes | Mapping[str, Any] | tx.TransferParams) -> bool:
        """Drop a transfer that will not be decoded (client cancelled between the stages)."""
        params = (
            transfer_params
            if isinstance(transfer_params, tx.TransferParams)
            else tx.TransferParams.parse(transfer_params)
        )
        return tx.remove_transfer(self.store, params.transfer_id)

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
        if len(images) != len(manifest.mm_hashes) or (
            not manifest.holds_kv and [image_identity(img) for img in images] != manifest.mm_hashes
        ):  # TransferIdConnector compares the multimodal hashes itself, inside the engine
            raise invalid_arg(
                f"the transfer was prefilled with {len(manifest.mm_hashes)} image(s); decode got "
                f"{len(images)} that differ: send decode the same image embeddings as prefill"
            )
        try:
            async for chunk in self._decode(params, manifest, images, sampling, request_id, stream):
                yield chunk
        finally:
            if not manifest.holds_kv:  # single use, as TransferIdConnector makes its transfers
                tx.remove_transfer(self.store, params.transfer_id)

    async def _decode(
        self,
        params: tx.TransferParams,
        manifest: tx.Manifest,
        images: Sequence[ImageEmbeds],
        sampling: Mapping[str, Any] | None,
        request_id: str | None,
        stream: bool,
    ) -> AsyncIterator[GenerationChunk]:
        sampling = dict(sampling or {})
        max_tokens = int(sampling.get("max_tokens", DEFAULT_MAX_TOKENS) or DEFAULT_MAX_TOKENS)
        if max_tokens < 2:
            raise invalid_arg("nothing to decode: max_tokens < 2 is served by prefill alone")
        overrides = {
            "max_tokens": max_tokens - 1,
            "min_tokens": max(int(sampling.get("min_tokens", 0) or 0) - 1, 0),
            "output_kind": _output_kind(stream),
        }
        vllm_params = _sampling_params(sampling, overrides, params.connector_params())
        token_ids = tx.collapse_placeholders(manifest.token_ids, manifest.mm_placeholders)
        prompt: dict[str, Any] = {"prompt_token_ids": token_ids + [params.first_token_id]}
        mm = multi_modal_data(images)
        if mm:
            prompt["multi_modal_data"] = mm
            uuids = multi_modal_uuids(images)
            if uuids:
                prompt["multi_modal_uuids"] = uuids
        request_id = request_id or f"decode-{params.transfer_id}"
        skip_special = vllm_params.skip_special_tokens
        primed = primed_prompt_text(self._rust_tokenizer(), prompt["prompt_token_ids"], skip_special)
        produced = 1  # prefill's first token
        first = True
        with input_rejections("decode engine"):
            async for output in self.engine.generate(prompt, vllm_params, request_id):
                completion = output.outputs[0]
                if completion.finish_reason == "error":
                    raise self._load_error(params, manifest)
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
                )

    def _rust_tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` vLLM's detokenizer steps (None: no fast tokenizer)."""
        renderer = getattr(self.engine, "renderer", None)
        return getattr(getattr(renderer, "tokenizer", None), "_tokenizer", None)

    def _load_error(self, params: tx.TransferParams, manifest: tx.Manifest) -> EpdError:
        if not manifest.holds_kv:  # the prefill engine released or lost the blocks
            return EpdError(
                f"decode could not read KV transfer {params.transfer_id} from the prefill engine "
                f"({params.connector}): its lease expired or the prefill engine is gone; retry the request",
                ErrorCode.UNAVAILABLE,
            )
        try:
            tx.read_manifest(self.store, params.transfer_id)
        except EpdError as exc:
            if exc.code == ErrorCode.NOT_FOUND:
                return exc
        return invalid_arg(
            f"decode could not load KV transfer {params.transfer_id}: the image embeddings or "
            "prompt differ from what prefill saw, or the transfer is damaged"
        )

"""``TransferIdConnector``: a vLLM v1 KV connector keyed by a transfer id, for CPU nodes.

Loaded by vLLM itself inside each engine (scheduler side and worker side) through
``kv_transfer_config = {"kv_connector": "TransferIdConnector",
"kv_connector_module_path": "python_backends.pd.connector", ...}``; our code never builds
it. Why this connector and not one that ships with vLLM is explained in
:mod:`python_backends.pd`.

Producer (``kv_role="kv_producer"``, the prefill engine). A request whose
``kv_transfer_params`` carry ``epd_transfer_id`` has the KV of *every* prompt token
written to ``<store>/<transfer_id>/`` -- one safetensors file per scheduled prefill chunk,
holding, per layer, the whole pages (blocks) its tokens touch -- and, when the request
finishes with its prompt complete, a manifest (token ids, multimodal hashes and
placeholder ranges, chunk list) that commits the transfer. Nothing is rounded down to whole
blocks: a 5-token prompt transfers its one partly filled page. Pages are copied whole
because the order of tokens inside a page belongs to the attention backend (vLLM's CPU
backend keeps all K rows of a block, then all V rows). The request's output carries
``kv_transfer_params = {"epd_transfer_id", "epd_digest", "epd_num_prompt_tokens",
"epd_committed"}``.

Consumer (``kv_role="kv_consumer"``, the decode engine). A request whose
``kv_transfer_params`` carry ``epd_transfer_id`` (+ ``epd_digest``) gets the first
``min(n, len(prompt) - 1)`` prompt tokens' KV loaded synchronously before its first forward
(``n`` = tokens in the manifest), after the connector checked that the manifest exists,
that its digest equals the one the caller sent, and that the request's own prompt token ids
and multimodal hashes equal the manifest's. Any failure -- unknown or expired transfer,
mismatch, missing or malformed chunk -- is reported as failed blocks, and with vLLM's
``kv_load_failure_policy="fail"`` (the default, which the decode wrapper enforces) the
request ends with ``finish_reason="error"``: it never silently recomputes. A consumer
request that named a valid transfer deletes it when it finishes (single use).

Expiry: the producer removes transfers older than ``max_age_s`` (extra config, default
300 s) at most once every ``sweep_interval_s`` (default 30 s), so a prefill whose decode
never came does not leak memory.

Extra config (``kv_connector_extra_config``): ``store_path`` (required; put it on tmpfs,
e.g. ``/dev/shm/...``; both roles of a node must name the same folder), ``max_age_s``,
``sweep_interval_s``.

Limits (checked at start-up where possible): one KV cache group (no hybrid/sliding-window
mixes), non-MLA attention, tensor/pipeline parallel size 1 per engine, producer and consumer
must use the same model, dtype and block layout (the chunk shapes are checked on load).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from python_backends.errors import EpdError
from python_backends.pd import manifest as mf
from python_backends.pd import transfer as tx

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _block_span(block_size: int, start: int, end: int) -> tuple[int, int]:
    """Indexes (into the request's block list) of the blocks holding tokens ``[start, end)``."""
    return start // block_size, (end - 1) // block_size + 1


def _blocks_of(block_ids: list[int], block_size: int, start: int, end: int) -> set[int]:
    if end <= start:
        return set()
    first, last = _block_span(block_size, start, end)
    return set(block_ids[first:last])


@dataclass
class _Op:
    """One request's work in one step (scheduler -> worker)."""

    req_id: str
    transfer_id: str
    is_store: bool
    start: int
    end: int
    block_ids: list[int]
    error: str | None = None  # consumer only: why this load must fail


@dataclass
class TransferIdMetadata(KVConnectorMetadata):
    ops: list[_Op] = field(default_factory=list)


@dataclass
class _StoreState:
    transfer_id: str
    token_ids: list[int]
    mm_hashes: list[str]
    mm_placeholders: list[tuple[int, int]]
    chunks: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _LoadPlan:
    transfer_id: str
    load_end: int  # tokens [0, load_end) come from the transfer
    error: str | None
    start: int = 0  # first token actually loaded (after a local prefix-cache hit)
    owns_transfer: bool = False  # delete the transfer when the request finishes


class TransferIdConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        store = cfg.get_from_extra_config("store_path", None)
        if not store:
            raise ValueError(
                "TransferIdConnector needs kv_connector_extra_config.store_path (a folder both "
                "engines of the node can read and write; tmpfs such as /dev/shm/... is best)"
            )
        self._store = Path(store)
        self._store.mkdir(parents=True, exist_ok=True)
        self._max_age_s = float(cfg.get_from_extra_config("max_age_s", 300))
        self._sweep_interval_s = float(cfg.get_from_extra_config("sweep_interval_s", 30))
        self._last_sweep = 0.0
        self._block_size = vllm_config.cache_config.block_size
        self._is_producer = bool(cfg.is_kv_producer)
        self._is_consumer = bool(cfg.is_kv_consumer)
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError("TransferIdConnector supports models with exactly one KV cache group")
        if vllm_config.model_config is not None and getattr(vllm_config.model_config, "use_mla", False):
            raise ValueError("TransferIdConnector does not support MLA attention")
        pc = vllm_config.parallel_config
        if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
            raise ValueError("TransferIdConnector supports tensor/pipeline parallel size 1 only")
        # Scheduler side.
        self._stores: dict[str, _StoreState] = {}
        self._plans: dict[str, _LoadPlan] = {}
        self._loads_to_schedule: set[str] = set()
        # Worker side.
        self._pending_saves: dict[tuple[str, int, int], dict[str, torch.Tensor]] = {}
        self._failed_blocks: set[int] = set()
        log.info("TransferIdConnector role=%s store=%s block_size=%d", role.name, self._store, self._block_size)

    # ------------------------------------------------------------------ scheduler side

    @staticmethod
    def _transfer_id(request: Request) -> str | None:
        params = request.kv_transfer_params
        if not params or tx.KEY_TRANSFER_ID not in params:
            return None
        return params[tx.KEY_TRANSFER_ID]

    def _plan(self, request: Request) -> _LoadPlan | None:
        """Decide (once per request) what a consumer request loads and whether it is valid."""
        plan = self._plans.get(request.request_id)
        if plan is not None:
            return plan
        transfer_id = self._transfer_id(request)
        if transfer_id is None:
            return None
        prompt = list(request.prompt_token_ids or [])
        params = request.kv_transfer_params or {}
        error: str | None = None
        load_end = max(len(prompt) - 1, 0)
        owns = False
        try:
            manifest = mf.read_manifest(self._store, str(transfer_id))
        except EpdError as exc:
            error = exc.message
        else:
            n = manifest.num_tokens
            mm_hashes = [f.identifier for f in (request.mm_features or [])]
            if params.get(tx.KEY_DIGEST) != manifest.digest:
                error = "digest in kv_transfer_params does not match the transfer"
            elif prompt[:n] != manifest.token_ids or len(prompt) < n:
                error = "prompt token ids differ from the prefilled prompt"
            elif mm_hashes != manifest.mm_hashes:
                error = (
                    "multimodal inputs differ from the prefilled ones "
                    f"(decode {[h[:12] for h in mm_hashes]}, prefill {[h[:12] for h in manifest.mm_hashes]})"
                )
            else:
                load_end = min(n, len(prompt) - 1)
                owns = True
        plan = _LoadPlan(transfer_id=str(transfer_id), load_end=load_end, error=error, owns_transfer=owns)
        self._plans[request.request_id] = plan
        if error:
            log.warning("KV transfer %s for request %s cannot be loaded: %s", transfer_id, request.request_id, error)
        return plan

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._is_consumer:
            return 0, False
        plan = self._plan(request)
        if plan is None:
            return 0, False
        return max(plan.load_end - num_computed_tokens, 0), False

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # We restore the request's own blocks, in every transfer group.
        return tuple(self._kv_cache_config.transfer_group_ids)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._is_consumer and num_external_tokens > 0:
            plan = self._plans[request.request_id]
            plan.start = plan.load_end - num_external_tokens
            self._loads_to_schedule.add(request.request_id)
        if self._is_producer:
            transfer_id = self._transfer_id(request)
            if transfer_id is not None and request.request_id not in self._stores:
                if not tx.is_transfer_id(transfer_id):
                    log.error("request %s: bad %s %r, not storing", request.request_id, tx.KEY_TRANSFER_ID, transfer_id)
                    return
                self._stores[request.request_id] = _StoreState(
                    transfer_id=transfer_id,
                    token_ids=list(request.prompt_token_ids or []),
                    mm_hashes=[f.identifier for f in (request.mm_features or [])],
                    mm_placeholders=[
                        (f.mm_position.offset, f.mm_position.length) for f in (request.mm_features or [])
                    ],
                )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TransferIdMetadata()
        assert self._kv_cache_manager is not None
        steps: list[tuple[str, int, bool]] = [
            (r.req_id, r.num_computed_tokens, False) for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        steps += [
            (req_id, cached.num_computed_tokens[i], req_id in cached.resumed_req_ids)
            for i, req_id in enumerate(cached.req_ids)
        ]
        for req_id, num_computed, resumed in steps:
            is_new = resumed or any(r.req_id == req_id for r in scheduler_output.scheduled_new_reqs)
            if req_id in self._loads_to_schedule:
                self._loads_to_schedule.discard(req_id)
                plan = self._plans[req_id]
                (block_ids,) = self._kv_cache_manager.get_block_ids(req_id)
                meta.ops.append(
                    _Op(req_id, plan.transfer_id, False, plan.start, plan.load_end, list(block_ids), plan.error)
                )
            state = self._stores.get(req_id)
            if state is None:
                continue
            end = min(num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0), len(state.token_ids))
            # A new or resumed request stores from token 0: a local prefix-cache hit
            # computes nothing for its first tokens, but their KV is in the blocks.
            start = 0 if is_new else num_computed
            if is_new:
                state.chunks = []
            if end > start:
                (block_ids,) = self._kv_cache_manager.get_block_ids(req_id)
                meta.ops.append(_Op(req_id, state.transfer_id, True, start, end, list(block_ids)))
                state.chunks.append((start, end))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._loads_to_schedule.discard(req_id)
        plan = self._plans.pop(req_id, None)
        if plan is not None and plan.owns_transfer and request.status != RequestStatus.FINISHED_ERROR:
            # Single use. A failed load keeps it (the caller's error names the cause; the
            # expiry sweep removes it).
            mf.remove_transfer(self._store, plan.transfer_id)
        state = self._stores.pop(req_id, None)
        if state is None:
            return False, None
        self._maybe_sweep()
        try:
            mf.check_chunks_cover(state.chunks, len(state.token_ids))
            manifest = mf.Manifest(
                transfer_id=state.transfer_id,
                token_ids=state.token_ids,
                mm_hashes=state.mm_hashes,
                chunks=state.chunks,
                layers=self._layers_of(state.transfer_id, state.chunks[0]),
                block_size=self._block_size,
                created=time.time(),
                mm_placeholders=state.mm_placeholders,
            )
            mf.write_manifest(self._store, manifest)
        except (ValueError, OSError, IndexError) as exc:
            log.warning("transfer %s not committed (request %s): %s", state.transfer_id, req_id, exc)
            mf.remove_transfer(self._store, state.transfer_id)
            return False, {tx.KEY_TRANSFER_ID: state.transfer_id, "epd_committed": False}
        return False, {
            tx.KEY_TRANSFER_ID: state.transfer_id,
            tx.KEY_DIGEST: manifest.digest,
            tx.KEY_NUM_TOKENS: manifest.num_tokens,
            "epd_committed": True,
        }

    def _layers_of(self, transfer_id: str, chunk: tuple[int, int]) -> list[str]:
        path = mf.transfer_dir(self._store, transfer_id) / mf.chunk_name(*chunk)
        with safetensors.safe_open(str(path), framework="pt") as f:
            return sorted(f.keys())

    def _maybe_sweep(self) -> None:
        now = time.time()
        if now - self._last_sweep < self._sweep_interval_s:
            return
        self._last_sweep = now
        removed = mf.sweep_expired(self._store, self._max_age_s, now)
        if removed:
            log.warning("removed %d expired KV transfers (never decoded)", len(removed))

    # ------------------------------------------------------------------ worker side

    def _ops(self) -> list[_Op]:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TransferIdMetadata)
        return meta.ops

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        loads = [op for op in self._ops() if not op.is_store]
        if not loads:
            return
        layers = {
            name: layer.kv_cache
            for name, layer in forward_context.no_compile_layers.items()
            if isinstance(getattr(layer, "kv_cache", None), torch.Tensor)
        }
        for op in loads:
            try:
                if op.error:
                    raise ValueError(op.error)
                self._load(op, layers)
            except Exception as exc:
                log.error("KV load of transfer %s (request %s) failed: %s", op.transfer_id, op.req_id, exc)
                self._failed_blocks |= _blocks_of(op.block_ids, self._block_size, op.start, op.end)

    def _load(self, op: _Op, layers: dict[str, torch.Tensor]) -> None:
        """Copy whole blocks: chunk files hold the pages of the blocks their tokens touch."""
        folder = mf.transfer_dir(self._store, op.transfer_id)
        manifest = mf.read_manifest(self._store, op.transfer_id)
        if set(manifest.layers) != set(layers):
            raise ValueError(f"transfer has layers {manifest.layers}, engine has {sorted(layers)}")
        if manifest.block_size != self._block_size:
            raise ValueError(f"transfer block size {manifest.block_size} != engine's {self._block_size}")
        want_first, want_last = _block_span(self._block_size, op.start, op.end)
        # Chunks in token order: a block split across two chunks is completed by the later.
        for c_start, c_end in manifest.chunks:
            c_first, c_last = _block_span(self._block_size, c_start, c_end)
            first, last = max(c_first, want_first), min(c_last, want_last)
            if first >= last:
                continue
            tensors = safetensors.torch.load_file(str(folder / mf.chunk_name(c_start, c_end)))
            dst_blocks = torch.tensor(op.block_ids[first:last], dtype=torch.long)
            for name, dst in layers.items():
                src = tensors[name]
                if src.shape[0] != c_last - c_first or src.shape[1:] != dst.shape[1:]:
                    raise ValueError(
                        f"layer {name}: chunk {c_start}-{c_end} holds pages {tuple(src.shape)}, "
                        f"expected {(c_last - c_first, *dst.shape[1:])}"
                    )
                pages = src[first - c_first : last - c_first].to(device=dst.device, dtype=dst.dtype)
                dst[dst_blocks.to(dst.device)] = pages

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        # Whole pages (block = dim 0 of every per-layer view): the order of tokens inside a
        # page is the attention backend's business (the CPU backend keeps K and V of a
        # block in separate halves of it), so we never index inside one.
        for op in self._ops():
            if not op.is_store:
                continue
            first, last = _block_span(self._block_size, op.start, op.end)
            blocks = torch.tensor(op.block_ids[first:last], dtype=torch.long, device=kv_layer.device)
            self._pending_saves.setdefault((op.transfer_id, op.start, op.end), {})[layer_name] = (
                kv_layer[blocks].detach().to("cpu").contiguous()
            )

    def wait_for_save(self) -> None:
        pending, self._pending_saves = self._pending_saves, {}
        for (transfer_id, start, end), tensors in pending.items():
            folder = mf.transfer_dir(self._store, transfer_id)
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / mf.chunk_name(start, end)
            tmp = folder / f".{path.name}.{os.getpid()}.tmp"
            safetensors.torch.save_file(tensors, str(tmp))
            os.replace(tmp, path)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

"""``epd`` on a ``pd`` server: images encoded by remote encoder servers over gRPC, with failover
(see docs/scale-out.md).

Who calls what: the ``epd`` model (``--role pd --remote-encoders SPEC``) wraps its BLS stages in
:class:`RemoteEncoderStages` (:func:`with_remote_encoders`). Those route images themselves
(``routes_images``): the pipeline looked each image up in the local store and sends only the
misses here, naming no encoder unless the request pins one (the pin names one of this server's
encoder models: only the local fallback uses it). :meth:`RemoteEncoders.run` runs on the ``epd``
event loop: each ``refresh_s`` it refreshes the membership (``scaleout/membership.py``) and
exports the counters (``scaleout/stats.py``).

Per image: the router (``scaleout/routing.py``) picks the key's home by the one rule of
:func:`python_backends.scaleout.routing.home` (or a less loaded encoder); then

- an encoder on **this node with this store** (same ``node_id`` and store path in its
  ``encoder_0`` config): its ``encoder_0`` claims the key in the shared store, encodes if needed
  and answers a reference leased for this process: zero-copy, as on one server;
- an encoder on **another node**: the key is claimed in this node's store (single-flight across
  its processes), the encoder's ``encoder_0`` answers the embedding by value (``by_value``: it
  is encoded once on that node and kept in that node's store) with its ``mm_hash`` and digest;
  it is checked (dtype, rank, token count against the grid, finite, the key, the digest) and
  written here; later requests on this node are local hits, so it crosses the network once per
  (image, node).

A call that fails (server gone, deadline, bad answer) counts against the encoder's breaker and
is retried on another encoder within the request's deadline; with none left the request gets
one UNAVAILABLE error, or, on a server with its own encoder models and ``remote_local_fallback``,
is encoded there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np

from python_backends import contract
from python_backends.encode.cached import CachedEncoder, EncodedImage
from python_backends.encode.digest import embedding_digest
from python_backends.engines.generation import GenerationChunk
from python_backends.errors import EpdError, ErrorCode
from python_backends.request.tenants import tenant_parameter
from python_backends.runtime.grpc_streams import StreamEnds
from python_backends.scaleout import wire
from python_backends.scaleout.endpoints import EndpointSource
from python_backends.scaleout.membership import EncoderServer, Membership
from python_backends.scaleout.routing import NoEncoderAvailable, Router, home
from python_backends.scaleout.stats import MetricExport, ScaleoutStats
from python_backends.store import EmbeddingStore, KeyConfig

log = logging.getLogger(__name__)

# This server's own encode of an image, given the image's routing key (the local fallback).
LocalEncode = Callable[[str], Awaitable[tuple[bytes, bool]]]


class _ClientFault(Exception):
    """The encoder refused the image itself (bad media): the request fails, the encoder is fine."""


@dataclass(frozen=True)
class _Fetch:
    """The by-value call in progress in this task: which server, its request parameters, how long."""

    server: EncoderServer
    parameters: Mapping[str, Any]
    timeout_s: float


_FETCH: ContextVar[_Fetch] = ContextVar("remote_encoder_fetch")


def checked_embedding(embeds: Any, grid: Any, merge_size: int) -> EncodedImage:
    """An embedding that came over the network, verified before it enters the store."""
    embeds, grid = np.asarray(embeds), np.asarray(grid)
    if embeds.dtype != np.float32 or embeds.ndim != 3 or embeds.shape[0] != 1:
        raise ValueError(f"image_embeds must be float32 [1, tokens, hidden], got {embeds.dtype} {embeds.shape}")
    if grid.shape != (1, 3) or not np.issubdtype(grid.dtype, np.integer) or (grid <= 0).any():
        raise ValueError(f"image_grid_thw must be 3 positive integers, got {grid.dtype} {grid.shape}")
    t, h, w = (int(v) for v in grid[0])
    tokens = t * h * w // (merge_size * merge_size)
    if embeds.shape[1] != tokens or embeds.shape[2] == 0:
        raise ValueError(f"{embeds.shape[1]} embedding rows for grid {(t, h, w)}, which needs {tokens}")
    if not np.isfinite(embeds).all():
        raise ValueError("image_embeds holds NaN or infinity")
    return EncodedImage(np.ascontiguousarray(embeds[0]), (t, h, w))


def verify_answer(result: Any, encoded: EncodedImage, key: str) -> None:
    """An encoder's by-value answer is for this image (its ``mm_hash`` is our key) and arrived
    as it left (its digest, recomputed here over the checked embedding); ValueError if not."""
    theirs = result.as_numpy(contract.MM_HASH)
    if theirs is None or str(theirs.reshape(-1)[0], "utf-8") != key:
        raise ValueError("the answer is for another key than this image's")
    sent = result.as_numpy(contract.EMBEDDING_DIGEST)
    if sent is None:
        raise ValueError("the answer carries no embedding digest")
    if encoded.grid_thw is None:  # by value is for images (an image's answer has its grid)
        raise ValueError("the answer carries no image grid")
    if str(sent.reshape(-1)[0], "utf-8") != embedding_digest(encoded.embeds, encoded.grid_thw):
        raise ValueError("the embedding's digest does not match what arrived")


async def _call(
    server: EncoderServer, inputs: list[Any], parameters: Mapping[str, Any], timeout_s: float, ends: StreamEnds
) -> Any:
    """One request to ``server``'s encoder model; a refusal of the image is a :class:`_ClientFault`."""
    try:
        return await wire.stream_one(server.client, wire.ENCODER_MODEL, inputs, parameters, timeout_s, ends)
    except Exception as exc:
        if wire.status(exc) in wire.CLIENT_FAULTS:
            raise _ClientFault(str(exc)) from None
        raise


class RemoteEncoders:
    """Encodes images on the remote encoder servers, with failover; owns the router, the
    membership that feeds it and the counters (exported by :meth:`export`)."""

    def __init__(
        self,
        source: EndpointSource,
        store: EmbeddingStore,
        keys: KeyConfig,
        *,
        node_id: str,
        store_path: str,
        merge_size: int,
        deadline_s: float = 20.0,
        refresh_s: float = 2.0,
        refused_retry_s: float = 30.0,
        tenant_policy: str = "isolated",
        router: Router | None = None,
        connect: Callable[[str], Any] = wire.connect,
    ) -> None:
        self.store, self.keys, self.merge_size, self.deadline_s = store, keys, merge_size, deadline_s
        self.router = router or Router()
        self.stats = ScaleoutStats()
        self.stream_ends = StreamEnds()  # encoder streams still ending (abandoned ones drain)
        self.membership = Membership(
            source, keys, self.router, self.stats, node_id=node_id, store_path=store_path,
            refresh_s=refresh_s, refused_retry_s=refused_retry_s, connect=connect, ends=self.stream_ends,
        )  # fmt: skip
        self.metrics = MetricExport(self.stats, self.router)
        # Built once: the cross-node path's single-flight claim in this node's store. Its encode
        # fetches by value from the server of the call in progress (``_FETCH``, set per call).
        self.cross_node = CachedEncoder(store, keys, self._fetch_by_value, tenant_policy=tenant_policy)

    async def refresh(self) -> None:
        await self.membership.refresh()

    def describe(self) -> str:
        return self.membership.describe()

    async def close(self) -> None:
        """Let streams still ending reach their close (``wire``'s rule), then close the clients:
        closing a channel cancels what is open on it."""
        await self.stream_ends.wait(10.0)
        await self.membership.close()

    def export(self, metrics: Any) -> None:
        """The counters as Triton metrics (``metrics``: a ``ModelMetrics``)."""
        self.metrics.export(metrics)

    async def run(self, metrics: Any = None) -> None:
        """Refresh forever (and export metrics when given a ``ModelMetrics``)."""
        while True:
            try:
                await self.refresh()
                if metrics is not None:
                    self.export(metrics)
            except Exception:
                log.exception("encoder refresh failed")
            await asyncio.sleep(self.membership.refresh_s)

    async def encode_reference(
        self, image: bytes, lease_owner: int, tenant: str | None = None, fallback: LocalEncode | None = None
    ) -> tuple[bytes, bool]:
        """The image's reference in this node's store (leased for ``lease_owner``) and whether
        it was stored already; retried on other encoders until the deadline. The routing key is
        the tenant-free content key: an image's home does not depend on the tenant.
        ``fallback``: this server's own encode (given that key), used when no remote encoder is
        left."""
        key = self.keys.key(image)
        deadline = time.monotonic() + self.deadline_s
        tried: list[str] = []
        errors: list[str] = []
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                route = self.router.choose(key, exclude=tried)
            except NoEncoderAvailable:
                detail = "; ".join(errors) or self.describe()
                if fallback is not None:
                    self.stats.local_fallbacks += 1
                    log.warning("no remote encoder left (%s): encoding on this server", detail)
                    return await fallback(key)
                raise EpdError(f"no encoder server could encode the image ({detail})", ErrorCode.UNAVAILABLE) from None
            server, stats = self.membership.servers[route.address], self.stats.of(route.address)
            stats.requests += 1
            stats.retries += bool(tried)
            started = time.monotonic()
            try:
                with self.router.calling(server.address):
                    answer = await self._encode_on(server, image, lease_owner, tenant, remaining)
            except _ClientFault as exc:
                self.router.succeeded(server.address)  # it answered: the image is at fault
                raise EpdError(str(exc), ErrorCode.INVALID_ARG) from None
            except Exception as exc:
                stats.failures += 1
                self.router.failed(server.address)
                tried.append(server.address)
                errors.append(f"{server.address}: {wire.status(exc) or type(exc).__name__}")
                log.warning("encoder %s failed (%s); trying another", server.address, exc)
                continue
            self.router.succeeded(server.address)
            stats.latency_s += time.monotonic() - started
            return answer
        raise EpdError(f"no encoder answered within {self.deadline_s:g} s ({'; '.join(errors)})", ErrorCode.UNAVAILABLE)

    async def _encode_on(
        self, server: EncoderServer, image: bytes, lease_owner: int, tenant: str | None, timeout_s: float
    ) -> tuple[bytes, bool]:
        # Re-signed: with a tenant secret the encoder server checks the token as epd did.
        parameters = {} if tenant is None else {contract.TENANT: tenant_parameter(tenant)}
        if server.shares_store:  # it writes this store and answers a reference leased for us
            inputs = [wire.image_input(image), wire.lease_input(lease_owner), wire.errors_as_outputs()]
            result = await _call(server, inputs, parameters, timeout_s, self.stream_ends)
            reference = bytes(result.as_numpy(contract.REFERENCES).reshape(-1)[0])
            return reference, bool(result.as_numpy(contract.CACHE_HIT).reshape(-1)[0])
        token = _FETCH.set(_Fetch(server, parameters, timeout_s))
        try:
            answer = await self.cross_node.reference(image, lease_owner, tenant)
        finally:
            _FETCH.reset(token)
        self.stats.local_hits += answer.cache_hit  # stored here meanwhile: nothing fetched
        return answer.reference.to_bytes(), answer.cache_hit

    async def _fetch_by_value(self, image: bytes) -> EncodedImage:
        """The cross-node encode: the embedding by value from the server of this call, checked."""
        fetch = _FETCH.get()
        inputs = [wire.image_input(image), wire.errors_as_outputs()]
        parameters = {**fetch.parameters, contract.BY_VALUE: True}
        result = await _call(fetch.server, inputs, parameters, fetch.timeout_s, self.stream_ends)
        embeds, grid = result.as_numpy(contract.IMAGE_EMBEDS), result.as_numpy(contract.IMAGE_GRID_THW)
        if embeds is None or grid is None:
            raise ValueError(f"{fetch.server.address} answered no embedding by value")
        self.stats.cross_node_bytes += int(embeds.nbytes + grid.nbytes)
        encoded = checked_embedding(embeds, grid, self.merge_size)
        verify_answer(result, encoded, self.keys.key(image))
        return encoded


class RemoteEncoderStages:
    """The epd stages with images encoded by remote encoders; prefill, decode and videos stay
    the local BLS calls.

    One-directional: these stages route images themselves (``routes_images``), so the pipeline
    picks no encoder for an image: ``encoder`` is the request's pin or None, and the router picks
    the remote server. With ``local_fallback`` (this server's own encoder model names; empty: no
    fallback) an image that no remote encoder can take is encoded here, on the pinned model, else
    on the image's home among them by the same rule (``scaleout/routing.home``). Videos are not
    routed here: the pipeline picks their encoder model, as on a server without remote encoders.
    """

    routes_images = True

    def __init__(self, local: Any, remote: RemoteEncoders, local_fallback: Sequence[str] = ()) -> None:
        self.local, self.remote, self.local_fallback = local, remote, list(local_fallback)

    async def encode_reference(
        self, encoder: str | None, image: bytes, lease_owner: int, tenant: str | None = None, modality: str = "image"
    ) -> tuple[bytes, bool]:
        if modality != "image":  # remote encoders take images (by value): videos are encoded here
            return await self.local.encode_reference(encoder, image, lease_owner, tenant, modality)  # type: ignore[no-any-return]

        async def here(key: str) -> tuple[bytes, bool]:
            model = encoder or home(self.local_fallback, key)
            return await self.local.encode_reference(model, image, lease_owner, tenant)  # type: ignore[no-any-return]

        return await self.remote.encode_reference(image, lease_owner, tenant, here if self.local_fallback else None)

    async def prefill(self, prompt: str, references: Sequence[bytes], sampling: Mapping[str, Any]) -> GenerationChunk:
        return await self.local.prefill(prompt, references, sampling)  # type: ignore[no-any-return]

    def decode(self, request_id: str, references: Sequence[bytes], transfer_params: str,
               sampling: Mapping[str, Any], stream: bool) -> AsyncIterator[GenerationChunk]:
        return self.local.decode(request_id, references, transfer_params, sampling, stream)  # type: ignore[no-any-return]

    async def abort_decode(self, request_id: str) -> None:
        await self.local.abort_decode(request_id)

    async def discard_transfer(self, transfer_params: str) -> None:
        await self.local.discard_transfer(transfer_params)


def with_remote_encoders(
    params: Any, store: EmbeddingStore, keys: KeyConfig, local: Any
) -> tuple[Any, RemoteEncoders | None]:
    """epd's stages for its config: ``local`` as it is when ``remote_encoders`` is ``local``,
    else wrapped so that images go to the remote encoders (``params``: ``ModelParameters``)."""
    from python_backends.scaleout.endpoints import endpoint_source

    spec = params.string(contract.REMOTE_ENCODERS_KEY)
    if spec == contract.LOCAL_ENCODERS:
        return local, None
    policy = params.cache_policy()
    remote = RemoteEncoders(
        endpoint_source(spec), store, keys,
        node_id=policy.node_id, store_path=policy.path, merge_size=params.integer(contract.SPATIAL_MERGE_SIZE),
        deadline_s=params.number(contract.REMOTE_ENCODE_DEADLINE_S), tenant_policy=policy.tenants,
    )  # fmt: skip
    own_encoders = params.string(contract.ENCODER_MODELS_KEY).split(",")  # this server's encoder models
    fallback = own_encoders if params.boolean(contract.REMOTE_LOCAL_FALLBACK) else []
    return RemoteEncoderStages(local, remote, fallback), remote

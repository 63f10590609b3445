"""``epd`` on a ``pd`` server: images encoded by remote encoder servers over gRPC.

Who calls what: the ``epd`` model (``--role pd --remote-encoders SPEC``) wraps its BLS stages in
:class:`RemoteEncoderStages`, whose ``encode_reference`` is :meth:`RemoteEncoders.encode_reference`;
the pipeline is unchanged (it already looked the image up in the local store: only misses come
here). :meth:`RemoteEncoders.run` runs on the ``epd`` event loop: it re-reads the endpoint source,
admits new encoders and polls readiness every ``refresh_s``.

Per image: the router (``routing.py``) picks the key's home (or a less loaded encoder); then

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
one UNAVAILABLE error. At admission an encoder must answer the local content key for a probe
image: one with another checkpoint or preprocessing config is refused (log line + metric).
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from python_backends import contract
from python_backends.encode.cached import CachedEncoder, EncodedImage
from python_backends.engines.generation import GenerationChunk
from python_backends.errors import EpdError, ErrorCode
from python_backends.scaleout.digest import embedding_digest
from python_backends.scaleout.endpoints import EndpointSource
from python_backends.scaleout.routing import NoEncoderAvailable, Router
from python_backends.store import EmbeddingStore, KeyConfig

log = logging.getLogger(__name__)

ENCODER_MODEL = contract.encoder_model_names(1)[0]
# Status codes that say the image (not the encoder) is at fault: no retry elsewhere.
CLIENT_FAULTS = ("INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED")


def probe_image(size: int = 56) -> bytes:
    """A small grey PNG (made here, no imaging library): every encoder must key it as we do."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + bytes([(x * 4 + y * 2) % 256 for x in range(size)]) for y in range(size))
    header = struct.pack(">IIBBBBB", size, size, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


PROBE_IMAGE = probe_image()


class EncoderRefused(Exception):
    """An encoder server that must not be used (wrong role, checkpoint or preprocessing)."""


class _ClientFault(Exception):
    """The encoder refused the image itself (bad media): the request fails, the encoder is fine."""


@dataclass
class EndpointStats:
    requests: int = 0
    failures: int = 0
    retries: int = 0
    latency_s: float = 0.0


@dataclass
class ScaleoutStats:
    """Totals since start (exported as counters by :meth:`RemoteEncoders.export`)."""

    endpoints: dict[str, EndpointStats] = field(default_factory=dict)
    local_hits: int = 0  # cross-node path: another request of this node had stored it meanwhile
    local_fallbacks: int = 0  # encoded on this server's own encoder models: no remote encoder left
    cross_node_bytes: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    lookup_failures: int = 0  # source lookups that found no encoder (a DNS name resolving to nothing, ...)
    addresses_found: int = 0  # addresses the last lookup gave

    def of(self, address: str) -> EndpointStats:
        return self.endpoints.setdefault(address, EndpointStats())


@dataclass
class EncoderServer:
    address: str
    client: Any  # tritonclient.grpc.aio.InferenceServerClient
    shares_store: bool


# gRPC's reconnect back-off grows to 120 s by default: an encoder restarted after a minute down
# would wait that long to be seen. Capped near the readiness poll, it rejoins within seconds.
RECONNECT_BACKOFF_MS = (500, 2000)  # initial, max


def _connect(address: str) -> Any:
    from tritonclient.grpc import aio as grpc_aio  # imported on the serving side only
    from tritonclient.grpc._client import MAX_GRPC_MESSAGE_SIZE, KeepAliveOptions

    keepalive = KeepAliveOptions()
    options = [  # tritonclient's defaults, plus the reconnect back-off
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
        ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
    ]
    return grpc_aio.InferenceServerClient(address, channel_args=options)


def _status(exc: BaseException) -> str:
    """The gRPC status name of a failed call ("" when it carries none)."""
    if isinstance(exc, EpdError):
        names = {ErrorCode.INVALID_ARG: "INVALID_ARGUMENT", ErrorCode.NOT_FOUND: "NOT_FOUND"}
        return names.get(exc.code, exc.code.value)
    code = getattr(exc, "code", None)  # grpc.aio.AioRpcError from a stream
    if callable(code):
        return str(getattr(code(), "name", ""))
    status = getattr(exc, "status", None)  # tritonclient's InferenceServerException
    value = status() if callable(status) else None
    return "" if value is None else str(value).removeprefix("StatusCode.")


async def _stream_one(client: Any, model: str, inputs: list[Any], parameters: Mapping[str, Any] | None,
                      timeout_s: float) -> Any:
    """One request to a decoupled model over a gRPC stream: its first response. The stream is
    read to its end (the server closes it after the request's final response): cancelling a
    finished request's stream left the encoder model unable to unload at stop."""

    async def requests() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": model, "inputs": inputs, "parameters": dict(parameters or {})}

    responses = client.stream_infer(requests(), stream_timeout=timeout_s)
    answer = None
    try:
        async for result, error in responses:
            if error is not None:
                raise error
            if result is not None and (errors := result.as_numpy(contract.ERROR)) is not None:
                fields = json.loads(bytes(errors.reshape(-1)[0]))  # errors_as_outputs: the code survives
                raise EpdError(f"{model}: {fields['message']}", ErrorCode(fields["code"]))
            if answer is None and result is not None and result.get_response().outputs:
                answer = result
    except BaseException:
        responses.cancel()  # a failed or abandoned call: the server stops working on it
        raise
    if answer is None:
        raise ConnectionError(f"{model}: the stream ended without an answer")
    return answer


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
    if str(sent.reshape(-1)[0], "utf-8") != embedding_digest(encoded.embeds, encoded.grid_thw):
        raise ValueError("the embedding's digest does not match what arrived")


class RemoteEncoders:
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
        connect: Callable[[str], Any] = _connect,
    ) -> None:
        self.source, self.store, self.keys = source, store, keys
        self.node_id, self.store_path, self.merge_size = node_id, store_path, merge_size
        self.deadline_s, self.refresh_s, self.tenant_policy = deadline_s, refresh_s, tenant_policy
        self.router = router or Router()
        self.connect = connect
        self.servers: dict[str, EncoderServer] = {}
        self.unreachable: dict[str, str] = {}  # address -> why it is not admitted yet (tried each refresh)
        self.refused_until: dict[str, float] = {}  # a refused address is checked again after refused_retry_s
        self.refused_retry_s = refused_retry_s
        self.stats = ScaleoutStats()
        self._exported: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    # -- membership ----------------------------------------------------------------------------

    async def admit(self, address: str) -> EncoderServer | None:
        """A checked server, or None while it is not ready; raises :class:`EncoderRefused`."""
        client = self.connect(address)
        try:
            if not await client.is_server_ready(client_timeout=2.0):
                await client.close()
                self.unreachable[address] = "not ready"
                return None
            config = await client.get_model_config(ENCODER_MODEL, as_json=True, client_timeout=5.0)
        except Exception as exc:
            await client.close()
            if _status(exc) == "NOT_FOUND" or "unknown model" in str(exc):
                raise EncoderRefused(f"serves no {ENCODER_MODEL}: not an encoder-role server ({exc})") from None
            # Not reachable now (refused, no such host, timed out): tried again at the next refresh.
            self.unreachable[address] = f"not reachable ({' '.join(str(exc).split())[:200]})"
            return None
        parameters = {k: v.get("string_value", "") for k, v in config["config"].get("parameters", {}).items()}
        try:
            answer = await _stream_one(client, ENCODER_MODEL, [_image_input_bytes(PROBE_IMAGE)], None, 60.0)
        except Exception as exc:
            await client.close()
            raise EncoderRefused(f"could not encode the probe image: {exc}") from None
        theirs, ours = str(answer.as_numpy(contract.MM_HASH).reshape(-1)[0], "utf-8"), self.keys.key(PROBE_IMAGE)
        if theirs != ours:
            await client.close()
            raise EncoderRefused(
                f"keys the probe image as {theirs[:16]}..., this server as {ours[:16]}...: it serves another "
                "checkpoint, encoder build or preprocessing config"
            )
        same_node = parameters.get(contract.NODE_ID) == self.node_id
        shares = same_node and parameters.get(contract.STORE_PATH) == self.store_path
        return EncoderServer(address, client, shares)

    async def refresh(self) -> None:
        """One round: re-read the source, admit newcomers, drop leavers, poll readiness."""
        addresses = await self.source.current()
        self.stats.addresses_found = len(addresses)
        self.stats.lookup_failures += bool(self.source.problem)
        for address in [a for a in self.servers if a not in addresses]:
            await self.servers.pop(address).client.close()
        for address in [a for a in self.unreachable if a not in addresses]:
            del self.unreachable[address]
        for address in [a for a in self.refused_until if a not in addresses]:
            del self.refused_until[address]
        for address in addresses:
            server = self.servers.get(address)
            if server is not None:
                try:
                    ready = bool(await server.client.is_server_ready(client_timeout=2.0))
                except Exception as exc:
                    ready = False
                    if _status(exc) == "UNAVAILABLE":  # nothing listens there: counts like a failed call
                        self.router.failed(address)
                self.router.set_ready(address, ready)
                continue
            if time.monotonic() < self.refused_until.get(address, 0.0):
                continue  # refused a moment ago: not probed (nor logged) every round
            was = self.unreachable.pop(address, None)
            try:
                admitted = await self.admit(address)
            except EncoderRefused as exc:
                self.stats.refused[address] = self.stats.refused.get(address, 0) + 1
                self.refused_until[address] = time.monotonic() + self.refused_retry_s
                log.error("encoder %s refused: %s (checked again in %g s)", address, exc, self.refused_retry_s)
                continue
            if admitted is None:
                if self.unreachable.get(address) != was:  # logged when the reason changes, not every round
                    log.warning("encoder %s %s; tried again every %g s", address, self.unreachable[address],
                                self.refresh_s)  # fmt: skip
                continue
            self.servers[address] = admitted
            where = "this node's store (by reference)" if admitted.shares_store else "another node (by value)"
            log.info("encoder %s admitted: %s", address, where)
        self.router.set_endpoints([a for a in addresses if a in self.servers])

    async def run(self, metrics: Any = None) -> None:
        """Refresh forever (and export metrics when given a ``ModelMetrics``)."""
        while True:
            try:
                await self.refresh()
                if metrics is not None:
                    self.export(metrics)
            except Exception:
                log.exception("encoder refresh failed")
            await asyncio.sleep(self.refresh_s)

    def describe(self) -> str:
        """Every encoder's state for an error message: admitted ones (ready, breaker), addresses
        not admitted yet and why, and why the endpoint source found none."""
        parts = [self.router.describe()] if self.router.encoders else []
        parts += [f"{address}: {why}" for address, why in self.unreachable.items()]
        parts += [f"{address}: refused (another key config or not an encoder)" for address in self.refused_until]
        if self.source.problem:
            parts.append(self.source.problem)
        return "; ".join(parts) or self.router.describe()

    async def close(self) -> None:
        for server in self.servers.values():
            await server.client.close()
        self.servers.clear()

    # -- encoding ------------------------------------------------------------------------------

    async def encode_reference(
        self, image: bytes, lease_owner: int, tenant: str | None = None, fallback: LocalEncode | None = None
    ) -> tuple[bytes, bool]:
        """The image's reference in this node's store (leased for ``lease_owner``) and whether
        it was stored already; retried on other encoders until the deadline. ``fallback``: this
        server's own encode (an ``all`` server), used when no remote encoder is left."""
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
                    return await fallback()
                raise EpdError(f"no encoder server could encode the image ({detail})", ErrorCode.UNAVAILABLE) from None
            server, stats = self.servers[route.address], self.stats.of(route.address)
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
                errors.append(f"{server.address}: {_status(exc) or type(exc).__name__}")
                log.warning("encoder %s failed (%s); trying another", server.address, exc)
                continue
            self.router.succeeded(server.address)
            stats.latency_s += time.monotonic() - started
            return answer
        raise EpdError(f"no encoder answered within {self.deadline_s:g} s ({'; '.join(errors)})", ErrorCode.UNAVAILABLE)

    async def _encode_on(
        self, server: EncoderServer, image: bytes, lease_owner: int, tenant: str | None, timeout_s: float
    ) -> tuple[bytes, bool]:
        parameters = None if tenant is None else {contract.TENANT: tenant}
        if server.shares_store:
            inputs = [_image_input_bytes(image), _lease_input(lease_owner), _errors_as_outputs()]
            try:
                result = await _stream_one(server.client, ENCODER_MODEL, inputs, parameters, timeout_s)
            except Exception as exc:
                if _status(exc) in CLIENT_FAULTS:
                    raise _ClientFault(str(exc)) from None
                raise
            wire = bytes(result.as_numpy(contract.REFERENCES).reshape(-1)[0])
            return wire, bool(result.as_numpy(contract.CACHE_HIT).reshape(-1)[0])

        fetched = False

        async def by_value(image: bytes) -> EncodedImage:
            nonlocal fetched
            inputs = [_image_input_bytes(image), _errors_as_outputs()]
            try:
                result = await _stream_one(
                    server.client, ENCODER_MODEL, inputs, {**(parameters or {}), contract.BY_VALUE: True}, timeout_s
                )
            except Exception as exc:
                if _status(exc) in CLIENT_FAULTS:
                    raise _ClientFault(str(exc)) from None
                raise
            embeds, grid = result.as_numpy(contract.IMAGE_EMBEDS), result.as_numpy(contract.IMAGE_GRID_THW)
            if embeds is None or grid is None:
                raise ValueError(f"{server.address} answered no embedding by value")
            self.stats.cross_node_bytes += int(embeds.nbytes + grid.nbytes)
            fetched = True
            encoded = checked_embedding(embeds, grid, self.merge_size)
            verify_answer(result, encoded, self.keys.key(image))
            return encoded

        local = CachedEncoder(self.store, self.keys, by_value, tenant_policy=self.tenant_policy)
        answer = await local.reference(image, lease_owner, tenant)
        self.stats.local_hits += int(not fetched)
        return answer.reference.to_bytes(), answer.cache_hit

    # -- metrics -------------------------------------------------------------------------------

    def export(self, metrics: Any) -> None:
        """Totals as Triton metrics (``ModelMetrics``: counters get the increase since last time)."""
        totals: list[tuple[str, str, str, dict[str, str], float]] = []  # kind, name, help, labels, total
        for address in self.router.encoders:  # every admitted encoder's counters, from 0 on
            self.stats.of(address)
        for address, s in self.stats.endpoints.items():
            for name, calls in (("requests", s.requests), ("failures", s.failures), ("retries", s.retries)):
                totals.append(("counter", f"epd_remote_encoder_{name}", f"Remote encode calls: {name}",
                               {"endpoint": address}, calls))
            totals.append(("counter", "epd_remote_encoder_latency_seconds", "Seconds in successful remote encodes",
                           {"endpoint": address}, s.latency_s))
        decisions = {
            **self.router.decisions, "local_hit": self.stats.local_hits, "local_fallback": self.stats.local_fallbacks
        }
        for decision, count in decisions.items():
            totals.append(("counter", "epd_routing_decisions", "Where remote-encoder routing sent an image",
                           {"decision": decision}, count))
        totals.append(("counter", "epd_cross_node_bytes", "Embedding bytes fetched from other nodes", {},
                       self.stats.cross_node_bytes))
        for address, state in self.router.encoders.items():
            totals.append(("counter", "epd_remote_encoder_breaker_opens", "Times an encoder's circuit breaker opened",
                           {"endpoint": address}, state.breaker.opens))
        totals.append(("counter", "epd_remote_encoder_lookup_failures",
                       "Encoder lookups (DNS name, file) that found no encoder", {}, self.stats.lookup_failures))
        for address, refusals in self.stats.refused.items():
            totals.append(("counter", "epd_remote_encoder_refused", "Encoder servers refused at admission",
                           {"endpoint": address}, refusals))
        for kind, name, description, labels, value in totals:  # each exported from 0 on
            key = (name, tuple(sorted(labels.items())))
            last = self._exported.get(key, 0.0)
            handle = getattr(metrics, kind)(name, description, **labels)
            if value > last:
                handle.increment(value - last)
                self._exported[key] = value
        metrics.gauge("epd_remote_encoder_endpoints", "Encoder addresses the last lookup gave").set(
            float(self.stats.addresses_found)
        )
        for address, state in self.router.encoders.items():
            metrics.gauge("epd_remote_encoder_breaker_state", "0 closed, 1 open, 2 half-open",
                          endpoint=address).set(float(state.breaker.state))


def _image_input_bytes(image: bytes) -> Any:
    from tritonclient.grpc import InferInput

    data = np.array([image], dtype=np.object_)
    tensor = InferInput(contract.IMAGE, [1], "BYTES")
    tensor.set_data_from_numpy(data)
    return tensor


def _errors_as_outputs() -> Any:
    from tritonclient.grpc import InferInput

    tensor = InferInput(contract.ERRORS_AS_OUTPUTS, [1], "BOOL")
    tensor.set_data_from_numpy(np.array([True]))
    return tensor


def _lease_input(owner: int) -> Any:
    from tritonclient.grpc import InferInput

    tensor = InferInput(contract.LEASE_OWNER, [1], "INT64")
    tensor.set_data_from_numpy(np.array([owner], dtype=np.int64))
    return tensor


LocalEncode = Callable[[], Awaitable[tuple[bytes, bool]]]


class RemoteEncoderStages:
    """The epd stages with the encode step sent to remote encoders (routing picks the server);
    prefill and decode stay the local BLS calls. With ``local_fallback`` (a server that serves
    its own encoder models) an image that no remote encoder can take goes to the ``encoder``
    the pipeline named, on this server."""

    def __init__(self, local: Any, remote: RemoteEncoders, local_fallback: bool = False) -> None:
        self.local, self.remote, self.local_fallback = local, remote, local_fallback

    async def encode_reference(
        self, encoder: str, image: bytes, lease_owner: int, tenant: str | None = None, modality: str = "image"
    ) -> tuple[bytes, bool]:
        if modality != "image":  # remote encoders take images (by value): videos are encoded here
            return await self.local.encode_reference(encoder, image, lease_owner, tenant, modality)  # type: ignore[no-any-return]

        async def here() -> tuple[bytes, bool]:
            return await self.local.encode_reference(encoder, image, lease_owner, tenant)  # type: ignore[no-any-return]

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
    else wrapped so that encodes go to the remote encoders (``params``: ``ModelParameters``)."""
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
    return RemoteEncoderStages(local, remote, params.boolean(contract.REMOTE_LOCAL_FALLBACK)), remote

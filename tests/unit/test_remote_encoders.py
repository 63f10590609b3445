"""Remote encoders for a ``pd`` server (docs/scale-out.md): endpoint sources, admission
(probe key check), the cross-node fetch into the local store (once per image), the shared-store
path by reference, failover and the breaker, and bad topology input -- against scripted gRPC
clients and a real embedding store; unreachable addresses and DNS names with the real ones.
The same paths against real servers: tests/server/test_scaleout.py."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from python_backends import contract
from python_backends.encode.cached import CachedEncoder, EncodedImage
from python_backends.encode.digest import embedding_digest
from python_backends.errors import EpdError, ErrorCode
from python_backends.runtime.grpc_streams import StreamEnds
from python_backends.scaleout.endpoints import (
    DnsEndpoints,
    EndpointSpecError,
    FileEndpoints,
    StaticEndpoints,
    endpoint_source,
)
from python_backends.scaleout.membership import PROBE_IMAGE
from python_backends.scaleout.remote import RemoteEncoders, checked_embedding
from python_backends.scaleout.routing import BreakerState, home
from python_backends.store import EmbeddingStore, KeyConfig, StoreConfig

KEYS = KeyConfig({"merge_size": 2, "min_pixels": 3136}, "encoder-v1")
OTHER_KEYS = KeyConfig({"merge_size": 2, "min_pixels": 1000}, "encoder-v1")
HIDDEN = 8


class RpcError(Exception):
    def __init__(self, status: str) -> None:
        super().__init__(f"[{status}] scripted")
        self._status = status

    def status(self) -> str:
        return f"StatusCode.{self._status}"


class Result:
    def __init__(self, outputs: dict[str, np.ndarray]) -> None:
        self.outputs = outputs

    def as_numpy(self, name: str) -> np.ndarray | None:
        return self.outputs.get(name)

    def get_response(self) -> Any:
        return type("Response", (), {"outputs": list(self.outputs)})()


def embedding_of(image: bytes) -> tuple[np.ndarray, np.ndarray]:
    """What an encoder answers for ``image``: a 4x4 patch grid (4 tokens), values from its bytes."""
    seed = sum(image) % 1000
    return np.full((1, 4, HIDDEN), seed, np.float32), np.array([[1, 4, 4]], np.int64)


class FakeEncoderServer:
    """One encoder server as the tritonclient asyncio client sees it."""

    def __init__(
        self, keys: KeyConfig = KEYS, params: dict[str, str] | None = None, shared: EmbeddingStore | None = None
    ) -> None:
        self.keys, self.params, self.shared = keys, params or {}, shared
        self.ready, self.fail_with, self.model_missing, self.error_output = True, "", False, ""
        self.encode_calls: list[bytes] = []
        self.answer = embedding_of
        self.sent = lambda embeds: embeds  # what the network delivers of the embedding

    def client(self, address: str) -> FakeClient:
        return FakeClient(self)


class FakeClient:
    def __init__(self, server: FakeEncoderServer) -> None:
        self.server = server

    async def is_server_ready(self, client_timeout: float) -> bool:
        if self.server.fail_with:
            raise RpcError(self.server.fail_with)
        return self.server.ready

    async def get_model_config(self, model: str, as_json: bool, client_timeout: float) -> dict[str, Any]:
        if self.server.model_missing:
            raise RpcError("NOT_FOUND")
        return {"config": {"parameters": {k: {"string_value": v} for k, v in self.server.params.items()}}}

    def stream_infer(self, requests: Any, stream_timeout: float | None = None) -> Any:
        server = self.server

        class Responses:
            def cancel(self) -> None:
                pass

            async def __aiter__(self):
                async for request in requests:
                    if server.fail_with:
                        raise RpcError(server.fail_with)
                    if server.error_output:  # as the encoder model answers with errors_as_outputs
                        yield Result({contract.ERROR: np.array([server.error_output.encode()], np.object_)}), None
                        return
                    image = request["inputs"][0]._raw_image
                    outputs = {contract.MM_HASH: np.array([server.keys.key(image).encode()], np.object_)}
                    if request["parameters"].get(contract.BY_VALUE):  # encoder_0 on another node
                        server.encode_calls.append(image)
                        embeds, grid = server.answer(image)
                        digest = embedding_digest(embeds[0], tuple(int(v) for v in grid.reshape(-1)[:3]))
                        outputs[contract.IMAGE_EMBEDS], outputs[contract.IMAGE_GRID_THW] = server.sent(embeds), grid
                        outputs[contract.EMBEDDING_DIGEST] = np.array([digest.encode()], np.object_)
                    if server.shared is not None and image != PROBE_IMAGE:  # encoder_0 on the shared store
                        owner = int(request["inputs"][1]._raw_owner)
                        answer = await CachedEncoder(server.shared, server.keys, server.encode).reference(image, owner)
                        outputs[contract.REFERENCES] = np.array([answer.reference.to_bytes()], np.object_)
                        outputs[contract.CACHE_HIT] = np.array([answer.cache_hit])
                    yield Result(outputs), None

        return Responses()

    async def close(self) -> None:
        pass


async def _shared_encode(self: FakeEncoderServer, image: bytes) -> EncodedImage:
    self.encode_calls.append(image)
    embeds, grid = self.answer(image)
    return EncodedImage(embeds[0], tuple(int(v) for v in grid[0]))  # type: ignore[arg-type]


FakeEncoderServer.encode = _shared_encode  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def raw_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the raw bytes on the tritonclient inputs the client builds (the fakes read them)."""
    from python_backends.scaleout import wire

    def image_bytes(image: bytes) -> Any:
        return type("Input", (), {"_raw_image": image})()

    def lease(owner: int) -> Any:
        return type("Input", (), {"_raw_owner": owner})()

    monkeypatch.setattr(wire, "image_input", image_bytes)
    monkeypatch.setattr(wire, "lease_input", lease)


@pytest.fixture
def store(tmp_path: Path):
    opened = EmbeddingStore(StoreConfig(path=str(tmp_path / "pd-store"), capacity_bytes=1 << 24, merge_size=2))
    opened.path = str(tmp_path / "pd-store")  # what a server's config names
    yield opened
    opened.close()


def remote_for(store: EmbeddingStore, servers: dict[str, FakeEncoderServer], **kwargs: Any) -> RemoteEncoders:
    return RemoteEncoders(
        StaticEndpoints(list(servers)), store, KEYS, node_id="node-a", store_path=store.path, merge_size=2,
        connect=lambda address: servers[address].client(address), **kwargs,
    )  # fmt: skip


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


# --------------------------------------------------------------------------- endpoint sources


def test_endpoint_specs() -> None:
    assert run(endpoint_source("a:8001, b:8001,a:8001").current()) == ["a:8001", "b:8001"]
    assert endpoint_source("dns:triton-epd-encoder:8001") == DnsEndpoints("triton-epd-encoder", 8001)
    assert endpoint_source("file:/etc/encoders") == FileEndpoints(Path("/etc/encoders"))
    for bad in ("a", "a:0", "a:x", "dns:name", "dns::8001", "file:", " , "):
        with pytest.raises(EndpointSpecError):
            endpoint_source(bad)


def test_dns_answers_one_address_per_record_and_nothing_on_failure() -> None:
    async def records(name: str, port: int, type: int) -> list[tuple[Any, ...]]:
        return [(socket.AF_INET, type, 6, "", (ip, port)) for ip in ("10.0.0.2", "10.0.0.1", "10.0.0.2")]

    async def nxdomain(name: str, port: int, type: int) -> list[tuple[Any, ...]]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    assert run(DnsEndpoints("enc", 8001, records).current()) == ["10.0.0.1:8001", "10.0.0.2:8001"]
    unresolved = DnsEndpoints("enc", 8001, nxdomain)
    assert run(unresolved.current()) == []
    assert unresolved.problem == "dns:enc:8001 resolves to nothing ([Errno -2] Name or service not known)"


def test_file_is_re_read(tmp_path: Path) -> None:
    path = tmp_path / "encoders"
    source = FileEndpoints(path)
    assert run(source.current()) == []  # missing: none (logged), not an exception
    assert source.problem.startswith(f"file:{path}: [Errno 2]")
    path.write_text("# encoders\n10.0.0.1:8001\n10.0.0.2:8001, 10.0.0.3:8001\n")
    assert run(source.current()) == ["10.0.0.1:8001", "10.0.0.2:8001", "10.0.0.3:8001"]
    assert source.problem == ""
    path.write_text("10.0.0.3:8001\n")
    assert run(source.current()) == ["10.0.0.3:8001"]


# --------------------------------------------------------------------------- admission


def test_admission_refuses_another_key_config_and_a_server_without_encoders(store: EmbeddingStore) -> None:
    servers = {"good:1": FakeEncoderServer(), "other:1": FakeEncoderServer(OTHER_KEYS), "pd:1": FakeEncoderServer()}
    servers["pd:1"].model_missing = True
    servers["down:1"] = FakeEncoderServer()
    servers["down:1"].ready = False
    remote = remote_for(store, servers)
    run(remote.refresh())
    assert list(remote.router.encoders) == ["good:1"]
    assert remote.stats.refused == {"other:1": 1, "pd:1": 1}  # down:1 is tried again, not refused
    assert remote.membership.unreachable == {"down:1": "not ready"}
    run(remote.refresh())  # a refused encoder is not probed again at once
    assert remote.stats.refused == {"other:1": 1, "pd:1": 1}
    assert "down:1: not ready" in remote.describe() and "good:1: ready, breaker closed" in remote.describe()
    servers["down:1"].ready = True
    run(remote.refresh())
    assert list(remote.router.encoders) == ["good:1", "down:1"] and remote.membership.unreachable == {}


# --------------------------------------------------------------------------- encoding


def test_another_nodes_embedding_crosses_once_and_is_then_a_local_hit(store: EmbeddingStore) -> None:
    servers = {"b:1": FakeEncoderServer(params={contract.NODE_ID: "node-b", contract.STORE_PATH: "/elsewhere"})}
    remote = remote_for(store, servers)
    image = b"image one"

    async def twice() -> list[tuple[bytes, bool]]:
        await remote.refresh()
        return [await remote.encode_reference(image, 4242), await remote.encode_reference(image, 4242)]

    (first, hit_first), (second, hit_second) = run(twice())
    assert servers["b:1"].encode_calls == [image]  # one fetch for two requests
    embeds, grid = embedding_of(image)
    assert remote.stats.cross_node_bytes == embeds.nbytes + grid.nbytes
    assert (hit_first, hit_second) == (False, True) and remote.stats.local_hits == 1
    ref = store.parse_reference(first)
    np.testing.assert_array_equal(store.resolve(ref), embeds[0])  # verified and stored here, by reference
    assert ref.grid_thw == (1, 4, 4)
    for wire in (first, second):
        store.release(store.parse_reference(wire))


def test_an_encoder_sharing_the_store_answers_a_reference(store: EmbeddingStore) -> None:
    shared = FakeEncoderServer(params={contract.NODE_ID: "node-a", contract.STORE_PATH: store.path}, shared=store)
    remote = remote_for(store, {"a:1": shared})

    async def once() -> tuple[bytes, bool]:
        await remote.refresh()
        return await remote.encode_reference(b"image two", 99)

    wire, hit = run(once())
    assert remote.membership.servers["a:1"].shares_store and not hit
    assert remote.stats.cross_node_bytes == 0  # nothing crossed: the encoder wrote our store
    assert store.resolve(store.parse_reference(wire)).shape == (4, HIDDEN)


def test_failover_retries_on_another_encoder_and_the_breaker_opens(store: EmbeddingStore) -> None:
    servers = {f"e{i}:1": FakeEncoderServer(params={contract.NODE_ID: "n"}) for i in range(2)}
    remote = remote_for(store, servers)
    run(remote.refresh())
    images = [f"image {i}".encode() for i in range(12)]
    dead = remote.router.home(KEYS.key(images[0]))
    alive = next(a for a in servers if a != dead)
    servers[dead].fail_with = "UNAVAILABLE"  # SIGKILLed: every call fails at once

    async def all_images() -> list[tuple[bytes, bool]]:
        return [await remote.encode_reference(image, 7) for image in images]

    answers = run(all_images())
    assert len(answers) == len(images) and len(servers[alive].encode_calls) == len(images)
    assert remote.stats.of(dead).failures == 3  # then its breaker opened: no more calls to it
    assert remote.stats.of(alive).retries == 3
    assert remote.router.encoders[dead].breaker.state == BreakerState.OPEN


def test_a_bad_answer_is_not_stored_and_goes_elsewhere(store: EmbeddingStore) -> None:
    servers = {f"e{i}:1": FakeEncoderServer(params={contract.NODE_ID: "n"}) for i in range(2)}
    remote = remote_for(store, servers)
    run(remote.refresh())
    image = b"image three"
    home = remote.router.home(KEYS.key(image))
    servers[home].answer = lambda image: (np.zeros((1, 3, HIDDEN), np.float32), np.array([[1, 4, 4]]))
    run(remote.encode_reference(image, 7))
    assert remote.stats.of(home).failures == 1 and remote.stats.cross_node_bytes > 0


def test_a_bad_image_is_the_clients_error_not_the_encoders(store: EmbeddingStore) -> None:
    servers = {"e:1": FakeEncoderServer(params={contract.NODE_ID: "n"})}
    remote = remote_for(store, servers)
    run(remote.refresh())
    servers["e:1"].fail_with = "INVALID_ARGUMENT"
    with pytest.raises(EpdError) as error:
        run(remote.encode_reference(b"not an image", 7))
    assert error.value.code == ErrorCode.INVALID_ARG
    assert remote.stats.of("e:1").failures == 0 and remote.router.encoders["e:1"].breaker.failures_in_a_row == 0


def test_an_encoder_model_error_keeps_its_code(store: EmbeddingStore) -> None:
    params = {contract.NODE_ID: "node-a", contract.STORE_PATH: store.path}
    servers = {f"a{i}:1": FakeEncoderServer(params=params, shared=store) for i in range(2)}
    remote = remote_for(store, servers)
    run(remote.refresh())
    for server in servers.values():
        server.error_output = '{"code": "INVALID_ARG", "message": "image[0] could not be decoded"}'
    with pytest.raises(EpdError) as error:
        run(remote.encode_reference(b"corrupt image", 7))
    assert error.value.code == ErrorCode.INVALID_ARG and "could not be decoded" in error.value.message
    assert sum(remote.stats.of(a).requests for a in servers) == 1  # not retried elsewhere
    for server in servers.values():
        server.error_output = '{"code": "INTERNAL", "message": "encode failed: RuntimeError"}'
    with pytest.raises(EpdError) as error:  # an encoder fault: tried on each, then UNAVAILABLE
        run(remote.encode_reference(b"another image", 7))
    assert error.value.code == ErrorCode.UNAVAILABLE and "INTERNAL" in error.value.message


def test_checked_embedding_refuses_what_does_not_fit() -> None:
    grid = np.array([[1, 4, 4]], np.int64)
    assert checked_embedding(np.zeros((1, 4, 2), np.float32), grid, 2).grid_thw == (1, 4, 4)
    for embeds, bad_grid in (
        (np.zeros((1, 4, 2), np.float64), grid),
        (np.zeros((1, 5, 2), np.float32), grid),
        (np.zeros((4, 2), np.float32), grid),
        (np.full((1, 4, 2), np.nan, np.float32), grid),
        (np.zeros((1, 4, 2), np.float32), np.array([[1, 0, 4]])),
    ):
        with pytest.raises(ValueError):
            checked_embedding(embeds, bad_grid, 2)


# --------------------------------------------------------------------------- bad topology, real clients


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("spec", ["unreachable", "dns:no-such-encoder.invalid:8001"])
def test_unreachable_or_unresolvable_encoders_give_one_clear_unavailable_error(
    spec: str, store: EmbeddingStore
) -> None:
    if spec == "unreachable":
        spec = f"127.0.0.1:{_closed_port()}"
    remote = RemoteEncoders(endpoint_source(spec), store, KEYS, node_id="n", store_path="x", merge_size=2)

    async def request() -> None:
        try:
            await remote.refresh()
            await remote.encode_reference(b"image", 7)
        finally:
            await remote.close()

    started = time.monotonic()
    with pytest.raises(EpdError) as error:
        run(request())
    assert error.value.code == ErrorCode.UNAVAILABLE and time.monotonic() - started < 10  # at once, no hang
    if spec.startswith("dns:"):
        assert "dns:no-such-encoder.invalid:8001 resolves to nothing" in error.value.message
    else:
        assert f"{spec}: not reachable" in error.value.message and "UNAVAILABLE" in error.value.message
    unreachable = remote.membership.unreachable
    assert unreachable if not spec.startswith("dns:") else unreachable == {}


class RecordingMetrics:
    """What ``RemoteEncoders.export`` writes, as ``ModelMetrics`` would take it: name+labels -> value."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def _handle(self, name: str, labels: dict[str, str]) -> Any:
        key, values = (name, tuple(sorted(labels.items()))), self.values
        values.setdefault(key, 0.0)

        class Handle:
            def increment(self, by: float) -> None:
                values[key] += by

            def set(self, value: float) -> None:
                values[key] = value

        return Handle()

    def counter(self, name: str, description: str, **labels: str) -> Any:
        return self._handle(name, labels)

    def gauge(self, name: str, description: str, **labels: str) -> Any:
        return self._handle(name, labels)


def test_a_lookup_that_finds_no_encoder_is_counted_and_exported(store: EmbeddingStore) -> None:
    answer: list[list[tuple[Any, ...]]] = []

    async def resolve(name: str, port: int, type: int) -> list[tuple[Any, ...]]:
        if not answer:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return answer

    servers = {"10.0.0.1:8001": FakeEncoderServer()}
    remote = RemoteEncoders(DnsEndpoints("enc", 8001, resolve), store, KEYS, node_id="n", store_path="x",
                            merge_size=2, connect=lambda address: servers[address].client(address))  # fmt: skip
    metrics = RecordingMetrics()
    for _ in range(2):
        run(remote.refresh())
    remote.export(metrics)
    assert metrics.values[("epd_remote_encoder_lookup_failures", ())] == 2
    assert metrics.values[("epd_remote_encoder_endpoints", ())] == 0
    answer.append((socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", 8001)))  # the name resolves now
    run(remote.refresh())
    remote.export(metrics)
    assert metrics.values[("epd_remote_encoder_lookup_failures", ())] == 2  # no new failure
    assert metrics.values[("epd_remote_encoder_endpoints", ())] == 1
    assert list(remote.router.encoders) == ["10.0.0.1:8001"]


# --------------------------------------------------------------------------- local fallback


def test_with_no_encoder_left_a_server_with_its_own_encoders_encodes_locally(store: EmbeddingStore) -> None:
    from python_backends.scaleout.remote import RemoteEncoderStages

    servers = {f"e{i}:1": FakeEncoderServer(params={contract.NODE_ID: "n"}) for i in range(2)}
    remote = remote_for(store, servers)
    run(remote.refresh())
    local_calls: list[tuple[str, bytes]] = []

    class LocalStages:  # the server's own BLS stages (encoder_<i> on this server)
        async def encode_reference(
            self, encoder: str, image: bytes, owner: int, tenant: Any = None, modality: str = "image"
        ) -> Any:
            local_calls.append((encoder, image))
            return b"local reference", False

    own = ["encoder_0", "encoder_1"]
    with_fallback, without = RemoteEncoderStages(LocalStages(), remote, own), RemoteEncoderStages(None, remote)
    assert with_fallback.routes_images and without.routes_images  # the pipeline picks no encoder for images
    assert run(with_fallback.encode_reference(None, b"image a", 7))[1] is False
    assert local_calls == [] and remote.stats.local_fallbacks == 0  # encoders alive: remote
    for server in servers.values():
        server.fail_with = "UNAVAILABLE"  # both killed
    assert run(with_fallback.encode_reference("encoder_1", b"image b", 7)) == (b"local reference", False)
    assert local_calls == [("encoder_1", b"image b")] and remote.stats.local_fallbacks == 1  # the pin, here
    assert all(remote.stats.of(a).failures == 1 for a in servers)  # each tried once, then here
    run(with_fallback.encode_reference(None, b"image d", 7))  # unpinned: its home among this server's, one rule
    assert local_calls[-1] == (home(own, KEYS.key(b"image d")), b"image d") and remote.stats.local_fallbacks == 2
    with pytest.raises(EpdError) as error:  # no encoder models here: one clear error
        run(without.encode_reference(None, b"image c", 7))
    assert error.value.code == ErrorCode.UNAVAILABLE and "e0:1" in error.value.message
    assert remote.stats.local_fallbacks == 2


def test_videos_stay_on_the_encoder_model_the_pipeline_picked(store: EmbeddingStore) -> None:
    from python_backends.scaleout.remote import RemoteEncoderStages

    calls: list[tuple[str | None, str]] = []

    class LocalStages:
        async def encode_reference(
            self, encoder: str, image: bytes, owner: int, tenant: Any = None, modality: str = "image"
        ) -> Any:
            calls.append((encoder, modality))
            return b"local reference", False

    stages = RemoteEncoderStages(LocalStages(), remote_for(store, {}))
    assert run(stages.encode_reference("encoder_0", b"video", 7, None, "video")) == (b"local reference", False)
    assert calls == [("encoder_0", "video")]


def test_an_encoder_that_stops_answering_readiness_opens_its_breaker_without_traffic(store: EmbeddingStore) -> None:
    servers = {f"e{i}:1": FakeEncoderServer(params={contract.NODE_ID: "n"}) for i in range(2)}
    remote = remote_for(store, servers)
    run(remote.refresh())
    servers["e0:1"].fail_with = "UNAVAILABLE"  # killed: connection refused
    servers["e1:1"].fail_with = "DEADLINE_EXCEEDED"  # slow to answer the poll: not ready, no breaker count
    for _ in range(3):
        run(remote.refresh())
    breakers = {a: remote.router.encoders[a].breaker for a in servers}
    assert breakers["e0:1"].state == BreakerState.OPEN and breakers["e0:1"].opens == 1
    assert breakers["e1:1"].state == BreakerState.CLOSED and breakers["e1:1"].failures_in_a_row == 0
    assert remote.router.healthy() == []
    servers["e0:1"].fail_with = servers["e1:1"].fail_with = ""
    run(remote.refresh())
    assert remote.router.healthy() == ["e1:1"]  # e0 is back once its back-off has passed and a call probes it


def test_an_embedding_altered_on_the_way_fails_its_digest_and_goes_elsewhere(store: EmbeddingStore) -> None:
    servers = {f"e{i}:1": FakeEncoderServer(params={contract.NODE_ID: "n"}) for i in range(2)}
    remote = remote_for(store, servers)
    run(remote.refresh())
    image = b"image four"
    home = remote.router.home(KEYS.key(image))

    def flipped(embeds: np.ndarray) -> np.ndarray:  # one value changed in transit: shape, dtype fine
        altered = embeds.copy()
        altered[0, 0, 0] += 1.0
        return altered

    servers[home].sent = flipped
    wire, _ = run(remote.encode_reference(image, 7))
    assert remote.stats.of(home).failures == 1  # refused, not stored; the other encoder's answer was
    np.testing.assert_array_equal(store.resolve(store.parse_reference(wire)), embedding_of(image)[0][0])
    store.release(store.parse_reference(wire))


class ScriptedCall:
    """A stream_infer call for ``wire.stream_one``: ``responses`` (result, error) pairs, then the
    server's close after ``close_after_s`` (None: never, only a cancel ends it)."""

    def __init__(self, responses: list[tuple[Any, Any]], close_after_s: float | None = 0.0) -> None:
        self.responses, self.close_after_s = list(responses), close_after_s
        self.read = 0
        self.cancelled = False
        self.gone = asyncio.Event()

    def __aiter__(self) -> ScriptedCall:
        return self

    async def __anext__(self) -> tuple[Any, Any]:
        if self.responses:
            self.read += 1
            return self.responses.pop(0)
        if self.close_after_s is None:
            await self.gone.wait()
        else:
            await asyncio.sleep(self.close_after_s)
        raise StopAsyncIteration

    def cancel(self) -> bool:
        self.cancelled = True
        self.gone.set()
        return True


class ScriptedClient:
    def __init__(self, call: ScriptedCall) -> None:
        self.call = call
        self.stream_timeouts: list[Any] = []

    def stream_infer(self, requests: Any, stream_timeout: float | None = None) -> ScriptedCall:
        self.stream_timeouts.append(stream_timeout)
        return self.call


def _error_output(message: str) -> Result:
    fields = {"code": ErrorCode.INVALID_ARG.value, "message": message}
    return Result({contract.ERROR: np.array([json.dumps(fields).encode()], np.object_)})


def test_wire_reads_an_answered_stream_to_its_close_and_sets_no_grpc_deadline() -> None:
    from python_backends.scaleout import wire

    call = ScriptedCall([(Result({contract.MM_HASH: np.array([b"k"], np.object_)}), None)], close_after_s=0.05)
    client = ScriptedClient(call)
    answer = asyncio.run(wire.stream_one(client, "encoder_0", [], None, 5.0, StreamEnds()))
    assert answer.as_numpy(contract.MM_HASH) is not None
    assert (call.read, call.cancelled, client.stream_timeouts) == (1, False, [None])


def test_wire_does_not_cancel_the_stream_of_an_error_response() -> None:
    """The encoder's error (errors_as_outputs) is its request's last response: a cancel right after
    it is the cancel-after-final that leaked the encoder model (docs/benchmarks/cancel-storm.md)."""
    from python_backends.scaleout import wire

    call = ScriptedCall([(_error_output("image[0] is empty"), None)], close_after_s=0.05)
    with pytest.raises(EpdError, match="is empty"):
        asyncio.run(wire.stream_one(ScriptedClient(call), "encoder_0", [], None, 5.0, StreamEnds()))
    assert call.cancelled is False


def test_wire_cancels_a_stream_past_its_timeout_only_after_the_grace() -> None:
    from python_backends.scaleout import wire

    ends = StreamEnds(grace_s=0.3)
    call = ScriptedCall([], close_after_s=None)

    async def run() -> tuple[bool, bool]:
        with pytest.raises(ConnectionError, match="no answer in 0.1 s"):
            await wire.stream_one(ScriptedClient(call), "encoder_0", [], None, 0.1, ends)
        at_timeout = call.cancelled
        await asyncio.sleep(0.1)
        before_grace = call.cancelled
        await ends.wait()
        return at_timeout, before_grace

    at_timeout, before_grace = asyncio.run(run())
    assert (at_timeout, before_grace, call.cancelled) == (False, False, True)

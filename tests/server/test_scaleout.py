"""Scale-out EPD on loopback (issue 13): 2 encoder-role servers + 1 pd-role server.

- encoder A: node ``node-a``, the PD server's store path: embeddings by reference, zero-copy;
- encoder B: node ``node-b``, its own store ("another node"): the PD server fetches each of its
  images' embeddings once over gRPC and keeps it in its own store;
- PD: ``--role pd --remote-encoders A,B`` (epd, prefill, decode, llm).

Equality: ``epd`` on the PD server == its ``llm`` greedy tokens for the 18 acceptance prompts,
and again when every image is stored. Affinity: each distinct image is encoded once across both
encoders, cross-node bytes do not grow on the second pass. Homes: a third encoder added while
requests run takes 20-45 % of the homes, counted per image on the encoders' own counters. Bad
topology: an encoder with another checkpoint or preprocessing config is refused at admission
(log line + metric), an unreachable address and an unresolvable name are logged and skipped, and a
pd server given ``dns:NAME:PORT`` for a name that resolves to nothing answers one UNAVAILABLE error
per request at once (unit-tested too: tests/unit/test_remote_encoders.py). Every encoder requires
the peer key, which the PD server sends (issue 51): a caller without it is refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import shutil
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from builders.access import PEER_HEADER, Access, grpc_header, read_key
from builders.default_model import DEFAULT_MODEL_DIR, build_default_model
from builders.launcher import prepare
from builders.repository import TARGETS
from builders.roles import load_model_args
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer
from client.epd_client import chat_prompt
from python_backends import contract
from python_backends.scaleout import wire
from python_backends.scaleout.endpoints import StaticEndpoints
from python_backends.scaleout.remote import RemoteEncoders
from python_backends.scaleout.routing import rendezvous_order
from python_backends.store import EmbeddingStore, KeyConfig, StoreConfig
from tests.images import synthetic_image, with_note
from tests.server.conftest import LOG_DIR, TEST_EXIT_TIMEOUT_S, serving
from tests.server.test_epd_acceptance import (
    EQUALITY_CASES,
    Answer,
    _case_images,
    metric,
    stream_generate,
    tokens_of,
)

pytestmark = [
    pytest.mark.timeout(2400),  # three servers start one after another on a shared 2-core machine
    pytest.mark.server,
    # Three dedicated servers (one with three vLLM engines) do not fit CI's time budget.
    pytest.mark.skipif(not os.environ.get("TRITON_EPD_SCALEOUT_TESTS"), reason="run with `make test-scaleout`"),
]

SLOTS_DIR = REPO_ROOT / "build" / "test-slots"


@dataclasses.dataclass
class Topology:
    encoder_a: TritonServer
    encoder_b: TritonServer
    pd: TritonServer
    pd_store: str
    encoders_file: Path  # the PD server's --remote-encoders file:PATH (re-read every 2 s)

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{server.options.ports.grpc}" for server in (self.encoder_a, self.encoder_b)]


def _peer_key_file() -> Path:
    """The encoder servers' key (issue 51): every encoder here requires it, the PD servers send it."""
    path = SLOTS_DIR / "scaleout-peer-key"
    if not path.exists():
        SLOTS_DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_urlsafe(32))
        path.chmod(0o600)
    return path


def _server(name: str, node_dir: Path, model_dir: Path, role: str, node: str, store: str, **extra) -> ServerOptions:
    repository = SLOTS_DIR / f"scaleout-{name}-{node_dir.name}"
    cache = dataclasses.replace(TARGETS["cpu"].cache, path=store, node_id=node)
    prepare("cpu", model_dir, repository, cache=cache, kv_store_path=str(node_dir / f"scaleout-kv-{name}"),
            role=role, **extra)  # fmt: skip
    args = load_model_args(dataclasses.replace(TARGETS["cpu"], cache=cache), role)  # type: ignore[arg-type]
    # As triton-epd-serve --peer-key-file runs them (builders/launcher.py server_access).
    peer = _peer_key_file()
    access = Access(peer_key=read_key(peer), role=role).tritonserver_args()
    env = {wire.PEER_KEY_FILE_ENV: str(peer)} if role == "pd" else {}
    return ServerOptions(repository, Ports.free(), extra_args=(*args, *access), extra_env=env,
                         exit_timeout_s=TEST_EXIT_TIMEOUT_S)  # fmt: skip


@pytest.fixture(scope="module")
def topology(model_dir: Path, node_dir: Path) -> Iterator[Topology]:
    store_a, store_b = str(node_dir / "scaleout-node-a"), str(node_dir / "scaleout-node-b")
    options_a = _server("a", node_dir, model_dir, "encoder", "node-a", store_a)
    options_b = _server("b", node_dir, model_dir, "encoder", "node-b", store_b)
    with serving(options_a, LOG_DIR / "scaleout-encoder-a.log") as a, \
            serving(options_b, LOG_DIR / "scaleout-encoder-b.log") as b:  # fmt: skip
        encoders_file = node_dir / "scaleout-encoders"
        encoders_file.write_text(f"127.0.0.1:{a.options.ports.grpc}\n127.0.0.1:{b.options.ports.grpc}\n")
        remote = f"file:{encoders_file}"
        options_pd = _server("pd", node_dir, model_dir, "pd", "node-a", store_a, remote_encoders=remote)
        with serving(options_pd, LOG_DIR / "scaleout-pd.log") as pd:
            yield Topology(a, b, pd, store_a, encoders_file)


def test_a_pd_server_whose_dns_name_resolves_to_nothing_says_so_and_answers_at_once(
    model_dir: Path, node_dir: Path
) -> None:
    """``--remote-encoders dns:NAME:PORT`` for a name that resolves to nothing (``.invalid``,
    RFC 6761): the server starts, logs the name once, counts the failed lookups
    (``epd_remote_encoder_lookup_failures``, ``epd_remote_encoder_endpoints`` 0), and each
    request gets one clear error naming the DNS name, at once, never a hang. Only ``epd`` is
    loaded: a request that finds no encoder fails before prefill, so the pd role's three vLLM
    engines would add minutes of start on a shared 2-core machine and nothing to what is shown."""
    spec = "dns:no-such-encoder.invalid:8001"
    options = _server("dns", node_dir, model_dir, "pd", "node-dns", str(node_dir / "scaleout-node-dns"),
                      remote_encoders=spec)  # fmt: skip
    options = dataclasses.replace(options, extra_args=("--model-control-mode=explicit", "--load-model=epd"))
    prompt, sampling = chat_prompt("What is this?", 1), {"max_tokens": 4, "temperature": 0.0}
    with serving(options, LOG_DIR / "scaleout-pd-dns.log") as pd:
        line = f"encoders: {spec} resolves to nothing"
        assert _wait_for(lambda: line in pd.group.log_path.read_text(), 30), f"no log line {line!r}"
        for i in range(3):
            started = time.monotonic()
            answer = stream_generate(pd.grpc_url, "epd", prompt, [synthetic_image(96, 96, 750 + i, "PNG")], sampling)
            elapsed = time.monotonic() - started
            assert answer.error is not None and "no encoder server could encode the image" in answer.error
            assert f"{spec} resolves to nothing" in answer.error, answer.error
            assert elapsed < 10, f"{elapsed:.1f} s for an error that needs no encoder"
        assert _wait_for(lambda: _metric_or_zero(pd, "epd_remote_encoder_lookup_failures") >= 2, 10)
        assert metric(pd, "epd_remote_encoder_endpoints") == 0
        assert _models(pd) == {"epd"}  # still serving
        assert pd.group.log_path.read_text().count(line) == 1, "logged once, not every lookup"
        print(f"\n{answer.error}")


def _models(server: TritonServer) -> set[str]:
    import json

    request = urllib.request.Request(f"http://{server.http_url}/v2/repository/index", method="POST", data=b"{}")
    index = json.loads(urllib.request.urlopen(request, timeout=10).read())
    return {entry["name"] for entry in index if entry.get("state") == "READY"}


def _encodes(topology: Topology) -> float:
    servers = (topology.encoder_a, topology.encoder_b)
    return sum(metric(server, "nv_inference_request_success", model="encode") for server in servers)


def test_each_role_server_serves_only_its_models(topology: Topology) -> None:
    assert _models(topology.encoder_a) == {"preprocess", "vit_encoder", "encode", "encoder_0", "encoder_1"}
    assert _models(topology.pd) == {"epd", "prefill", "decode", "llm"}


def test_epd_over_remote_encoders_equals_llm_and_encodes_each_image_once(topology: Topology) -> None:
    note = f"scaleout {secrets.token_hex(8)}".encode()
    pd = topology.pd
    encodes_before = _encodes(topology)
    rows, mismatches, distinct = [], 0, set()
    for index, (name, prompt_of, specs) in enumerate(EQUALITY_CASES):
        images = _case_images(index, specs, note)
        distinct.update(images)
        prompt = prompt_of(len(images))
        llm = tokens_of(pd, "llm", prompt, images).result
        epd = tokens_of(pd, "epd", prompt, images).result
        same = epd.token_ids == llm.token_ids and epd.num_input_tokens == llm.num_input_tokens
        mismatches += not same
        rows.append(f"{'ok ' if same else 'BAD'} {name}: llm {llm.token_ids} epd {epd.token_ids}")
    assert _encodes(topology) - encodes_before == len(distinct)  # each image once, over both encoders

    def routed() -> float:  # exported every 2 s
        return sum(metric(pd, "epd_routing_decisions", decision=d) for d in ("home", "spilled"))

    assert _wait_for(lambda: routed() >= len(distinct), 10), f"{routed()} images routed, {len(distinct)} distinct"
    first_pass_bytes = metric(pd, "epd_cross_node_bytes")  # the same export as the routing counters
    assert first_pass_bytes > 0  # some images had encoder B (another node) as their home

    for index, (name, prompt_of, specs) in enumerate(EQUALITY_CASES):  # every image stored now
        images = _case_images(index, specs, note)
        prompt = prompt_of(len(images))
        llm = tokens_of(pd, "llm", prompt, images).result
        again = tokens_of(pd, "epd", prompt, images)
        # A repeat inside one request may count once or twice (as in test_epd_acceptance).
        hits_ok = again.cache_hits is not None and len(set(images)) <= again.cache_hits <= len(images)
        same = again.result.token_ids == llm.token_ids and hits_ok
        mismatches += not same
        rows.append(f"{'ok ' if same else 'BAD'} {name} (stored): hits {again.cache_hits}")
    assert mismatches == 0, "\n".join(rows)
    assert _encodes(topology) - encodes_before == len(distinct)
    assert metric(pd, "epd_cross_node_bytes") == first_pass_bytes  # crossed once per (image, node)
    assert metric(pd, "epd_remote_encoder_failures") == 0
    assert metric(pd, "epd_routing_decisions", decision="local_fallback") == 0  # a pd server has no encoders


# A third encoder added while requests run (issue 13, affinity): the homes it takes, per image.
HOME_PROBES = 128  # ~1/3 expected: 20-45 % fails by chance about 3 times in 1,000 runs
LOAD_WORKERS = 2


class _Load:
    """Requests that keep the PD server busy from other threads. By default they repeat images
    the PD store holds (prefill and decode run, no encoder is called, so the encoders' counters
    stay the probes'); while ``fresh`` is set, each request brings a new image (encodes)."""

    def __init__(self, pd: TritonServer, note: bytes) -> None:
        self.pd, self.note = pd, note
        self.prompt, self.sampling = chat_prompt("Describe it.", 1), {"max_tokens": 4, "temperature": 0.0}
        self.pool = [with_note(synthetic_image(92, 96, 1100 + i, "PNG"), note) for i in range(4)]
        self.fresh, self.stop = threading.Event(), threading.Event()
        self.lock = threading.Lock()
        self.done = self.fresh_done = self.fresh_in_flight = 0
        self.errors: list[str] = []
        self.changed: list[str] = []  # a stored image answered other tokens than when it was warmed
        self.next_fresh = 0
        self.tokens: dict[bytes, list[int]] = {}
        self.threads = [threading.Thread(target=self._work, args=(k,), daemon=True) for k in range(LOAD_WORKERS)]

    def warm(self) -> None:
        for image in self.pool:  # stored on the PD node from now on
            self.tokens[image] = tokens_of(self.pd, "epd", self.prompt, [image], self.sampling).result.token_ids

    def _work(self, worker: int) -> None:
        n = 0
        while not self.stop.is_set():
            with self.lock:  # the test clears ``fresh`` under this lock: no new image after that
                fresh = self.fresh.is_set()
                if fresh:
                    self.fresh_in_flight += 1
                    self.next_fresh += 1
                    image = with_note(synthetic_image(88, 96, 20_000 + self.next_fresh, "PNG"), self.note)
            if not fresh:
                image, n = self.pool[(worker + n) % len(self.pool)], n + 1
            try:
                answer = stream_generate(self.pd.grpc_url, "epd", self.prompt, [image], self.sampling)
            except Exception as exc:  # no response in time (a hang), connection lost: counted, not lost
                answer = Answer(error=f"{type(exc).__name__}: {exc}")
            with self.lock:
                self.done += 1
                if fresh:
                    self.fresh_in_flight -= 1
                    self.fresh_done += 1
                if answer.error is not None:
                    self.errors.append(answer.error)
                elif not fresh and answer.result.token_ids != self.tokens[image]:
                    self.changed.append(f"{answer.result.token_ids}, not {self.tokens[image]}")

    def __enter__(self) -> _Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=600)


def _probe_homes(pd: TritonServer, encoders: list[TritonServer], images: list[bytes], tenant: str) -> list[int | None]:
    """Which encoder encoded each image, one request at a time: the one whose ``encode`` count
    rose by one (None if not exactly one did). ``tenant`` gives the images fresh store keys on
    every node, so each is a miss that calls its home; the routing key is the tenant-free
    ``mm_hash``, so an image's home does not depend on the tenant."""
    prompt, sampling = chat_prompt("What is this?", 1), {"max_tokens": 1, "temperature": 0.0}
    counts = [_encoded_on(server) for server in encoders]
    homes: list[int | None] = []
    for image in images:
        answer = stream_generate(pd.grpc_url, "epd", prompt, [image], sampling, parameters={"tenant": tenant})
        assert answer.error is None, answer.error
        deadline = time.monotonic() + 5
        while True:  # an encoder's counter is updated as its encode finishes, a moment before epd answers
            now = [_encoded_on(server) for server in encoders]
            rises = [i for i, (a, b) in enumerate(zip(now, counts, strict=True)) if a > b]
            if rises or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        one = len(rises) == 1 and now[rises[0]] - counts[rises[0]] == 1
        homes.append(rises[0] if one else None)
        counts = now
    return homes


def _routing_keys(pd: TritonServer, images: list[bytes]) -> list[str]:
    """Each image's ``mm_hash`` as the PD server computes it (its preprocessing config and encoder file)."""
    config = (pd.options.model_repository / "epd" / "config.pbtxt").read_text()

    def parameter(name: str) -> str:
        return config.split(f'key: "{name}"')[1].split('string_value: "')[1].split('"')[0]

    encoder_file = pd.options.model_repository / parameter(contract.ENCODER_FILE)
    keys = KeyConfig.from_files(Path(parameter(contract.PREPROCESSOR_CONFIG)), encoder_file)
    return [keys.key(image) for image in images]


def test_a_third_encoder_added_under_load_takes_a_third_of_the_homes(
    topology: Topology, model_dir: Path, node_dir: Path
) -> None:
    """Requests run the whole time from other threads. The homes of 128 images are measured
    with 2 encoders; a third encoder server is started and added to the PD's encoder file while
    the load brings new images (so encodes are in flight as it joins, and it takes some); then
    the same images' homes are measured again. Between 20 % and 45 % of them moved, every one to
    the new encoder, and each measured home is the rendezvous home of its ``mm_hash`` over the
    encoders of the moment. The load gets no error."""
    pd, a, b = topology.pd, topology.encoder_a, topology.encoder_b
    note = f"homes {secrets.token_hex(8)}".encode()
    probes = [with_note(synthetic_image(96 + 4 * (i % 6), 96, 1200 + i, "PNG"), note) for i in range(HOME_PROBES)]
    keys = _routing_keys(pd, probes)
    options = _server("third", node_dir, model_dir, "encoder", "node-third", str(node_dir / "scaleout-node-third"))
    addresses = [f"127.0.0.1:{server.options.ports.grpc}" for server in (a, b)]
    for address in addresses:  # both admitted and in use (earlier tests restart encoders)

        def breaker(endpoint: str = address) -> float | None:
            return _metric_or_none(pd, "epd_remote_encoder_breaker_state", endpoint=endpoint)

        assert _wait_for(lambda: breaker() == 0, 60), f"{address}: breaker state {breaker()}"
    load = _Load(pd, note)
    load.warm()
    problems: list[str] = []
    with load:
        before = _probe_homes(pd, [a, b], probes, f"homes-before-{note.hex()[-8:]}")
        load.fresh.set()  # encodes in flight from here until the third encoder has taken some
        with serving(options, LOG_DIR / "scaleout-encoder-third.log") as third:
            third_address = f"127.0.0.1:{third.options.ports.grpc}"
            third_before = _encoded_on(third)  # its admission probe encodes one image
            try:
                done_at_add = load.done
                topology.encoders_file.write_text("\n".join([*topology.addresses, third_address]) + "\n")
                # Admitted: the PD exports its breaker state (its info-level log line is not in Triton's log).
                admitted = _wait_for(
                    lambda: _metric_or_none(pd, "epd_remote_encoder_breaker_state", endpoint=third_address) == 0, 60
                )
                assert admitted, f"{third_address} was not admitted"
                took = _wait_for(lambda: _encoded_on(third) > third_before + 1, 60)  # from the load's new images
                with load.lock:
                    load.fresh.clear()
                assert _wait_for(lambda: load.fresh_in_flight == 0, 120)
                during = load.done - done_at_add
                took_under_load = _encoded_on(third) - third_before - 1
                after = _probe_homes(pd, [a, b, third], probes, f"homes-after-{note.hex()[-8:]}")
            finally:
                topology.encoders_file.write_text("\n".join(topology.addresses) + "\n")
                time.sleep(5)  # the PD drops it at its next re-read (every 2 s) before it stops
    if not took:
        problems.append("the third encoder took none of the load's new images")
    if load.errors:
        problems.append(f"{len(load.errors)} load requests failed: {load.errors[:3]}")
    unclear = [i for i, (x, y) in enumerate(zip(before, after, strict=True)) if x is None or y is None]
    if unclear:
        problems.append(f"{len(unclear)} probes not encoded on exactly one encoder: {unclear[:8]}")
    homes_2, homes_3 = addresses, [*addresses, third_address]
    wrong = [i for i, (key, x, y) in enumerate(zip(keys, before, after, strict=True))
             if (x is not None and homes_2[x] != rendezvous_order(homes_2, key)[0])
             or (y is not None and homes_3[y] != rendezvous_order(homes_3, key)[0])]  # fmt: skip
    if wrong:
        problems.append(f"{len(wrong)} probes were not encoded on their rendezvous home: {wrong[:8]}")
    moved = [i for i, (x, y) in enumerate(zip(before, after, strict=True)) if x != y and i not in unclear]
    not_to_third = [i for i in moved if after[i] != 2]
    if not_to_third:
        problems.append(f"{len(not_to_third)} homes moved between the first two encoders: {not_to_third[:8]}")
    share = len(moved) / HOME_PROBES
    if not 0.20 <= share <= 0.45:
        problems.append(f"the third encoder moved {share:.0%} of the homes, not 20-45 %")
    spilled = metric(pd, "epd_routing_decisions", decision="spilled")
    print(f"\nthird encoder: {len(moved)}/{HOME_PROBES} homes moved ({share:.1%}), all to it: {not not_to_third}; "
          f"homes before A/B {before.count(0)}/{before.count(1)}, after A/B/C {after.count(0)}/{after.count(1)}/"
          f"{after.count(2)}; load: {load.done} requests, {during} while it joined, {load.fresh_done} with new "
          f"images, {took_under_load:g} of them encoded on it; spilled decisions so far {spilled:g}; stored "
          f"images answering other tokens than at warm-up (near-ties, not routing): {load.changed[:3]}")  # fmt: skip
    assert not problems, "\n".join(problems)


def _text(server: TritonServer) -> str:
    return urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()


def test_an_encoder_refuses_a_caller_without_the_peer_key_while_the_pd_server_serves_through_it(
    topology: Topology,
) -> None:
    """Issue 51: encoder A requires the peer key for every inference; a caller without it, or with
    another, is refused by Triton's restricted protocol, and the PD server (which sends it to every
    encoder) keeps encoding through them."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    encoder = topology.encoder_a
    image = with_note(synthetic_image(96, 80, 9511, "PNG"), secrets.token_bytes(8))
    client = grpcclient.InferenceServerClient(encoder.grpc_url)
    try:
        for headers in (None, {grpc_header(PEER_HEADER): "not-the-peer-key-0123456789"}):
            with pytest.raises(InferenceServerException, match="restricted") as refused:
                client.infer("vit_encoder", [], headers=headers)
            assert refused.value.status() == "StatusCode.UNAVAILABLE"
        assert client.is_server_ready()  # health stays open
    finally:
        client.close()
    before = _encodes(topology)
    answer = stream_generate(topology.pd.grpc_url, "epd", chat_prompt("What is this?", 1), [image],
                             {"max_tokens": 2, "temperature": 0.0})  # fmt: skip
    assert answer.error is None, answer.error
    assert _wait_for(lambda: _encodes(topology) == before + 1, 10), "the PD server's encode went elsewhere"


def test_an_encoder_with_another_preprocessing_config_is_refused(
    topology: Topology, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repository = SLOTS_DIR / f"scaleout-b-{Path(topology.pd_store).parent.name}"
    config = next(repository.glob("encoder_0/config.pbtxt")).read_text()
    preprocessor = Path(config.split('key: "preprocessor_config"')[1].split('string_value: "')[1].split('"')[0])
    changed = tmp_path / "preprocessor_config.json"
    # Another preprocessing config: one more setting is enough to change every content key.
    changed.write_text(preprocessor.read_text().rstrip().rstrip("}") + ', "scaleout_test_other_setting": 1}')
    keys = KeyConfig.from_files(changed, repository / "vit_encoder" / "1" / "model.onnx")
    store = EmbeddingStore(StoreConfig(path=str(tmp_path / "store"), merge_size=2))
    address = f"127.0.0.1:{topology.encoder_b.options.ports.grpc}"
    monkeypatch.setenv(wire.PEER_KEY_FILE_ENV, str(_peer_key_file()))  # refused for its config, not the key
    remote = RemoteEncoders(StaticEndpoints([address]), store, keys, node_id="node-c", store_path="x", merge_size=2)

    async def one_round() -> None:
        await remote.refresh()
        await remote.close()

    try:
        with pytest.raises(Exception) as refused:
            asyncio.run(one_round())
            asyncio.run(remote.encode_reference(b"any image", 1))
        assert f"{address}: refused" in str(refused.value) and "UNAVAILABLE" in repr(refused.value.code)
        assert remote.stats.refused == {address: 1}
    finally:
        store.close()


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _other_preprocessing(options: ServerOptions, tmp_path: Path) -> None:
    """Point the encoder models of ``options``' repository at a changed preprocessing config:
    one more setting is enough to change every content key. The folder is laid out like a
    checkpoint's (``preprocessor_config.json`` beside the video processor's file): encoder_0
    reads the video config from the image config's folder (e681360)."""
    for config_path in options.model_repository.glob("encoder_*/config.pbtxt"):
        config = config_path.read_text()
        original = Path(config.split('key: "preprocessor_config"')[1].split('string_value: "')[1].split('"')[0])
        folder = tmp_path / "other-preprocessing"
        folder.mkdir(exist_ok=True)
        changed = folder / "preprocessor_config.json"
        changed.write_text(original.read_text().rstrip().rstrip("}") + ', "scaleout_test_other_setting": 1}')
        video = original.parent / "video_preprocessor_config.json"
        if video.is_file():
            shutil.copy2(video, folder / video.name)
        config_path.write_text(config.replace(str(original), str(changed)))


def test_bad_topology_input_is_reported_or_refused_and_requests_keep_their_answers(
    topology: Topology, model_dir: Path, node_dir: Path, tmp_path: Path
) -> None:
    """The PD server's encoder file gets an unreachable address, a name that resolves to nothing,
    a real encoder server with another preprocessing config and one serving another checkpoint
    (the default tiny model built with seed 1): each is a log line on the PD server (the last two
    refused at connect time, each with ``epd_remote_encoder_refused``); requests meanwhile keep
    llm's tokens from the good encoders, none waits past the deadline."""
    pd, log_path = topology.pd, topology.pd.group.log_path
    closed, nowhere = f"127.0.0.1:{_closed_port()}", "no-such-encoder.invalid:8001"
    options = _server("c", node_dir, model_dir, "encoder", "node-c", str(node_dir / "scaleout-node-c"))
    _other_preprocessing(options, tmp_path)
    other_model = build_default_model(DEFAULT_MODEL_DIR.parent / "tiny-qwen2-vl-seed1", seed=1)
    options_d = _server("d", node_dir, other_model, "encoder", "node-d", str(node_dir / "scaleout-node-d"))
    prompt, sampling = chat_prompt("What is this?", 1), {"max_tokens": 4, "temperature": 0.0}
    note = f"bad topology {secrets.token_hex(8)}".encode()
    deadline_s = _deadline_s(pd)
    with serving(options, LOG_DIR / "scaleout-encoder-other-config.log") as other, \
            serving(options_d, LOG_DIR / "scaleout-encoder-other-checkpoint.log") as other_checkpoint:  # fmt: skip
        other_address = f"127.0.0.1:{other.options.ports.grpc}"
        checkpoint_address = f"127.0.0.1:{other_checkpoint.options.ports.grpc}"
        refused = (other_address, checkpoint_address)
        try:
            bad = [closed, nowhere, *refused]
            topology.encoders_file.write_text("\n".join([*topology.addresses, *bad]) + "\n")
            lines = {
                "refused (preprocessing)": f"encoder {other_address} refused: keys the probe image as",
                "refused (checkpoint)": f"encoder {checkpoint_address} refused: keys the probe image as",
                "unreachable": f"encoder {closed} not reachable",
                "unresolvable": f"encoder {nowhere} not reachable",
            }
            logged = _wait_for(lambda: all(line in log_path.read_text() for line in lines.values()), 90)
            text = log_path.read_text()
            assert logged, {kind: line in text for kind, line in lines.items()}
            for address in refused:
                assert _wait_for(lambda a=address: _metric_or_zero(pd, "epd_remote_encoder_refused", endpoint=a) == 1,
                                 10), address  # fmt: skip
            for i in range(4):
                image = with_note(synthetic_image(104, 96, 600 + i, "PNG"), note)
                want = tokens_of(pd, "llm", prompt, [image], sampling).result.token_ids
                started = time.monotonic()
                answer = stream_generate(pd.grpc_url, "epd", prompt, [image], sampling)
                assert answer.error is None, answer.error
                assert answer.result.token_ids == want and time.monotonic() - started < deadline_s
            for address in refused:  # never routed to
                assert _metric_or_zero(pd, "epd_remote_encoder_requests", endpoint=address) == 0, address
            print("\n".join(line for line in log_path.read_text().splitlines() if any(a in line for a in bad)))
        finally:
            topology.encoders_file.write_text("\n".join(topology.addresses) + "\n")


# Failover load (issue 13): 64 requests at c=8, 40 distinct images and 24 repeats of earlier ones.
FAILOVER_REQUESTS, FAILOVER_CONCURRENCY, KILL_AFTER = 64, 8, 16


def _failover_images(note: bytes) -> list[bytes]:
    """Request i's image: a new one, or (3 of every 8) the image of request i - 5 again."""
    images: list[bytes] = []
    for i in range(FAILOVER_REQUESTS):
        fresh = with_note(synthetic_image(96 + 4 * (i % 8), 96, 500 + i, "PNG"), note)
        images.append(images[i - 5] if i % 8 >= 5 else fresh)
    return images


def _deadline_s(server: TritonServer) -> float:
    """epd's remote encode deadline: its config's, else the contract's default."""
    config = (server.options.model_repository / "epd" / "config.pbtxt").read_text()
    key = f'key: "{contract.REMOTE_ENCODE_DEADLINE_S}"'
    if key not in config:
        return float(contract.default_of(contract.REMOTE_ENCODE_DEADLINE_S))
    return float(config.split(key)[1].split('string_value: "')[1].split('"')[0])


@pytest.mark.parametrize("victim", ["another-node", "shared-store"])
def test_an_encoder_killed_under_load_fails_over_and_rejoins(topology: Topology, victim: str) -> None:
    """64 requests (unique and repeated images) at c=8; one encoder SIGKILLed once 16 have
    finished: every request answers llm's tokens within the request deadline, the killed
    encoder's in-flight encodes are retried on the other, its breaker opens, and restarted on the
    same address it is taken back (its encode counter rises again). ``another-node``: encoder B
    (its own store, embeddings by value); ``shared-store``: encoder A (the PD's store, by
    reference), killed while it may hold single-flight claims in that store."""
    pd = topology.pd
    killed = topology.encoder_b if victim == "another-node" else topology.encoder_a
    survivor = topology.encoder_a if victim == "another-node" else topology.encoder_b
    address = f"127.0.0.1:{killed.options.ports.grpc}"
    note = f"failover {victim} {secrets.token_hex(8)}".encode()
    prompt, sampling = chat_prompt("What is this?", 1), {"max_tokens": 4, "temperature": 0.0}
    images = _failover_images(note)
    expected = {image: tokens_of(pd, "llm", prompt, [image], sampling).result.token_ids for image in set(images)}
    deadline_s = _deadline_s(pd)
    failures_before = _metric_or_zero(pd, "epd_remote_encoder_failures", endpoint=address)
    opens_before = _metric_or_zero(pd, "epd_remote_encoder_breaker_opens", endpoint=address)
    survivor_before = _encoded_on(survivor)
    finished, lock = [0], threading.Lock()

    def request(image: bytes) -> tuple[Any, float]:
        started = time.monotonic()
        answer = stream_generate(pd.grpc_url, "epd", prompt, [image], sampling)
        elapsed = time.monotonic() - started
        with lock:
            finished[0] += 1
            if finished[0] == KILL_AFTER:
                os.killpg(killed.group.pid, signal.SIGKILL)  # tritonserver and its python stubs
        return answer, elapsed

    problems: list[str] = []
    try:
        with ThreadPoolExecutor(FAILOVER_CONCURRENCY) as pool:
            results = list(pool.map(request, images))
        answers, times = [a for a, _ in results], [t for _, t in results]
        problems += [f"request {i}: {a.error}" for i, a in enumerate(answers) if a.error is not None]
        differ = [i for i, (a, image) in enumerate(zip(answers, images, strict=True))
                  if a.error is None and a.result.token_ids != expected[image]]  # fmt: skip
    finally:  # restarted whatever happened, so that the next tests have both encoders
        killed.group.log_path = LOG_DIR / f"scaleout-{victim}-restarted.log"
        killed.start()
        killed.wait_ready(timeout_s=600)
    for i in differ:
        # The same pixels under another key (a fresh encode, every encoder up, no failure): if
        # epd answers that too, the difference from llm is the encode path's own (DALI vs the HF
        # processor inside llm, a near-tie of the random-weight model: request 35's 108x96 image,
        # docs/benchmarks/investigations.md), not something the failover did; anything
        # else is a failover fault.
        fresh = tokens_of(pd, "epd", prompt, [with_note(images[i], b"fresh " + secrets.token_bytes(8))], sampling)
        line = (f"request {i}: epd {answers[i].result.token_ids}, llm {expected[images[i]]}, "
                f"epd for the same pixels without failover {fresh.result.token_ids}")  # fmt: skip
        if fresh.result.token_ids == answers[i].result.token_ids:
            print(f"\nnot a failover fault, epd differs from llm for this image: {line}")
        else:
            problems.append(f"failover changed the answer: {line}")
    if max(times) >= deadline_s:
        problems.append(f"slowest request {max(times):.1f} s, deadline {deadline_s:g} s")
    if metric(pd, "epd_remote_encoder_failures", endpoint=address) <= failures_before:
        problems.append("no call to the killed encoder failed: the kill hit no encode")
    if _encoded_on(survivor) <= survivor_before:
        problems.append("the survivor encoded nothing")
    # The breaker opens on failed calls or failed readiness polls (3 in a row; polled every 2 s).
    opened = _wait_for(lambda: _metric_or_zero(pd, "epd_remote_encoder_breaker_opens", endpoint=address)
                       > opens_before, 20)  # fmt: skip
    if not opened:
        problems.append(f"the breaker of {address} did not open")
    retries = metric(pd, "epd_remote_encoder_retries")
    print(f"\nfailover {victim}: 64 requests, slowest {max(times):.2f} s, retries so far {retries:g}")
    before = _encoded_on(killed)
    rejoined = [with_note(synthetic_image(120, 96, 900 + i, "PNG"), note) for i in range(32)]
    deadline = time.monotonic() + 120
    for image in rejoined:  # about half of them have the restarted encoder as their home
        answer = stream_generate(pd.grpc_url, "epd", prompt, [image], sampling)
        if answer.error is not None:
            problems.append(f"after the restart: {answer.error}")
        if time.monotonic() > deadline or _encoded_on(killed) > before:
            break
        time.sleep(1.0)
    if _encoded_on(killed) <= before:
        problems.append(f"{address} did not rejoin")
    elif not _wait_for(lambda: metric(pd, "epd_remote_encoder_breaker_state", endpoint=address) == 0, 10):
        problems.append(f"{address} encodes again but its breaker is not closed")
    assert not problems, "\n".join(problems)


def test_with_no_encoder_left_each_request_gets_one_unavailable_error(topology: Topology) -> None:
    """Both encoders stopped: a ``pd`` server (no encoder models of its own) answers each request
    with one UNAVAILABLE error, at once, and keeps serving; both restarted, it encodes again."""
    pd, encoders = topology.pd, (topology.encoder_a, topology.encoder_b)
    note = f"none left {secrets.token_hex(8)}".encode()
    prompt, sampling = chat_prompt("What is this?", 1), {"max_tokens": 4, "temperature": 0.0}
    deadline_s = _deadline_s(pd)
    for server in encoders:
        os.killpg(server.group.pid, signal.SIGKILL)
    try:
        for i in range(4):
            started = time.monotonic()
            answer = stream_generate(pd.grpc_url, "epd", prompt, [synthetic_image(96, 96, 700 + i, "PNG")], sampling)
            elapsed = time.monotonic() - started
            # (A stream error carries no gRPC code; the code, UNAVAILABLE, is unit-tested.)
            assert answer.error is not None and "no encoder server could encode the image" in answer.error
            assert elapsed < deadline_s
        assert tokens_of(pd, "llm", chat_prompt("Still there?", 0), []).result.token_ids  # still serving
    finally:
        for name, server in zip(("a", "b"), encoders, strict=True):
            server.group.log_path = LOG_DIR / f"scaleout-encoder-{name}-after-none-left.log"
            server.start()
        for server in encoders:
            server.wait_ready(timeout_s=600)
    image = with_note(synthetic_image(100, 96, 800, "PNG"), note)
    assert _wait_for(lambda: stream_generate(pd.grpc_url, "epd", prompt, [image], sampling).error is None, 60)


def _wait_for(condition: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(1.0)
    return True


def _metric_or_zero(server: TritonServer, name: str, **labels: str) -> float:
    try:
        return metric(server, name, **labels)
    except AssertionError:  # not exported yet
        return 0.0


def _metric_or_none(server: TritonServer, name: str, **labels: str) -> float | None:
    try:
        return metric(server, name, **labels)
    except AssertionError:  # not exported (yet)
        return None


def _encoded_on(server: TritonServer) -> float:
    try:
        return metric(server, "nv_inference_request_success", model="encode")
    except AssertionError:  # not exported before its first request
        return 0.0

"""Signed tenant tokens on a real server (python_backends/request/tenants.py): tritonserver started
with ``TRITON_EPD_TENANT_SECRET_FILE`` (a 0600 file) serves ``epd`` only to requests whose
``tenant`` is a token signed with that secret.

A signed token works end to end: epd passes the tenant on to its encoder models re-signed (they
check it too), and the second request of the same image is a hit that encodes nothing. An
unsigned name and a forged token are INVALID_ARG, with a message that echoes neither, refused
while the parameters are parsed: the store's entries and every cache counter on /metrics stay
as they were. The encoder models refuse an unsigned tenant the same way. The server serves on
afterwards, tenants stay isolated, and neither the secret nor a token reaches the server log.

One server: the E|PD topology of tests/server/test_epd_split.py (the encoder models and ``epd``,
whose colocated engine gets every new image from the encoders by reference): one vLLM engine.
``llm`` reads no tenant and is not loaded.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from builders.launcher import prepare
from builders.repository import TARGETS
from builders.roles import role_models
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer
from client.epd_client import GrpcClient, chat_prompt
from python_backends.request.tenants import NOT_SIGNED, TENANT_SECRET_FILE_ENV, sign_tenant
from python_backends.store import EmbeddingStore, StoreConfig
from tests.images import synthetic_image, with_note
from tests.server.bad_input_cases import BadInput
from tests.server.conftest import LOG_DIR, NODE_DIR, SLOT, TEST_EXIT_TIMEOUT_S, serving
from tests.server.test_bad_inputs import send
from tests.server.test_cache import _counters

pytestmark = [pytest.mark.server, pytest.mark.timeout(1800)]

SECRET = secrets.token_urlsafe(32).encode()
RUN = secrets.token_hex(6)
TENANT_A, TENANT_B = f"tokens-a.{RUN}", f"tokens-b.{RUN}"  # dotted names: the last dot is the signature's
TOKEN_A, TOKEN_B = sign_tenant(SECRET, TENANT_A), sign_tenant(SECRET, TENANT_B)
FORGED = sign_tenant(b"another deployment's secret", TENANT_A)
GREEDY = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
NOTE = f"triton-epd test_tenant_tokens {RUN}".encode()
LOG = LOG_DIR / "tenant-tokens.log"
CACHE = dataclasses.replace(TARGETS["cpu"].cache, path=str(NODE_DIR / "tenant-tokens-embeddings"))


def fresh(seed: int) -> bytes:
    return with_note(synthetic_image(96, 64, seed=seed), NOTE)


@pytest.fixture(scope="module")
def server(model_dir: Path, node_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    secret_file = tmp_path_factory.mktemp("tenant-secret") / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    secret_file.chmod(0o600)
    repository = REPO_ROOT / "build" / "test-slots" / f"tenant-tokens-{SLOT}"
    prepare("cpu", model_dir, repository, cache=CACHE, kv_store_path=str(NODE_DIR / "tenant-tokens-kv"),
            colocated_encodes="encoders")  # fmt: skip
    models = (*role_models(TARGETS["cpu"], "encoder"), "epd")
    options = ServerOptions(
        repository, Ports.free(), exit_timeout_s=TEST_EXIT_TIMEOUT_S,
        extra_args=("--model-control-mode=explicit", *(f"--load-model={m}" for m in models)),
        extra_env={TENANT_SECRET_FILE_ENV: str(secret_file)},
    )  # fmt: skip
    with serving(options, LOG) as running:
        yield running
    log = LOG.read_text(errors="replace")
    leaked = [name for name, text in [("the secret", SECRET.decode()), ("a token", TOKEN_A.rpartition(".")[2]),
                                      ("a token", TOKEN_B.rpartition(".")[2])] if text in log]  # fmt: skip
    assert not leaked, f"{leaked} reached the server log"


def encodes(server: TritonServer) -> float:
    """Encodes done by every encoder model so far (``epd_cache_encodes``)."""
    return sum(v for (name, model), v in _counters(server).items() if name == "epd_cache_encodes")


def generate(server: TritonServer, image: bytes, tenant: str) -> tuple[int, float]:
    """(the request's cache_hits, encodes it caused)."""
    client = GrpcClient(server.grpc_url, "epd")
    before = encodes(server)
    try:
        result = client.generate(chat_prompt("Whose is it?", 1), [image], GREEDY, parameters={"tenant": tenant})
    finally:
        client.close()
    return result.cache_hits or 0, encodes(server) - before


def store_state(server: TritonServer) -> tuple[dict, int]:
    """Every cache counter and store gauge on /metrics (``epd_cache_*``, ``epd_store_*``), and the
    store's entries read directly. After a pause: epd refreshes the gauges every second."""
    time.sleep(1.5)
    counters = {key: v for key, v in _counters(server).items() if key[0].startswith(("epd_cache_", "epd_store_"))}
    with EmbeddingStore(StoreConfig(path=CACHE.path, capacity_bytes=CACHE.capacity_bytes, merge_size=2)) as store:
        entries = store.metrics()["entries"]
    return counters, entries


def encoder_error(server: TritonServer, image: bytes, tenant: str) -> tuple[str, str]:
    """(code, message) of ``encoder_0``'s answer to a direct request for ``tenant`` ("none": accepted)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        inputs = []
        for name, dtype, array in [("image", "BYTES", np.array([image], np.object_)),
                                   ("errors_as_outputs", "BOOL", np.array([True]))]:  # fmt: skip
            item = grpcclient.InferInput(name, list(array.shape), dtype)
            item.set_data_from_numpy(array)
            inputs.append(item)
        client.async_stream_infer("encoder_0", inputs, parameters={"tenant": tenant})
        result, error = answers.get(timeout=300)
        assert error is None, error
        payload = result.as_numpy("error")
        if payload is None:
            return "none", ""
        fields = json.loads(payload.reshape(-1)[0])
        return fields["code"], fields["message"]
    finally:
        client.stop_stream()
        client.close()


def test_a_signed_tenant_is_served_and_its_repeat_is_a_hit(server):
    image = fresh(9301)
    assert generate(server, image, TOKEN_A) == (0, 1)  # encoded by an encoder model, which took the re-signed tenant
    assert generate(server, image, TOKEN_A) == (1, 0)  # the same tenant's repeat: a hit, no encode


REFUSED = {
    "unsigned name": TENANT_A,
    "forged token": FORGED,
    "cut signature": TOKEN_A[:-1],
    "another tenant's signature": f"{TENANT_A}.{TOKEN_B.rpartition('.')[2]}",
}


@pytest.mark.parametrize("tenant", list(REFUSED.values()), ids=list(REFUSED))
def test_an_unsigned_or_forged_tenant_is_invalid_arg_and_leaves_the_store_unchanged(server, tenant):
    image = fresh(9302)  # new to the store: any encode or lookup would show
    before = store_state(server)
    code, message, who = send(server, BadInput("tenant", "-", "", images=(image,), parameters={"tenant": tenant}))
    assert (code, message, who) == ("INVALID_ARG", NOT_SIGNED, "epd")
    assert RUN not in message and tenant.rpartition(".")[2] not in message
    assert store_state(server) == before  # no entry, no lookup, no encode, no lease


def test_encoder_models_refuse_an_unsigned_tenant_and_take_a_signed_one(server):
    image = fresh(9303)
    before = store_state(server)
    assert encoder_error(server, image, TENANT_B) == ("INVALID_ARG", NOT_SIGNED)
    assert store_state(server) == before
    assert encoder_error(server, image, TOKEN_B) == ("none", "")  # encoded for tenant B


def test_the_server_serves_on_and_tenants_stay_isolated(server):
    image = fresh(9304)
    assert generate(server, image, TOKEN_A) == (0, 1)
    assert generate(server, image, TOKEN_B) == (0, 1)  # B gets no hit on A's image
    assert generate(server, image, TOKEN_B) == (1, 0)

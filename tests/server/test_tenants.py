"""Tenants on the real server (the session server: the cpu target's ``isolated`` tenant policy).

Tenant B sending tenant A's image gets no hit and no faster answer: the request is a miss that
encodes (the encoders' encode counter rises by one) exactly as for an image no one ever sent; B's
``mm_hash:`` reference to A's image gets the byte-identical code and message of an unknown hash.
Timing is not asserted here (a timing script was written, never run and deleted:
docs/benchmarks/investigations.md). Also: the store's files are the owner's only and its
reference secret never reaches the server log.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

import pytest

from builders.tritonserver import TritonServer
from client.epd_client import GrpcClient, chat_prompt
from tests.images import synthetic_image, with_note
from tests.server.bad_input_cases import UNKNOWN_HASH, BadInput
from tests.server.conftest import CACHE_POLICY, DISAGGREGATED, LOG_DIR, open_node_store
from tests.server.test_bad_inputs import send
from tests.server.test_cache import _counters

pytestmark = [
    pytest.mark.server,
]

GREEDY = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
NOTE = f"triton-epd test_tenants {secrets.token_hex(8)}".encode()


def fresh(seed: int) -> bytes:
    return with_note(synthetic_image(96, 64, seed=seed), NOTE)


def encodes(server: TritonServer) -> float:
    """Encodes done by every encoder model so far (``epd_cache_encodes``)."""
    return sum(v for (name, model), v in _counters(server).items() if name == "epd_cache_encodes")


def generate(server: TritonServer, images: list[bytes], tenant: str | None) -> tuple[int, float]:
    """(the request's cache_hits, encodes it caused)."""
    client = GrpcClient(server.grpc_url, "epd")
    before = encodes(server)
    try:
        parameters = {**DISAGGREGATED, "tenant": tenant} if tenant else DISAGGREGATED
        result = client.generate(chat_prompt("Whose is it?", len(images)), images, GREEDY, parameters=parameters)
    finally:
        client.close()
    return result.cache_hits, encodes(server) - before


def test_tenant_b_gets_no_hit_for_tenant_a_image_it_encodes_like_a_new_image(server):
    image, never_seen = fresh(9101), fresh(9102)
    assert generate(server, [image], "tenant-a") == (0, 1)  # A's first request encodes
    assert generate(server, [image], "tenant-a") == (1, 0)  # A's repeat is a hit, no encode
    # B: A's image is the same miss as an image no one sent.
    assert generate(server, [image], "tenant-b") == generate(server, [never_seen], "tenant-b") == (0, 1)
    assert generate(server, [image], "tenant-b") == (1, 0)  # B's own entry now
    assert generate(server, [image], None) == (0, 1)  # requests without a tenant: their own space


def test_mm_hash_of_another_tenant_reads_exactly_like_an_unknown_hash(server):
    client = GrpcClient(server.grpc_url, "epd")
    try:
        [mm_hash] = client.warm_up([fresh(9201)], tenant="tenant-a")
        own = client.generate(chat_prompt("Mine?", 1), [f"mm_hash:{mm_hash}".encode()], GREEDY,
                              parameters={"tenant": "tenant-a"})
    finally:
        client.close()
    assert own.cache_hits == 1

    def by_hash(hex_hash: str, tenant: str | None) -> tuple[str, str, str]:
        params = {"tenant": tenant} if tenant else {}
        return send(server, BadInput("by hash", "-", "", images=(f"mm_hash:{hex_hash}".encode(),), parameters=params))

    other = by_hash(mm_hash, "tenant-b")
    assert other == by_hash(UNKNOWN_HASH, "tenant-b") == by_hash(mm_hash, None)
    code, message, _ = other
    assert code == "NOT_FOUND" and mm_hash[:16] not in message and "tenant" not in message


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_store_files_are_private_and_the_secret_is_never_logged(server):
    store_dir = Path(CACHE_POLICY.path)
    assert _mode(store_dir) == 0o700
    assert {p.name: _mode(p) for p in store_dir.iterdir()} == {"data.mdb": 0o600, "lock.mdb": 0o600}
    with open_node_store() as store:
        secret = store.secret
    log = (LOG_DIR / "server.log").read_bytes()
    assert secret.hex().encode() not in log and secret not in log

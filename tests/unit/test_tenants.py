"""Tenants scope cache keys and mm_hash references (python_backends/request/tenants.py, store/keys.py),
through the real epd pipeline and encoder logic on a real temporary store (scripted stages).
The server-level proof is tests/server/test_tenants.py."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from python_backends.encode.cached import CachedEncoder
from python_backends.epd.pipeline import EpdPipeline
from python_backends.errors import EpdError, ErrorCode
from python_backends.request.generate import CachedImage
from python_backends.request.parameters import RequestParameters
from python_backends.request.tenants import (
    MAX_TENANT_CHARS,
    check_tenant,
    key_space,
)
from python_backends.store import EmbeddingStore, StoreConfig, tenant_key
from tests.unit.test_epd_pipeline import ENCODERS, KEYS, FakeStages, request


@pytest.fixture
def store() -> Iterator[EmbeddingStore]:
    path = tempfile.mkdtemp(prefix="epd-tenants-test-")
    with EmbeddingStore(StoreConfig(path=path, capacity_bytes=1 << 20, merge_size=2)) as opened:
        yield opened
    shutil.rmtree(path, ignore_errors=True)


def pipeline_for(stages: FakeStages, policy: str = "isolated") -> EpdPipeline:
    for encoder in stages.encoders.values():
        encoder.tenant_policy = policy
    return EpdPipeline(stages.store, stages, KEYS, ENCODERS, tenant_policy=policy)


def run(pipeline: EpdPipeline, images: list, tenant: str | None):
    async def go():
        return [chunk async for chunk in pipeline.run(request(images), "r", None, tenant)]

    return asyncio.run(go())


def not_found(pipeline: EpdPipeline, mm_hash: str, tenant: str | None) -> tuple[ErrorCode, str]:
    with pytest.raises(EpdError) as info:
        run(pipeline, [CachedImage(mm_hash)], tenant)
    return info.value.code, info.value.message


def test_tenant_key_is_the_key_without_a_tenant_and_differs_per_tenant():
    key = KEYS.key(b"img")
    assert tenant_key(key, None) == key
    scoped = {tenant_key(key, t) for t in ("a", "b", "ab", "")}
    assert len(scoped) == 4 and key not in scoped
    # Length-prefixed framing: tenant "a" + key "bc.." never equals tenant "ab" + key "c..".
    assert tenant_key("bc" + key[2:], "a") != tenant_key("c" + key[2:], "ab")


def test_isolated_tenant_b_misses_tenant_a_image_and_encodes_it_again(store):
    stages = FakeStages(store)
    pipeline = pipeline_for(stages)
    first = run(pipeline, [b"img-a"], "tenant-a")
    again = run(pipeline, [b"img-a"], "tenant-a")
    other = run(pipeline, [b"img-a"], "tenant-b")
    untenanted = run(pipeline, [b"img-a"], None)
    assert [first[-1].cache_hits, again[-1].cache_hits, other[-1].cache_hits, untenanted[-1].cache_hits] == [0, 1, 0, 0]
    assert stages.encoded == [b"img-a"] * 3  # a, then b and "no tenant" each encode their own
    assert store.metrics()["entries"] == 3 and store.metrics()["active_leases"] == 0


def test_isolated_mm_hash_of_another_tenant_reads_exactly_like_an_unknown_hash(store):
    stages = FakeStages(store)
    pipeline = pipeline_for(stages)
    [answer] = asyncio.run(stages.encoders["encoder_0"].references([b"img-a"], None, "tenant-a"))
    mm_hash = answer.client_mm_hash
    assert mm_hash == KEYS.key(b"img-a")  # the client sees the unscoped key ...
    assert answer.reference.mm_hash == tenant_key(mm_hash, "tenant-a")  # ... the store the scoped one
    assert run(pipeline, [CachedImage(mm_hash)], "tenant-a")[-1].cache_hits == 1
    unknown = KEYS.key(b"never sent")
    assert not_found(pipeline, mm_hash, "tenant-b") == not_found(pipeline, unknown, "tenant-b")
    assert not_found(pipeline, mm_hash, None) == not_found(pipeline, unknown, None)
    code, message = not_found(pipeline, mm_hash, "tenant-b")
    assert code is ErrorCode.NOT_FOUND and mm_hash[:16] not in message and "tenant" not in message


def test_shared_policy_lets_tenants_meet_every_entry(store):
    stages = FakeStages(store)
    pipeline = pipeline_for(stages, "shared")
    run(pipeline, [b"img-a"], "tenant-a")
    assert run(pipeline, [b"img-a"], "tenant-b")[-1].cache_hits == 1
    assert run(pipeline, [CachedImage(KEYS.key(b"img-a"))], None)[-1].cache_hits == 1
    assert stages.encoded == [b"img-a"]


def test_encoder_keys_follow_the_policy(store):
    isolated = CachedEncoder(store, KEYS, lambda image: None)  # type: ignore[arg-type, return-value]
    shared = CachedEncoder(store, KEYS, lambda image: None, tenant_policy="shared")  # type: ignore[arg-type, return-value]
    assert isolated.key(b"x", "t") == tenant_key(KEYS.key(b"x"), "t") != isolated.key(b"x", None)
    assert shared.key(b"x", "t") == shared.key(b"x", None) == KEYS.key(b"x")
    with pytest.raises(ValueError, match="tenant policy"):
        CachedEncoder(store, KEYS, lambda image: None, tenant_policy="open")  # type: ignore[arg-type, return-value]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (7, "must be a string, got int"),
        (True, "must be a string, got bool"),
        ("", "1 to 256 characters, got 0"),
        ("x" * (MAX_TENANT_CHARS + 1), "1 to 256 characters, got 257"),
        ("a\nb", "must not contain control characters"),
    ],
)
def test_bad_tenants_are_invalid_arg_without_echoing_the_value(value, message):
    with pytest.raises(EpdError, match=message) as info:
        RequestParameters.parse(json.dumps({"tenant": value}))
    assert info.value.code is ErrorCode.INVALID_ARG


def test_tenant_parameters():
    assert RequestParameters.parse(None).tenant is None
    assert RequestParameters.parse('{"encoder": "encoder_0"}').tenant is None
    assert RequestParameters.parse('{"tenant": "acme@example.com"}').tenant == "acme@example.com"
    assert check_tenant("ünïcode tenant") == "ünïcode tenant"
    assert key_space("t", "isolated") == "t" and key_space("t", "shared") is None

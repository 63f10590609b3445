"""Signed tenant tokens (python_backends/request/tenants.py): with a tenant secret
(``TRITON_EPD_TENANT_SECRET_FILE``) the ``tenant`` request parameter must be ``TENANT.SIGNATURE``
signed with it; anything else is INVALID_ARG that echoes nothing. epd passes the tenant on to its
encoders (BLS, remote encoder servers) re-signed, so that they accept it; the OpenAI server and
``triton-epd-client sign-tenant`` sign with the same secret. Without the variable, tenants are
plain names as before. The server-level proof is tests/server/test_tenant_tokens.py."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from python_backends import contract
from python_backends.encode.cached import CachedEncoder
from python_backends.errors import EpdError, ErrorCode
from python_backends.request import tenants
from python_backends.request.parameters import RequestParameters
from python_backends.request.tenants import (
    NOT_SIGNED,
    TENANT_SECRET_FILE_ENV,
    TOKEN_CONTEXT,
    TenantSecretError,
    check_tenant,
    read_tenant_secret,
    sign_tenant,
    tenant_parameter,
    tenant_secret,
    verify_tenant,
)
from python_backends.store import EmbeddingStore, StoreConfig

SECRET = b"s3cret-of-this-deployment-0123456789"
OTHER_SECRET = b"s3cret-of-another-deployment-987654"


def secret_file(folder: Path, content: bytes = SECRET, mode: int = 0o600, name: str = "tenant-secret") -> Path:
    path = folder / name
    path.write_bytes(content)
    path.chmod(mode)
    return path


@pytest.fixture(autouse=True)
def fresh_secret_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No secret unless a test sets one; the per-process cache emptied around each test."""
    monkeypatch.delenv(TENANT_SECRET_FILE_ENV, raising=False)
    tenants._secret_at.cache_clear()
    yield
    tenants._secret_at.cache_clear()


@pytest.fixture
def with_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> bytes:
    monkeypatch.setenv(TENANT_SECRET_FILE_ENV, str(secret_file(tmp_path)))
    return SECRET


def refusal(value: Any) -> EpdError:
    with pytest.raises(EpdError) as info:
        RequestParameters.parse(json.dumps({"tenant": value}))
    return info.value


# --------------------------------------------------------------------------- tokens


def test_a_token_is_the_tenant_and_its_unpadded_base64url_hmac_sha256():
    token = sign_tenant(SECRET, "acme")
    mac = hmac.new(SECRET, TOKEN_CONTEXT + b"acme", hashlib.sha256).digest()
    assert token == "acme." + base64.urlsafe_b64encode(mac).decode().rstrip("=")
    assert len(token) == len("acme.") + 43 and "=" not in token
    assert verify_tenant(SECRET, token) == "acme"


@pytest.mark.parametrize("tenant", ["acme", "acme.corp.eu", "a.", ".a", "ünïcode tenant", "x" * 256, "a b"])
def test_sign_verify_round_trip_also_for_dotted_names(tenant):
    assert verify_tenant(SECRET, sign_tenant(SECRET, tenant)) == tenant


def test_a_dotted_name_is_not_a_token_of_its_prefix():
    token = sign_tenant(SECRET, "acme")
    with pytest.raises(EpdError, match=NOT_SIGNED):
        verify_tenant(SECRET, "acme.corp." + token.rpartition(".")[2])  # acme's signature on "acme.corp"


def forged(token: str) -> str:
    last = token[-1]
    return token[:-1] + ("A" if last != "A" else "B")


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("acme", id="no signature: a plain name"),
        pytest.param("acme.", id="empty signature"),
        pytest.param(forged(sign_tenant(SECRET, "acme")), id="forged signature"),
        pytest.param("acme." + sign_tenant(SECRET, "other").rpartition(".")[2], id="another tenant's signature"),
        pytest.param(sign_tenant(OTHER_SECRET, "acme"), id="another deployment's secret"),
        pytest.param(sign_tenant(SECRET, "acme") + "=", id="padded base64"),
        pytest.param("acme.!!!not-base64!!!", id="bad base64"),
        pytest.param("acme." + "é" * 43, id="non-ascii signature"),
        pytest.param("acme.\udc80", id="lone surrogate signature"),
        pytest.param("acme." + base64.b64encode(hmac.new(SECRET, TOKEN_CONTEXT + b"acme", hashlib.sha256).digest())
                     .decode(), id="standard base64 with padding"),  # fmt: skip
        pytest.param(sign_tenant(SECRET, "acme").replace("acme", "ACME"), id="the name changed"),
    ],
)
def test_unsigned_or_forged_tenants_are_invalid_arg_without_echoing_anything(with_secret, value):
    error = refusal(value)
    assert error.code is ErrorCode.INVALID_ARG and error.message == NOT_SIGNED
    assert "not a tenant signed by this deployment" in error.message
    signature = value.rpartition(".")[2]
    assert "acme" not in error.message.lower() and (not signature or signature not in error.message)


def test_a_signed_token_names_its_tenant_and_the_name_is_still_checked(with_secret):
    assert RequestParameters.parse(json.dumps({"tenant": sign_tenant(SECRET, "acme.corp")})).tenant == "acme.corp"
    assert check_tenant(sign_tenant(SECRET, "ünïcode")) == "ünïcode"
    for bad, message in [("", "1 to 256 characters, got 0"), ("x" * 257, "got 257"), ("a\nb", "control characters"),
                         ("a\ud800", "control characters")]:  # fmt: skip
        with pytest.raises(EpdError, match=message):
            check_tenant(sign_tenant(SECRET, bad))
    assert refusal(7).message.endswith("must be a string, got int")


def test_without_a_secret_tenants_are_plain_names_as_before():
    assert tenant_secret() is None
    assert RequestParameters.parse('{"tenant": "acme"}').tenant == "acme"
    token = sign_tenant(SECRET, "acme")
    assert check_tenant(token) == token  # just a name that holds a dot
    assert tenant_parameter("acme") == "acme"


# --------------------------------------------------------------------------- the secret file


def test_the_secret_is_read_once_per_process(tmp_path, monkeypatch):
    path = secret_file(tmp_path, b"  " + SECRET + b"\n")  # surrounding whitespace is no part of it
    monkeypatch.setenv(TENANT_SECRET_FILE_ENV, str(path))
    assert tenant_secret() == SECRET
    path.write_bytes(OTHER_SECRET)
    assert tenant_secret() == SECRET  # cached: a new secret needs a restart
    assert read_tenant_secret(path) == OTHER_SECRET


@pytest.mark.parametrize(
    ("content", "mode", "message"),
    [
        (SECRET, 0o644, r"its group or others may access it \(mode 644\); chmod 600 it"),
        (SECRET, 0o640, r"its group or others may access it \(mode 640\)"),
        (SECRET, 0o604, r"its group or others may access it \(mode 604\)"),
        (SECRET, 0o620, r"its group or others may access it \(mode 620\)"),
        (b"", 0o600, "is empty"),
        (b" \n", 0o600, "is empty"),
        (b"short", 0o400, "holds 5 bytes, needs at least 16"),
    ],
)
def test_a_secret_file_that_others_may_read_or_that_is_empty_is_refused(tmp_path, monkeypatch, content, mode, message):
    path = secret_file(tmp_path, content, mode)
    with pytest.raises(TenantSecretError, match=message):
        read_tenant_secret(path)
    monkeypatch.setenv(TENANT_SECRET_FILE_ENV, str(path))
    with pytest.raises(TenantSecretError, match=f"{TENANT_SECRET_FILE_ENV}: tenant secret file .*{message}") as info:
        tenant_secret()
    assert content.strip().decode() not in str(info.value) or not content.strip()


def test_a_missing_file_or_an_empty_variable_is_refused(tmp_path, monkeypatch):
    with pytest.raises(TenantSecretError, match="cannot be read: No such file or directory"):
        read_tenant_secret(tmp_path / "none")
    monkeypatch.setenv(TENANT_SECRET_FILE_ENV, "")
    with pytest.raises(TenantSecretError, match="is set but names no file"):
        tenant_secret()


@pytest.fixture
def store() -> Iterator[EmbeddingStore]:
    path = tempfile.mkdtemp(prefix="epd-tenant-tokens-test-")
    with EmbeddingStore(StoreConfig(path=path, capacity_bytes=1 << 20, merge_size=2)) as opened:
        yield opened
    shutil.rmtree(path, ignore_errors=True)


def test_models_refuse_a_bad_secret_file_at_load(tmp_path, monkeypatch, store):
    from python_backends.epd.references import ImageReferences
    from tests.unit.test_epd_pipeline import KEYS

    monkeypatch.setenv(TENANT_SECRET_FILE_ENV, str(secret_file(tmp_path, mode=0o644)))
    with pytest.raises(TenantSecretError, match="chmod 600"):  # every encoder model
        CachedEncoder(store, KEYS, lambda image: None)  # type: ignore[arg-type, return-value]
    with pytest.raises(TenantSecretError, match="chmod 600"):  # epd
        ImageReferences(store, KEYS, ["encoder_0"], None)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- epd -> encoders


def test_epd_passes_the_tenant_on_re_signed_and_the_encoder_accepts_it(with_secret):
    assert RequestParameters.parse(json.dumps({"tenant": tenant_parameter("acme.corp")})).tenant == "acme.corp"
    assert tenant_parameter("acme") == sign_tenant(SECRET, "acme")


def test_bls_sends_the_encoder_the_signed_tenant(with_secret):
    from python_backends.triton_edge.bls import BlsStages

    stages = BlsStages("prefill", "decode", max_threads=1)
    sent: list[Any] = []

    async def last(model: str, inputs: list[Any], parameters: Any = None) -> dict[str, Any]:
        sent.append(parameters)
        return {contract.REFERENCES: np.array([b"ref"], np.object_), contract.CACHE_HIT: np.array([False])}

    stages._last = last  # type: ignore[method-assign]
    asyncio.run(stages.encode_reference("encoder_0", b"img", 1, "acme.corp"))
    asyncio.run(stages.encode_reference("encoder_0", b"img", 1, None))
    assert sent[1] is None
    assert RequestParameters.parse(json.dumps(sent[0])).tenant == "acme.corp"  # as encoder_0 parses it


def test_remote_encoder_servers_get_the_signed_tenant_on_both_paths(with_secret, tmp_path, monkeypatch):
    from python_backends.scaleout import remote as remote_module
    from python_backends.scaleout import wire
    from tests.unit.test_remote_encoders import FakeEncoderServer, remote_for

    # The fakes read the raw bytes off the inputs (test_remote_encoders.raw_inputs does the same).
    monkeypatch.setattr(wire, "image_input", lambda image: type("Input", (), {"_raw_image": image})())
    monkeypatch.setattr(wire, "lease_input", lambda owner: type("Input", (), {"_raw_owner": owner})())
    sent: list[dict[str, Any]] = []
    call = remote_module._call

    async def recording(server: Any, inputs: Any, parameters: Any, timeout_s: float, ends: Any) -> Any:
        sent.append(dict(parameters))
        return await call(server, inputs, parameters, timeout_s, ends)

    monkeypatch.setattr(remote_module, "_call", recording)
    pd_store = EmbeddingStore(StoreConfig(path=str(tmp_path / "pd"), capacity_bytes=1 << 24, merge_size=2))
    pd_store.path = str(tmp_path / "pd")  # type: ignore[attr-defined]
    try:
        other_node = FakeEncoderServer(params={contract.NODE_ID: "node-b", contract.STORE_PATH: "/elsewhere"})
        same_store = FakeEncoderServer(
            params={contract.NODE_ID: "node-a", contract.STORE_PATH: pd_store.path}, shared=pd_store  # type: ignore[attr-defined]
        )
        for servers in ({"b:1": other_node}, {"a:1": same_store}):
            remote = remote_for(pd_store, servers)  # type: ignore[arg-type]

            async def once(remote: Any = remote) -> tuple[bytes, bool]:
                await remote.refresh()
                return await remote.encode_reference(b"image " + os.urandom(4), 7, "acme.corp")  # type: ignore[no-any-return]

            wire, _ = asyncio.run(once())
            pd_store.release(pd_store.parse_reference(wire))
    finally:
        pd_store.close()
    tenanted = [parameters for parameters in sent if contract.TENANT in parameters]
    assert len(tenanted) == 2 and tenanted[0].get(contract.BY_VALUE) is True  # by value, then by reference
    for parameters in tenanted:
        assert parameters[contract.TENANT] == sign_tenant(SECRET, "acme.corp")
        assert RequestParameters.parse(json.dumps(parameters)).tenant == "acme.corp"  # as encoder_0 parses it


# --------------------------------------------------------------------------- front ends


def test_the_openai_server_signs_the_tenant_it_sends():
    from fastapi.testclient import TestClient

    from builders.default_model import build_default_model
    from client.openai_server.app import create_app
    from client.openai_server.prompt import ChatRenderer, MediaPolicy
    from tests.unit.test_openai_app import FakeBackend, chat

    renderer = ChatRenderer.from_checkpoint(build_default_model(), MediaPolicy())
    backend = FakeBackend()
    with TestClient(create_app(backend, renderer, tenant_secret=SECRET), raise_server_exceptions=False) as http:
        for headers, body in [({"X-Tenant": "acme.corp"}, chat()), ({}, chat(user="end-user-7")), ({}, chat())]:
            assert http.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
    assert [call.parameters for call in backend.calls] == [
        {"tenant": sign_tenant(SECRET, "acme.corp")}, {"tenant": sign_tenant(SECRET, "end-user-7")}, None
    ]


def test_the_openai_server_reads_its_flag_else_the_variable(tmp_path, capsys):
    from client.openai_server.__main__ import parse_args, tenant_secret_from

    flag, env = secret_file(tmp_path, SECRET, name="flag"), secret_file(tmp_path, OTHER_SECRET, name="env")
    base = ["--model-dir", str(tmp_path)]
    assert tenant_secret_from(parse_args(base), {}) is None
    assert tenant_secret_from(parse_args(base), {TENANT_SECRET_FILE_ENV: str(env)}) == OTHER_SECRET
    both = parse_args([*base, "--tenant-secret-file", str(flag)])
    assert tenant_secret_from(both, {TENANT_SECRET_FILE_ENV: str(env)}) == SECRET
    assert SECRET.decode() not in capsys.readouterr().err
    env.chmod(0o644)
    with pytest.raises(TenantSecretError, match="chmod 600"):
        tenant_secret_from(parse_args(base), {TENANT_SECRET_FILE_ENV: str(env)})
    with pytest.raises(TenantSecretError, match="names no file"):
        tenant_secret_from(parse_args(base), {TENANT_SECRET_FILE_ENV: ""})


def test_the_client_cli_prints_a_signed_token(tmp_path, capsys):
    from client.cli import main

    path = secret_file(tmp_path)
    assert main(["sign-tenant", "--secret-file", str(path), "acme.corp"]) == 0
    token = capsys.readouterr().out.strip()
    assert token == sign_tenant(SECRET, "acme.corp") and verify_tenant(SECRET, token) == "acme.corp"
    path.chmod(0o644)
    assert main(["sign-tenant", "--secret-file", str(path), "acme"]) == 2
    assert "chmod 600" in capsys.readouterr().err

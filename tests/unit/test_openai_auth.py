"""API keys on the OpenAI app (``client/openai_server/auth.py``), against the scripted backend.

Without keys the API is open; with keys, every route but ``/health`` answers 401 in OpenAI's
error shape to no key, a wrong key or another scheme, and serves the right key. The keys file
names each key's tenant, which reaches Triton as the ``tenant`` parameter whatever the
``X-Tenant`` header or ``user`` say; the file is re-read when it changes (a removed key is
refused at once, an added one served) and on SIGHUP; every configured key is compared with
``hmac.compare_digest``. Also: the keys file's format and mode checks, where the keys come
from (command line, then ``TRITON_EPD_API_KEY``, then ``VLLM_API_KEY``), and how
``triton-epd-serve`` passes them on.
"""

from __future__ import annotations

import hmac
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from builders.default_model import build_default_model
from builders.launcher import openai_app
from builders.launcher import parse_args as launcher_args
from builders.tritonserver import Ports, ServerOptions, TritonServer
from client.openai_server import __main__ as server_main
from client.openai_server import auth
from client.openai_server.app import create_app
from client.openai_server.auth import ApiKeys, KeysError, check_file_mode, configured_keys, parse_keys_file
from client.openai_server.demo import default_api_key
from client.openai_server.prompt import ChatRenderer, MediaPolicy
from tests.unit.test_openai_app import FakeBackend, chat

KEY_A, KEY_B, SHARED = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210", "sk-shared-key-5555"
WRONG = "sk-tenant-a-0123456780"  # one character off KEY_A


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer.from_checkpoint(build_default_model(), MediaPolicy())


def write_keys(path: Path, text: str, mode: int = 0o600) -> Path:
    """Replace ``path`` atomically, as the docs ask (a new inode: the change is seen at once)."""
    fresh = path.with_name(path.name + ".new")
    fresh.write_text(text)
    fresh.chmod(mode)
    os.replace(fresh, path)
    return path


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    return write_keys(tmp_path / "keys", f"# key tenant\n{KEY_A} tenant-a\n\n{KEY_B}   tenant-b\n")


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def keys(keys_file: Path) -> ApiKeys:
    return ApiKeys([SHARED], keys_file)


@pytest.fixture
def http(backend: FakeBackend, renderer: ChatRenderer, keys: ApiKeys) -> Iterator[TestClient]:
    with TestClient(create_app(backend, renderer, keys), raise_server_exceptions=False) as client:
        yield client


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def tenants(backend: FakeBackend) -> list[Any]:
    return [(call.parameters or {}).get("tenant") for call in backend.calls]


# (method, path, body, status with a right key)
ROUTES = [
    ("GET", "/v1/models", None, 200),
    ("POST", "/v1/chat/completions", chat(), 200),
    ("GET", "/openapi.json", None, 200),
    ("GET", "/docs", None, 200),
    ("GET", "/redoc", None, 200),
    ("GET", "/docs/oauth2-redirect", None, 200),
    ("GET", "/no/such/route", None, 404),
]
MISSING = "You didn't provide an API key"


@pytest.mark.parametrize(("method", "path", "body", "_ok"), ROUTES, ids=[route[1] for route in ROUTES])
@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({}, MISSING),
        ({"Authorization": ""}, MISSING),
        (bearer(WRONG), "Incorrect API key provided."),
        (bearer(""), "Incorrect API key provided."),
        ({"Authorization": KEY_A}, "Incorrect API key provided."),  # no scheme
        ({"Authorization": f"Basic {KEY_A}"}, "Incorrect API key provided."),
        (bearer(KEY_A + " extra"), "Incorrect API key provided."),
    ],
    ids=["no-header", "empty-header", "wrong-key", "empty-key", "no-scheme", "basic", "key-and-more"],
)
def test_every_route_but_health_refuses_a_missing_or_wrong_key_in_openais_shape(
    http: TestClient, backend: FakeBackend, method, path, body, _ok, headers, message
):
    response = http.request(method, path, json=body, headers=headers)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["message"].startswith(message) and KEY_A not in error["message"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, "invalid_api_key")
    assert response.headers["www-authenticate"] == "Bearer"
    assert backend.calls == []  # nothing reached Triton


@pytest.mark.parametrize(("method", "path", "body", "ok"), ROUTES, ids=[route[1] for route in ROUTES])
@pytest.mark.parametrize("key", [KEY_A, KEY_B, SHARED])
def test_every_route_serves_a_right_key(http: TestClient, method, path, body, ok, key):
    assert http.request(method, path, json=body, headers=bearer(key)).status_code == ok
    # the scheme's case and spaces around the key do not matter (RFC 6750 bearer, as vLLM reads it)
    assert http.request(method, path, json=body, headers={"Authorization": f"bearer  {key} "}).status_code == ok


@pytest.mark.parametrize("headers", [{}, bearer(WRONG), bearer(KEY_A)])
def test_health_stays_open(http: TestClient, headers):
    assert http.get("/health", headers=headers).status_code == 200
    assert http.head("/health", headers=headers).status_code in (200, 405)  # never 401


def test_the_openai_client_gets_an_authentication_error_without_the_right_key(http: TestClient):
    wrong = openai.OpenAI(base_url="http://testserver/v1", api_key=WRONG, http_client=http, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.models.list()
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="llm", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="llm", messages=[{"role": "user", "content": "hi"}], stream=True)
    right = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY_A, http_client=http, max_retries=0)
    assert [model.id for model in right.models.list()] == ["epd", "llm"]
    answer = right.chat.completions.create(model="llm", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content == "Hello!"
    stream = right.chat.completions.create(model="llm", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == "Hello!"


def test_without_keys_the_api_is_open_and_the_header_names_the_tenant(backend: FakeBackend, renderer):
    with TestClient(create_app(backend, renderer, ApiKeys()), raise_server_exceptions=False) as http:
        assert http.get("/v1/models").status_code == 200
        assert http.get("/v1/models", headers=bearer("anything")).status_code == 200
        assert http.post("/v1/chat/completions", json=chat(), headers={"X-Tenant": "acme"}).status_code == 200
    assert tenants(backend) == ["acme"]


@pytest.mark.parametrize(
    ("key", "tenant"),
    [(KEY_A, "tenant-a"), (KEY_B, "tenant-b"), (SHARED, None)],  # an --api-key key: the shared space
)
def test_the_tenant_is_the_keys_whatever_the_header_or_user_say(http: TestClient, backend: FakeBackend, key, tenant):
    for headers, body in [
        ({}, chat()),
        ({"X-Tenant": "tenant-b" if key == KEY_A else "tenant-a"}, chat()),
        ({}, chat(user="tenant-a" if key == KEY_B else "tenant-b")),
        ({"X-Tenant": "someone-else"}, chat(user="another")),
    ]:
        assert http.post("/v1/chat/completions", json=body, headers={**bearer(key), **headers}).status_code == 200
    assert tenants(backend) == [tenant] * 4
    if tenant is None:  # no tenant parameter at all, as for untenanted requests
        assert all(call.parameters is None for call in backend.calls)


def test_a_key_removed_from_the_file_is_refused_at_once_and_an_added_one_served(
    http: TestClient, backend: FakeBackend, keys_file: Path
):
    post = lambda key: http.post("/v1/chat/completions", json=chat(), headers=bearer(key)).status_code  # noqa: E731
    assert (post(KEY_A), post(KEY_B)) == (200, 200)
    write_keys(keys_file, f"{KEY_B} tenant-b\nsk-new-key-42 tenant-c\n")
    assert (post(KEY_A), post(KEY_B), post("sk-new-key-42")) == (401, 200, 200)
    assert http.get("/v1/models", headers=bearer(KEY_A)).status_code == 401
    write_keys(keys_file, f"{KEY_B} tenant-moved\n")  # a key's tenant changes with the file too
    assert (post(KEY_B), post("sk-new-key-42"), post(SHARED)) == (200, 401, 200)
    assert tenants(backend) == ["tenant-a", "tenant-b", "tenant-b", "tenant-c", "tenant-moved", None]


def test_an_in_place_rewrite_right_after_a_read_is_seen_too(http: TestClient, keys_file: Path):
    """Same inode, same size, maybe the same coarse timestamps: the racy window re-reads."""
    assert http.get("/v1/models", headers=bearer(KEY_A)).status_code == 200
    text = keys_file.read_text()
    keys_file.write_text(text.replace(KEY_A, WRONG))  # in place, not atomic, same length
    assert http.get("/v1/models", headers=bearer(KEY_A)).status_code == 401
    assert http.get("/v1/models", headers=bearer(WRONG)).status_code == 200


def test_an_unchanged_file_is_only_statted_once_out_of_the_racy_window(keys: ApiKeys, monkeypatch):
    reads: list[bool] = []
    load = ApiKeys._load
    monkeypatch.setattr(ApiKeys, "_load", lambda self, strict: reads.append(strict) or load(self, strict))
    assert isinstance(keys.authenticate(f"Bearer {KEY_A}"), auth.Caller)
    assert reads == [False]  # just written: racy, read again
    monkeypatch.setattr(auth, "RACY_S", 0.0)  # as if written long ago
    keys.reload()
    reads.clear()
    for _ in range(3):
        assert isinstance(keys.authenticate(f"Bearer {KEY_A}"), auth.Caller)
    assert reads == []


def test_sighup_re_reads_the_file(keys: ApiKeys, keys_file: Path, monkeypatch):
    monkeypatch.setattr(ApiKeys, "refresh", lambda self: None)  # only the signal may notice the change
    assert keys.authenticate(f"Bearer {KEY_A}") == auth.Caller("tenant-a")
    write_keys(keys_file, f"{KEY_A} tenant-z\n")
    assert keys.authenticate(f"Bearer {KEY_B}") == auth.Caller("tenant-b")  # not read yet
    keys.handle_sighup(signal.SIGHUP, None)
    assert keys.counts == (1, 1)
    assert keys.authenticate(f"Bearer {KEY_A}") == auth.Caller("tenant-z")
    assert isinstance(keys.authenticate(f"Bearer {KEY_B}"), auth.OpenAIError)


def test_every_configured_key_is_compared_in_constant_time(keys: ApiKeys, monkeypatch):
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    for key in (SHARED, KEY_A, KEY_B, WRONG):  # the first, a middle, the last, none
        compared.clear()
        keys.authenticate(f"Bearer {key}")
        assert len(compared) == 3, key  # one --api-key key + two of the file: no early exit
        assert all(len(a) == len(b) == 32 for a, b in compared)  # SHA-256 digests, never the keys
        assert all(key.encode() not in (a, b) for a, b in compared)


def test_a_file_gone_unreadable_invalid_or_too_open_grants_nothing_until_fixed(
    http: TestClient, keys_file: Path, caplog
):
    get = lambda key: http.get("/v1/models", headers=bearer(key)).status_code  # noqa: E731
    caplog.set_level(logging.INFO, logger="uvicorn.error")
    for broken in ("invalid", "too-open", "gone"):
        if broken == "invalid":
            write_keys(keys_file, f"{KEY_A} tenant-a extra-field\n")
        elif broken == "too-open":
            write_keys(keys_file, f"{KEY_A} tenant-a\n", mode=0o644)
        else:
            keys_file.unlink()
        assert (get(KEY_A), get(KEY_B), get(SHARED)) == (401, 401, 200), broken
        assert (get(KEY_A), get(SHARED)) == (401, 200), broken  # and still: fail closed
        write_keys(keys_file, f"{KEY_A} tenant-a\n")
        assert (get(KEY_A), get(KEY_B)) == (200, 401), broken
    errors = [record.getMessage() for record in caplog.records if record.levelno == logging.ERROR]
    assert len(errors) == 3, errors  # each problem said once, not per request
    assert all(KEY_A not in message and KEY_B not in message for message in caplog.messages)


def test_keys_file_format():
    text = f"# comment\n\n  {KEY_A}\ttenant-a  \n{KEY_B} -\n# {SHARED} ignored\n"
    assert parse_keys_file(text, "keys") == {KEY_A: "tenant-a", KEY_B: None}
    assert parse_keys_file("", "keys") == {}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (f"{KEY_A}\n", "keys:1: expected 'KEY TENANT'"),
        (f"# c\n{KEY_A} tenant a\n", "keys:2: expected 'KEY TENANT'"),
        (f"{KEY_A} a\n{KEY_A} b\n", "keys:2: this key is already on an earlier line"),
        (f"{KEY_A} {'t' * 257}\n", "keys:1: a tenant is 1-256"),
        (f"{KEY_A},x tenant\n", "keys:1: an API key is printable ASCII"),
        ("sk-\u00e9t\u00e9 tenant\n", "keys:1: an API key is printable ASCII"),
    ],
)
def test_keys_file_errors_name_the_line(text, fragment):
    with pytest.raises(KeysError, match=fragment) as error:
        parse_keys_file(text, "keys")
    assert KEY_A not in str(error.value)


@pytest.mark.parametrize(
    ("mode", "refused", "warned"),
    [(0o600, False, False), (0o400, False, False), (0o640, False, True), (0o660, True, False),
     (0o604, True, False), (0o602, True, False), (0o644, True, False)],
)  # fmt: skip
def test_keys_file_mode(tmp_path: Path, mode, refused, warned):
    path = write_keys(tmp_path / "keys", f"{KEY_A} tenant-a\n", mode)
    if refused:
        with pytest.raises(KeysError, match="chmod 600"):
            ApiKeys((), path)
        return
    assert ApiKeys((), path).counts == (0, 1)
    assert (check_file_mode(os.stat(path).st_mode, "keys") is not None) == warned


def test_the_server_does_not_start_on_a_bad_keys_file(tmp_path: Path, capsys):
    def start(*argv: str) -> ApiKeys | None:
        args = server_main.parse_args(["--model-dir", "m", *argv])
        return server_main.api_keys_from(args, environ={})

    assert start("--api-keys-file", str(tmp_path / "missing")) is None
    assert "API keys file" in capsys.readouterr().err
    bad = write_keys(tmp_path / "bad", f"{KEY_A}\n")
    assert start("--api-keys-file", str(bad)) is None
    both = write_keys(tmp_path / "both", f"{KEY_A} tenant-a\n")
    assert start("--api-key", KEY_A, "--api-keys-file", str(both)) is None  # a key both shared and a tenant's
    assert "also an --api-key key" in capsys.readouterr().err
    assert start("--api-key", "two words") is None
    empty = write_keys(tmp_path / "empty", "# no keys yet\n")
    started = start("--api-keys-file", str(empty))
    assert started is not None and started.enabled and started.counts == (0, 0)  # every request refused
    assert KEY_A not in capsys.readouterr().err


def test_an_open_address_without_keys_is_warned_about(capsys):
    for host, warned in [("127.0.0.1", False), ("localhost", False), ("::1", False), ("0.0.0.0", True)]:
        args = server_main.parse_args(["--model-dir", "m", "--host", host])
        keys = server_main.api_keys_from(args, environ={})
        assert keys is not None and not keys.enabled
        assert ("warning: serving on" in capsys.readouterr().err) == warned, host
    args = server_main.parse_args(["--model-dir", "m", "--host", "0.0.0.0", "--api-key", KEY_A, "--api-key", KEY_B])
    keys = server_main.api_keys_from(args, environ={})
    assert keys is not None and keys.counts == (2, 0)
    err = capsys.readouterr().err
    assert "API keys: 2" in err and "warning" not in err and KEY_A not in err


def test_api_key_takes_several_keys_as_vllm_serve_does_and_repeats():
    args = server_main.parse_args(["--model-dir", "m", "--api-key", KEY_A, KEY_B, "--api-key", SHARED])
    assert args.api_key == [KEY_A, KEY_B, SHARED]
    assert launcher_args(["--openai-port", "1", "--api-key", KEY_A, KEY_B, "--api-key", SHARED]).api_key == [
        KEY_A, KEY_B, SHARED
    ]  # fmt: skip


def test_keys_come_from_the_command_line_then_the_environment():
    env = {"TRITON_EPD_API_KEY": f"{KEY_A}, {KEY_B}", "VLLM_API_KEY": SHARED}
    assert configured_keys([SHARED], env) == [SHARED]  # the command line wins, as in vLLM
    assert configured_keys(None, env) == [KEY_A, KEY_B]
    assert configured_keys(None, {"VLLM_API_KEY": SHARED}) == [SHARED]
    assert configured_keys(None, {"TRITON_EPD_API_KEY": "", "VLLM_API_KEY": ""}) == []
    with pytest.raises(KeysError):
        configured_keys(None, {"VLLM_API_KEY": "a b"})


def test_the_demo_sends_the_configured_key():
    assert default_api_key({}) == "unused"
    assert default_api_key({"OPENAI_API_KEY": "o"}) == "o"
    assert default_api_key({"VLLM_API_KEY": "v", "OPENAI_API_KEY": "o"}) == "v"
    assert default_api_key({"TRITON_EPD_API_KEY": "t1,t2", "VLLM_API_KEY": "v"}) == "t1"


def _server(tmp_path: Path) -> TritonServer:
    return TritonServer(ServerOptions(tmp_path / "repository", Ports(18000, 18001, 18002)))


def test_the_launcher_binds_loopback_and_passes_no_key_by_default(tmp_path: Path):
    app = openai_app(launcher_args(["--openai-port", "19000"]), tmp_path / "model", _server(tmp_path))
    assert app is not None
    assert app.command[app.command.index("--host") + 1] == "127.0.0.1"
    assert "--api-keys-file" not in app.command and app.env == {}


def test_the_launcher_passes_the_keys_in_the_environment_and_the_file_by_path(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["--openai-port", "19000", "--openai-host", "0.0.0.0", "--api-key", KEY_A, "--api-key", KEY_B,
            "--api-keys-file", "keys"]  # fmt: skip
    app = openai_app(launcher_args(argv), tmp_path / "model", _server(tmp_path))
    assert app is not None and app.command[:3] == [sys.executable, "-m", "client.openai_server"]
    options = dict(zip(app.command[3::2], app.command[4::2], strict=True))
    assert options["--host"] == "0.0.0.0" and options["--api-keys-file"] == str(tmp_path / "keys")
    assert app.command[-2:] == ["--port", "19000"]  # serve() reads the port there
    assert app.env == {"TRITON_EPD_API_KEY": f"{KEY_A},{KEY_B}"}
    assert not any(KEY_A in part or KEY_B in part for part in app.command)  # never on a command line
    # what the child reads back
    assert configured_keys(server_main.parse_args(["--model-dir", "m"]).api_key, app.env) == [KEY_A, KEY_B]


@pytest.mark.parametrize(
    "argv",
    [["--api-key", KEY_A], ["--api-keys-file", "keys"], ["--openai-port", "1", "--api-key", "a,b"],
     ["--openai-port", "1", "--api-key", ""]],
)  # fmt: skip
def test_the_launcher_refuses_keys_it_cannot_pass(argv):
    with pytest.raises(SystemExit):
        launcher_args(argv)

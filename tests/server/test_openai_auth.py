"""API keys on the OpenAI API as it runs (``python -m client.openai_server``, in front of the
session's tritonserver, as ``triton-epd-serve --openai-port`` starts it), with a keys file of
two tenants and one key in ``TRITON_EPD_API_KEY``.

No key, a wrong key, and a key removed from the file (the file replaced while the server runs)
are 401 on every route but ``/health``, for httpx and for the official client
(``openai.AuthenticationError``); a key added to the file is served at once; SIGHUP re-reads the
file and leaves the server serving. Tenant isolation through the API: tenant B's key puts an
image in the store (with a video in the same chat: videos always go through the encoders and
the store, and the other items of the chat with them; an image alone on the cpu target's
colocated path is encoded by epd's engine and not stored); tenant A's key, even with
``X-Tenant`` and ``user`` naming B, gets no hit on it (epd's ``epd_cache_lookups{result=hit}``
on Triton's /metrics does not move), while B's next request hits and encodes nothing. No key
ever reaches the API's log.
"""

from __future__ import annotations

import base64
import contextlib
import os
import secrets
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from builders.processes import ProcessGroup, http_ok, wait_until_ready
from builders.tritonserver import TritonServer, free_port
from tests.images import synthetic_image, with_note
from tests.server.conftest import LOG_DIR
from tests.server.test_cache import _counters
from tests.videos import ClipSpec, make_clip

pytestmark = pytest.mark.server

RUN = secrets.token_hex(6)  # fresh tenants and keys: the session's store outlives this module
TENANT_A, TENANT_B = f"auth-a-{RUN}", f"auth-b-{RUN}"
KEY_A, KEY_B, SHARED = f"sk-a-{secrets.token_hex(16)}", f"sk-b-{secrets.token_hex(16)}", f"sk-s-{secrets.token_hex(16)}"
KEY_C, KEY_D = f"sk-c-{secrets.token_hex(16)}", f"sk-d-{secrets.token_hex(16)}"
WRONG = KEY_A[:-1] + ("0" if KEY_A[-1] != "0" else "1")
LOG = LOG_DIR / "openai-auth-server.log"


def write_keys(path: Path, lines: list[str]) -> None:
    """Replace the keys file atomically (mode 600), as the docs ask."""
    fresh = path.with_name(path.name + ".new")
    fresh.write_text("# key tenant\n" + "".join(f"{line}\n" for line in lines))
    fresh.chmod(0o600)
    os.replace(fresh, path)


@contextlib.contextmanager
def openai_api_with_keys(grpc_url: str, model_dir: Path, keys_file: Path) -> Iterator[tuple[str, ProcessGroup]]:
    """``tests.server.conftest.openai_api`` with ``--api-keys-file`` and ``TRITON_EPD_API_KEY``."""
    port = free_port()
    command = [sys.executable, "-m", "client.openai_server", "--triton-grpc-url", grpc_url,
               "--model-dir", str(model_dir), "--api-keys-file", str(keys_file), "--port", str(port)]  # fmt: skip
    app = ProcessGroup("openai-server", command, env={"TRITON_EPD_API_KEY": SHARED}, log_path=LOG).start()
    try:
        wait_until_ready(lambda: http_ok(f"http://127.0.0.1:{port}/health"), [app], 120, "the OpenAI server")
        yield f"http://127.0.0.1:{port}", app
    finally:
        report = app.stop(timeout_s=30)
        assert report is not None and not report.killed, report and report.describe()


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("openai-auth") / "keys"
    write_keys(path, [f"{KEY_A} {TENANT_A}", f"{KEY_B} {TENANT_B}", f"{KEY_C} auth-c-{RUN}"])
    return path


@pytest.fixture(scope="module")
def api(server: TritonServer, model_dir: Path, keys_file: Path) -> Iterator[tuple[str, ProcessGroup]]:
    with openai_api_with_keys(server.grpc_url, model_dir, keys_file) as running:
        yield running
    log = LOG.read_text()
    assert all(key not in log for key in (KEY_A, KEY_B, KEY_C, KEY_D, SHARED, WRONG)), "a key reached the log"


@pytest.fixture(scope="module")
def api_url(api: tuple[str, ProcessGroup]) -> str:
    return api[0]


def client(api_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api_url}/v1", api_key=key, max_retries=0, timeout=300)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def data_uri(kind: str, data: bytes) -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


CHAT = {"model": "epd", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Hi."}]}
ROUTES = [("GET", "/v1/models", None), ("POST", "/v1/chat/completions", CHAT), ("GET", "/openapi.json", None),
          ("GET", "/docs", None), ("GET", "/redoc", None), ("GET", "/no/such/route", None)]  # fmt: skip


def statuses(api_url: str, headers: dict[str, str]) -> dict[str, int]:
    with httpx.Client(base_url=api_url, timeout=300) as http:
        return {path: http.request(method, path, json=body, headers=headers).status_code
                for method, path, body in ROUTES}  # fmt: skip


def refused_everywhere(api_url: str, headers: dict[str, str]) -> bool:
    """Every route but /health answers 401 in OpenAI's shape; /health answers 200."""
    with httpx.Client(base_url=api_url, timeout=300) as http:
        for method, path, body in ROUTES:
            response = http.request(method, path, json=body, headers=headers)
            assert response.status_code == 401, (path, response.status_code, response.text[:200])
            error = response.json()["error"]
            assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, "invalid_api_key")
        assert http.get("/health", headers=headers).status_code == 200
    return True


@pytest.mark.parametrize("headers", [{}, bearer(WRONG), {"Authorization": f"Basic {KEY_A}"}],
                         ids=["no-key", "wrong-key", "other-scheme"])  # fmt: skip
def test_every_route_but_health_refuses_a_missing_or_wrong_key(api_url: str, headers):
    assert refused_everywhere(api_url, headers)


@pytest.mark.parametrize("key", [KEY_A, KEY_B, SHARED], ids=["tenant-a", "tenant-b", "shared"])
def test_every_route_serves_a_right_key(api_url: str, key: str):
    expected = {path: 200 for _, path, _ in ROUTES} | {"/no/such/route": 404}
    assert statuses(api_url, bearer(key)) == expected


def test_the_openai_client_raises_authentication_error(api_url: str):
    with client(api_url, WRONG) as wrong:
        with pytest.raises(openai.AuthenticationError) as refused:
            wrong.models.list()
        assert refused.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model="epd", messages=[{"role": "user", "content": "Hi."}], max_tokens=2)
    with client(api_url, KEY_A) as right:
        assert sorted(model.id for model in right.models.list()) == ["epd", "llm"]


def test_a_key_removed_from_the_file_is_refused_at_once_and_an_added_one_served(api_url: str, keys_file: Path):
    assert statuses(api_url, bearer(KEY_C))["/v1/models"] == 200
    assert statuses(api_url, bearer(KEY_D))["/v1/models"] == 401
    write_keys(keys_file, [f"{KEY_A} {TENANT_A}", f"{KEY_B} {TENANT_B}", f"{KEY_D} auth-d-{RUN}"])
    assert refused_everywhere(api_url, bearer(KEY_C))  # the very next request
    with client(api_url, KEY_C) as removed, pytest.raises(openai.AuthenticationError):
        removed.models.list()
    assert statuses(api_url, bearer(KEY_D))["/v1/models"] == 200
    with client(api_url, KEY_D) as added:
        assert added.chat.completions.create(**CHAT).choices[0].finish_reason is not None  # type: ignore[call-overload]


def test_sighup_re_reads_the_file_and_the_server_keeps_serving(api: tuple[str, ProcessGroup]):
    api_url, app = api
    assert app.pid is not None
    os.kill(app.pid, signal.SIGHUP)  # the default action would end the process
    deadline = time.monotonic() + 30
    while "SIGHUP: re-reading the API keys file" not in LOG.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "SIGHUP: re-reading the API keys file" in LOG.read_text()
    assert app.process is not None and app.process.poll() is None
    assert statuses(api_url, bearer(KEY_A))["/v1/models"] == 200


def cache_lookups(server: TritonServer) -> dict[str, float]:
    """epd's hits (it counts the items it found in the store) and the encoders' misses (each
    item they encode and write to the store), from Triton's /metrics."""
    counters = _counters(server)
    encoder_misses = sum(
        value for (name, key), value in counters.items()
        if name == "epd_cache_lookups" and key.startswith("encoder_") and key.endswith("/miss")
    )  # fmt: skip
    return {"epd_hits": counters.get(("epd_cache_lookups", "epd/hit"), 0.0), "encoded": encoder_misses}


def chat_epd(api_url: str, key: str, parts: list[dict[str, Any]], headers: dict[str, str] | None = None,
             user: str | None = None) -> None:  # fmt: skip
    content = [*parts, {"type": "text", "text": "Whose is it?"}]
    extra: dict[str, Any] = {"user": user} if user else {}
    with client(api_url, key) as api:
        answer = api.chat.completions.create(
            model="epd", messages=[{"role": "user", "content": content}], max_tokens=2, temperature=0,  # type: ignore[misc,list-item]
            extra_headers=headers, **extra,
        )  # fmt: skip
    assert answer.usage is not None and answer.usage.completion_tokens >= 1


def lookups_of(server: TritonServer, request: Any) -> dict[str, float]:
    """The hits and encodes that ``request()`` caused."""
    before = cache_lookups(server)
    request()
    after = cache_lookups(server)
    return {name: after[name] - before[name] for name in before}


def test_tenant_a_key_gets_no_hit_on_tenant_b_image_and_b_hits(server: TritonServer, api_url: str):
    note = f"triton-epd test_openai_auth {RUN}".encode()
    image = with_note(synthetic_image(96, 64, seed=9301), note)
    image_part = {"type": "image_url", "image_url": {"url": data_uri("image/jpeg", image)}}
    clip = make_clip(ClipSpec("vp8", 64, 48, 5, 1.0, seed=9302))
    video_part = {"type": "video_url", "video_url": {"url": data_uri("video/webm", clip)}}

    # B: the image with a video: both go through the encoders into B's space of the store.
    first = lookups_of(server, lambda: chat_epd(api_url, KEY_B, [video_part, image_part]))
    assert first["epd_hits"] == 0 and first["encoded"] == 2, first
    # A, naming B's tenant in every way a client could: still A's space, no hit.
    spoofed = lookups_of(
        server, lambda: chat_epd(api_url, KEY_A, [image_part], headers={"X-Tenant": TENANT_B}, user=TENANT_B)
    )
    assert spoofed["epd_hits"] == 0, spoofed
    # The shared key (no tenant) has no hit on it either.
    assert lookups_of(server, lambda: chat_epd(api_url, SHARED, [image_part]))["epd_hits"] == 0
    # B again: its own entry, a hit, nothing encoded.
    again = lookups_of(server, lambda: chat_epd(api_url, KEY_B, [image_part]))
    assert again == {"epd_hits": 1, "encoded": 0}, again

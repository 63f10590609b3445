"""The OpenAI endpoint names the tenant to Triton: the ``X-Tenant`` header, else the body's
``user``; neither: no tenant parameter at all (the untenanted cache space)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from builders.default_model import build_default_model
from client.openai_server.app import create_app
from client.openai_server.prompt import ChatRenderer, MediaPolicy
from tests.unit.test_openai_app import FakeBackend, chat


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer.from_checkpoint(build_default_model(), MediaPolicy())


@pytest.mark.parametrize(
    ("headers", "body", "parameters"),
    [
        ({}, chat(), None),
        ({}, chat(user="end-user-7"), {"tenant": "end-user-7"}),
        ({"X-Tenant": "acme"}, chat(), {"tenant": "acme"}),
        ({"X-Tenant": "acme"}, chat(user="end-user-7"), {"tenant": "acme"}),  # the gateway's header wins
        ({"x-tenant": ""}, chat(user=""), None),  # empty names no tenant
    ],
)
def test_tenant_reaches_triton_as_a_request_parameter(renderer, headers, body, parameters):
    backend = FakeBackend()
    with TestClient(create_app(backend, renderer), raise_server_exceptions=False) as http:
        assert http.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
    assert [call.parameters for call in backend.calls] == [parameters]

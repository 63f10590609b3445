"""Schemathesis fuzzes the OpenAI app from its own OpenAPI schema: no 5xx, no hang.

Against the app with a scripted Triton backend (``FakeBackend``, serving whatever model name is
asked) rather than a real server: the app's own code (validation, rendering with the real chat
template, media checks, errors, SSE) is what the fuzzer reaches, and a real server would make each
example seconds long. Bodies that fit the schema (positive) and bodies that break it (negative),
a bounded number of each, keep this well under a minute; Hypothesis' deadline fails a slow
(hanging) example instead of the session.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from builders.default_model import build_default_model
from client.openai_server.app import create_app
from client.openai_server.prompt import ChatRenderer, MediaPolicy
from tests.unit.test_openai_app import FakeBackend

EXAMPLES = 60
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=5000,  # ms per example
    suppress_health_check=list(HealthCheck),
    derandomize=True,  # the same examples on every run: CI does not flake on a new one
)

APP = create_app(FakeBackend(serve_any_model=True), ChatRenderer.from_checkpoint(build_default_model(), MediaPolicy()))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.mark.timeout(120)
@schema.parametrize()
@FUZZ_SETTINGS
def test_no_server_errors_for_bodies_that_fit_the_schema(case):
    case.call_and_validate(checks=[not_a_server_error])


@pytest.mark.timeout(120)
@given(case=schema["/v1/chat/completions"]["POST"].as_strategy(generation_mode=GenerationMode.NEGATIVE))
@FUZZ_SETTINGS
def test_bodies_that_break_the_schema_are_openai_shaped_400s(case):
    response = case.call_and_validate(checks=[not_a_server_error])
    # Like vllm serve (pydantic's lax mode), a value the schema does not list but that converts
    # losslessly (0 for false, "3" for 3) is taken; everything else is a 400 with OpenAI's shape.
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}

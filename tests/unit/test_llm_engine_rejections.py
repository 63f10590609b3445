"""What vLLM refuses becomes INVALID_ARG (python_backends.engines.async_llm.input_rejections), with
vLLM's own exception classes; the real engine's refusal is in tests/integration/test_pd_transfer.py."""

from __future__ import annotations

import pytest
from vllm.exceptions import VLLMClientError
from vllm.v1.engine.exceptions import EngineGenerateError

from python_backends.engines.async_llm import input_rejections
from python_backends.errors import EpdError, ErrorCode


def _raised_from(cause: Exception) -> EngineGenerateError:
    try:
        raise EngineGenerateError() from cause
    except EngineGenerateError as wrapped:
        return wrapped


@pytest.mark.parametrize(
    "raised",
    [
        ValueError("prompt too long"),
        VLLMClientError("bad sampling"),
        _raised_from(ValueError("Cache miss for key: data is not provided")),  # vLLM 0.32's wrapping
    ],
    ids=["ValueError", "VLLMClientError", "EngineGenerateError from ValueError"],
)
def test_input_vllm_refuses_is_invalid_arg_with_its_message(raised: Exception) -> None:
    with pytest.raises(EpdError) as refused, input_rejections("engine"):
        raise raised
    assert refused.value.code == ErrorCode.INVALID_ARG
    assert refused.value.message.startswith("request rejected by the engine: ")
    cause = raised.__cause__ if isinstance(raised, EngineGenerateError) else raised
    assert str(cause) in refused.value.message


@pytest.mark.parametrize("raised", [_raised_from(RuntimeError("scheduler bug")), RuntimeError("other")])
def test_other_failures_go_on_as_they_are(raised: Exception) -> None:
    with pytest.raises(type(raised)), input_rejections("engine"):
        raise raised

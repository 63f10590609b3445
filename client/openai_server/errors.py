"""OpenAI-shaped errors (``{"error": {"message", "type", "param", "code"}}``) and their HTTP status.

A Triton gRPC *stream* carries a model's error as a message only (``ModelStreamInferResponse``
has no status field), so :func:`from_triton_message` tells the kinds apart by what the project's
models and Triton itself write: ``internal error: ...`` is the models' INTERNAL, Triton's own
words for a missing or unready model are 404 and 503, and every other model error is an
INVALID_ARG (the models raise nothing else before the first token), a 400.
"""

from __future__ import annotations

from typing import Any


class OpenAIError(Exception):
    """An error the API answers with ``status`` and an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str, served: list[str]) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model '{model}' does not exist; served models: {', '.join(served) or 'none'}",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def not_ready(message: str) -> OpenAIError:
    return OpenAIError(503, message, "service_unavailable", None, "triton_not_ready")


def internal(message: str) -> OpenAIError:
    return OpenAIError(500, message, "internal_error", None, None)


_NOT_FOUND_MARKERS = ("Request for unknown model",)
_UNAVAILABLE_MARKERS = ("not at ready state", "is not ready", "is not available", "Server is stopping")


def from_triton_message(message: str) -> OpenAIError:
    """The OpenAI error for a Triton stream error (a message without a code)."""
    if message.startswith("internal error"):
        return internal(message)
    if any(marker in message for marker in _UNAVAILABLE_MARKERS):
        return not_ready(message)
    if any(marker in message for marker in _NOT_FOUND_MARKERS):
        return OpenAIError(404, message, "invalid_request_error", "model", "model_not_found")
    return bad_request(message, code="triton_invalid_arg")

"""Errors that the serving code raises and the Triton edge maps to error codes.

Plain Python on purpose: the logic under ``python_backends`` never imports Triton.
A ``model.py`` turns an :class:`EpdError` into ``pb_utils.TritonError(message, code)``
so that clients get a code and a message, never a traceback.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    # Names match pb_utils.TritonError's code attributes.
    INVALID_ARG = "INVALID_ARG"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"


class EpdError(Exception):
    """An error whose message is safe and useful to show to the client."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_ARG) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message


def invalid_arg(message: str) -> EpdError:
    return EpdError(message, ErrorCode.INVALID_ARG)


def item_renamed(exc: EpdError, what: str, index: int) -> EpdError:
    """``exc`` with its item ``what[0]`` named ``what[index]``: a stage that was sent one item of
    a request (an encoder, the video preprocessing) names it 0, the client knows it by its index."""
    if not index or f"{what}[0]" not in exc.message:
        return exc
    return EpdError(exc.message.replace(f"{what}[0]", f"{what}[{index}]", 1), exc.code)


def stage_error(stage: str, exc: BaseException) -> EpdError:
    """One coded error that names the stage; errors that already carry a code keep it."""
    if isinstance(exc, EpdError):
        return EpdError(f"{stage}: {exc.message}", exc.code)
    return EpdError(f"{stage} failed: {type(exc).__name__}", ErrorCode.INTERNAL)

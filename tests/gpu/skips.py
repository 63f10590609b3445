"""What every GPU test module checks before it runs: a CUDA GPU that torch sees, then what the
module itself needs. Without them the module is skipped with the reason (CI, CPU machines)."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def cuda_missing() -> str | None:
    """Why torch cannot use a CUDA GPU here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    return None


def gpu_marks(*needs: Callable[[], str | None]) -> list[pytest.MarkDecorator]:
    """A GPU test module's ``pytestmark``: the ``gpu`` marker and a skip with the first reason
    found, no CUDA GPU first, then each of ``needs`` (called only once everything before it is there)."""
    reason = cuda_missing()
    for need in needs:
        if reason is not None:
            break
        reason = need()
    return [pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=str(reason))]

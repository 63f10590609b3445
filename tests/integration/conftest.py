"""Integration tests run vLLM engines inside pytest's own process, and vLLM writes to
``os.environ`` as it starts (thread counts, its multiprocessing and distributed settings, ...).
Servers that later tests start inherit this process's environment, so each module gets its
environment back exactly as it found it."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import pytest


def restore_environ(saved: dict[str, str]) -> list[str]:
    """Put ``os.environ`` back to ``saved``; returns the names that had changed."""
    changed = sorted(k for k in set(saved) | set(os.environ) if saved.get(k) != os.environ.get(k))
    os.environ.clear()
    os.environ.update(saved)
    return changed


@pytest.fixture(scope="module", autouse=True)
def untouched_environ() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    changed = restore_environ(saved)
    if changed:
        warnings.warn(f"restored environment variables its in-process engines changed: {changed}", stacklevel=1)

"""What the embedding store's tests share (unit tests and GPU tests)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from python_backends.errors import EpdError


def error_of(call: Callable[[], object]) -> EpdError:
    """The EpdError ``call`` raises (the test fails if it raises none)."""
    with pytest.raises(EpdError) as info:
        call()
    return info.value


@contextmanager
def store_directory(prefix: str) -> Iterator[str]:
    """A fresh store directory on tmpfs where there is one, removed afterwards."""
    path = tempfile.mkdtemp(prefix=prefix, dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)

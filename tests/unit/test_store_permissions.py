"""The store's files are the owner's only (0600 in a 0700 folder), its reference secret is per
store and never reaches a log, even when references fail verification."""

from __future__ import annotations

import json
import logging
import os
import stat

import numpy as np
import pytest

from python_backends.errors import EpdError
from python_backends.store import EmbeddingStore, EntryMeta, StoreConfig, content_key


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_store_files_are_0600_in_a_0700_folder_even_if_made_looser(tmp_path):
    path = tmp_path / "store"
    with EmbeddingStore(StoreConfig(path=str(path), capacity_bytes=1 << 20)):
        pass
    assert _mode(path) == 0o700
    assert {p.name: _mode(p) for p in path.iterdir()} == {"data.mdb": 0o600, "lock.mdb": 0o600}
    os.chmod(path, 0o755)  # as an older version (LMDB's default modes) left them
    for item in path.iterdir():
        os.chmod(item, 0o644)
    with EmbeddingStore(StoreConfig(path=str(path), capacity_bytes=1 << 20)):
        pass
    assert _mode(path) == 0o700 and {_mode(p) for p in path.iterdir()} == {0o600}


def test_the_reference_secret_is_per_store_and_never_logged(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    first = EmbeddingStore(StoreConfig(path=str(tmp_path / "a"), capacity_bytes=1 << 20))
    second = EmbeddingStore(StoreConfig(path=str(tmp_path / "b"), capacity_bytes=1 << 20))
    try:
        assert first.secret != second.secret and len(first.secret) == 32
        key = content_key(b"image", {}, "v1")
        reference = first.put(key, np.ones((4, 8), np.float32), EntryMeta(grid_thw=(1, 4, 4)))
        with pytest.raises(EpdError):
            second.resolve(reference.to_bytes())  # another store's: NOT_FOUND
        fields = json.loads(reference.to_bytes())
        tampered = json.dumps({**fields, "loc": "shm://elsewhere"}).encode()  # signed fields edited
        with pytest.raises(EpdError) as info:
            first.resolve(tampered)
        first.release(reference)
    finally:
        first.close()
        second.close()
    logged = caplog.text + str(info.value)
    for secret in (first.secret, second.secret):
        assert secret.hex() not in logged and repr(secret) not in logged

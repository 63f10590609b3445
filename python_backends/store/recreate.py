"""Opening a store directory that holds something this code cannot read: recreate it, say so.

The store is a cache, so a directory left by an older format, a file that is not an LMDB
database (truncated, overwritten, a crash of the machine half-way through a copy) or a store
with no identity is never read as garbage and never stops a model from loading: it is set
aside and recreated empty, with one warning that says why. Every process of the node may open
the store at once, so the recreation runs under an exclusive lock beside the directory, and a
process that finds the directory already recreated by another simply opens it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb

log = logging.getLogger(__name__)

# What lmdb raises when the file is not a database this library can use.
UNREADABLE = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.VersionMismatchError, lmdb.PageNotFoundError)
LMDB_FILES = ("data.mdb", "lock.mdb")


def recreation_lock_path(path: str) -> Path:
    """Beside the directory, not in it: the directory's files are what gets replaced."""
    store = Path(path)
    return store.parent / f".{store.name}.recreate.lock"


def set_aside(path: str, reason: str) -> Path | None:
    """Move the store's LMDB files to ``<path>/unreadable-<time>/`` and log why; returns that folder."""
    store = Path(path)
    present = [store / name for name in LMDB_FILES if (store / name).exists()]
    if not present:
        return None
    aside = store / f"unreadable-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    aside.mkdir(parents=True, exist_ok=True)
    for file in present:
        file.rename(aside / file.name)
    log.warning("embedding store at %s: %s; recreated it empty (it is a cache), old files moved to %s",
                path, reason, aside)
    return aside


def open_or_recreate(path: str, open_env: Callable[[], lmdb.Environment]) -> lmdb.Environment:
    """``open_env()``; when the files are unreadable, set them aside (once, under the lock) and open anew."""
    try:
        return open_env()
    except UNREADABLE as first:
        with recreation_lock(path):
            try:  # another process may have recreated it while this one waited for the lock
                return open_env()
            except UNREADABLE:
                set_aside(path, f"its file is not a readable LMDB database ({first})")
            return open_env()


@contextmanager
def recreation_lock(path: str) -> Iterator[None]:
    """An exclusive ``flock`` beside the store directory, held for the ``with`` block."""
    lock_path = recreation_lock_path(path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    handle = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # closing releases the lock

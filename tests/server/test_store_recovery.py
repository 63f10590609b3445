"""A store directory this code cannot read is recreated, said in Triton's log, and serves again
(issue 17: "a corrupted file is recreated with a clear log line, never read as garbage").

One encoder-role server (no vLLM engine: quick to start) on a store whose ``data.mdb`` is not an
LMDB file. Its encoder models open the store at load: exactly one of them sets the file aside
under the recreation lock and logs why, through ``python_backends``' logging routed into
Triton's log (triton_edge/logs.py) as a warning line, and the server encodes. A restart on the
same directory opens the recreated store without a second warning.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from builders.launcher import prepare
from builders.repository import TARGETS
from builders.roles import load_model_args
from builders.tritonserver import Ports, ServerOptions
from tests.images import synthetic_image
from tests.server.conftest import (
    LOG_DIR,
    SERVER_REPOSITORY,
    SLOT,
    TEST_EXIT_TIMEOUT_S,
    encoder_references,
    serving,
)

pytestmark = pytest.mark.server


def _encoder_server(model_dir: Path, node_dir: Path, store: Path) -> ServerOptions:
    repository = SERVER_REPOSITORY.parent / f"store-recovery-{SLOT}"
    cache = dataclasses.replace(TARGETS["cpu"].cache, path=str(store), node_id="node-recovery")
    prepare("cpu", model_dir, repository, cache=cache, kv_store_path=str(node_dir / "recovery-kv"), role="encoder")
    args = load_model_args(dataclasses.replace(TARGETS["cpu"], cache=cache), "encoder")
    return ServerOptions(repository, Ports.free(), extra_args=args, exit_timeout_s=TEST_EXIT_TIMEOUT_S)


def test_an_unreadable_store_is_recreated_with_one_warning_in_tritons_log_and_serves(
    model_dir: Path, node_dir: Path
) -> None:
    store = node_dir / "recovery-store"
    store.mkdir(mode=0o700)
    garbage = b"not an LMDB database " * 1024
    (store / "data.mdb").write_bytes(garbage)
    options = _encoder_server(model_dir, node_dir, store)
    images = [synthetic_image(96, 96, 7100 + i, "PNG") for i in range(2)]

    first_log = LOG_DIR / "store-recovery-first.log"
    with serving(options, first_log) as server:
        assert len(encoder_references(server, images)) == 2
    marker = f"python_backends.store.recreate: embedding store at {store}: its file is not a readable LMDB database"
    warnings = [line for line in first_log.read_text().splitlines() if marker in line]
    assert len(warnings) == 1 and warnings[0].startswith("W"), warnings or first_log.read_text()[-4000:]
    set_aside = list(store.glob("unreadable-*/data.mdb"))
    assert len(set_aside) == 1 and set_aside[0].read_bytes() == garbage  # kept for a post-mortem, never read

    second_log = LOG_DIR / "store-recovery-second.log"
    with serving(options, second_log) as server:
        assert len(encoder_references(server, images)) == 2
    assert "recreated it empty" not in second_log.read_text()

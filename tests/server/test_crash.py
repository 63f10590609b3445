"""A stage crash under load, end to end (the full table: ``make crash``, docs/operations.md
"Crashes"): ``triton-epd-serve`` run as a container's restart policy runs it, ``epd`` load with a
deadline per request, then SIGKILL of ``encoder_0``'s stub. Clients see errors, never a hang;
the launcher notices the dead stage, stops the server (readiness goes down) and exits with
STAGE_CRASHED; started again on the same store directory, it serves again, an image stored
before the crash is a hit, and no lease of the dead processes is left."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from builders.launcher import STAGE_CRASHED
from tests.server.conftest import LOG_DIR, SERVER_REPOSITORY
from tests.stress.crash import Paths, run_case

pytestmark = [
    pytest.mark.server,
    # Two launcher starts (~2 x 60-100 s on a quiet 2-core machine) plus the load: past what CI's
    # budget leaves for this issue next to test_soak.py. Run with `make test-crash`.
    pytest.mark.skipif(not os.environ.get("TRITON_EPD_CRASH_TESTS"), reason="run with `make test-crash`"),
]


def test_killing_an_encoder_stub_under_load_ends_requests_and_the_server_recovers(node_dir: Path) -> None:
    node = node_dir / "crash"
    paths = Paths(LOG_DIR / "crash", node / "embeddings", node / "kv")
    paths.work.mkdir(parents=True, exist_ok=True)
    repo = SERVER_REPOSITORY.with_name(SERVER_REPOSITORY.name + "-crash")
    args = argparse.Namespace(concurrency=2, deadline_s=180.0, before_s=10.0, after_s=20.0, recovery_timeout_s=900.0)
    case = run_case("stub:encoder_0", args, paths, repo)
    summary = {k: case.get(k) for k in ("counts_all", "counts_after_kill", "errors", "launcher_exits",
                                        "recovered_at_s", "store_serves_again", "store_idle", "stop")}
    assert case["warm"], summary
    assert case["counts_all"]["hang"] == 0, summary
    # The launcher noticed the dead stub and exited STAGE_CRASHED (a later exit: a restart that
    # failed on its own, e.g. no memory for a KV cache on a crowded machine, and was retried).
    exits = [exit for exit in case["launcher_exits"] if exit["t_s"] >= case["killed_at_s"]]
    assert exits and exits[0]["exit_code"] == STAGE_CRASHED, summary
    killed = case["killed_at_s"]
    assert any(not change["server_ready"] for change in case["readiness"] if change["t_s"] >= killed), case["readiness"]
    assert case["recovered_at_s"] is not None, summary
    assert case["store_serves_again"]["succeeded"] and case["store_serves_again"]["cache_hits"] == 1, summary
    assert case["store_idle"]["active_leases"] == 0, summary
    assert "SIGKILLed" not in case["stop"], summary

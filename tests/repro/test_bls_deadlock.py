"""The python backend's BLS deadlock, reproduced with tiny models (opt-in: TRITON_EPD_REPRO_TESTS=1).

Three runs of each pattern on the same load (tests/repro/bls_deadlock/run.py, the defaults:
8 requests in flight, 8 streams of 8 responses 2 ms apart per request): the old pattern (a
streaming decoupled BLS read while other threads open streams and ``Metric.set()``) must hang
in every run within 120 s, the new one (one FINAL response per BLS call, ``increment``) in none.
~8 minutes; the report is docs/upstream/python-backend-bls-deadlock.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.repro.bls_deadlock.run import Load, one_run, table

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(
        os.environ.get("TRITON_EPD_REPRO_TESTS") != "1",
        reason="opt-in upstream reproduction (~8 min, deadlocks a tritonserver on purpose): "
        "TRITON_EPD_REPRO_TESTS=1 or `make repro-bls-deadlock`",
    ),
]

RUNS = 3
BOUND_S = 120.0


@pytest.mark.timeout(1800)
def test_old_pattern_hangs_every_run_new_pattern_never(tmp_path: Path) -> None:
    load = Load()
    results = [one_run(i, pattern, load, BOUND_S, tmp_path) for i in range(1, RUNS + 1) for pattern in ("old", "new")]
    summary = table(results)
    print(summary)
    old = [r for r in results if r.pattern == "old"]
    new = [r for r in results if r.pattern == "new"]
    assert sum(r.hung for r in old) == RUNS, f"old pattern hung in {sum(r.hung for r in old)}/{RUNS}:\n{summary}"
    assert not any(r.hung for r in new), f"new pattern hung in {sum(r.hung for r in new)}/{RUNS}:\n{summary}"
    broken = [r for r in new if r.errors or r.server_exited is not None]
    assert not broken, f"new pattern runs with errors or a dead server: {[(r.run, r.errors[:1]) for r in broken]}"
    assert all(r.requests_completed > 0 for r in new), summary

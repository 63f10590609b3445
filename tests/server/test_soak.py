"""60 s of the soak (``bench.soak``; ``make soak`` runs 10 minutes) against the session server:
mixed load at concurrency 4 -- good requests with unique and repeated images, corrupt images,
streams cancelled mid-way -- with every server process sampled. Asserts what is deterministic
on a shared machine: no good request fails, every bad input gets a coded error naming it, nothing
hangs, and once idle no lease, engine request or stub fd is left over. RSS/fd flatness within 5%
is for the 10-minute results file (results/2026-12-01/soak/), too noisy to assert in 60 s."""

from __future__ import annotations

import os

import pytest

from bench.soak import run_soak
from builders.tritonserver import TritonServer
from tests.server.conftest import CACHE_POLICY

# Kept out of `make test` until issue 17's open crash is fixed: in two full runs on 2026-12-01
# epd's stub died under this mixed load ("double free or corruption (fasttop)" in the server log),
# after which every later epd test of the session fails. `make test-soak` runs it.
pytestmark = pytest.mark.skipif(
    not os.environ.get("TRITON_EPD_SOAK_TESTS"), reason="issue 17: epd stub crash under soak load; `make test-soak`"
)

STUB_FD_SLACK = 4  # an fd or two may be opened lazily by a library on first use


def test_soak_a_minute_of_mixed_load_leaks_nothing(server: TritonServer) -> None:
    assert server.process is not None
    result = run_soak(server.grpc_url, server.process.pid, CACHE_POLICY.path, server.metrics_url,
                      duration_s=60, concurrency=4, sample_s=3.0, deadline_s=180.0)
    verdict = result["verdict"]
    summary = {k: v for k, v in verdict.items() if k != "flat"}
    assert verdict["requests"]["success"] > 0, summary
    assert verdict["good_errors"] == 0, summary
    assert verdict["bad_inputs"] > 0 and verdict["bad_inputs_coded"] == verdict["bad_inputs"], summary
    assert verdict["hangs"] == 0, summary
    assert verdict["idle_active_leases"] == 0, summary
    assert all(count == 0 for count in verdict["idle_unfinished"].values()), summary

    first, idle = result["samples"][0], result["samples"][-1]
    unique = verdict["by_kind"]["unique"]["success"] + verdict["by_kind"]["unique"]["error"]
    assert idle["store"]["entries"] <= first["store"]["entries"] + unique + 6  # 6: the pool of repeated images
    grown = {role: (first["processes"][role]["fds"], idle["processes"][role]["fds"])
             for role in first["processes"] if role.startswith("stub:") and role in idle["processes"]}
    assert grown and all(after - before <= STUB_FD_SLACK for before, after in grown.values()), grown

"""60 s of the soak (``tests.stress.soak``; ``make soak`` runs 10 minutes) against the session server:
mixed load at concurrency 4 -- good requests with unique and repeated images, corrupt images,
streams cancelled mid-way -- with every server process sampled. Asserts what is deterministic
on a shared machine: no good request fails, every bad input gets a coded error naming it, nothing
hangs, and once idle no lease, engine request or stub fd (beyond those open after the warm-up) is
left over. RSS/fd flatness within 5% is printed, and judged on the 10-minute results file
(docs/benchmarks/soak.md): too noisy to assert in 60 s."""

from __future__ import annotations

import json

from builders.tritonserver import TritonServer
from tests.server.conftest import CACHE_POLICY
from tests.stress.soak import run_soak

# In `make test` (issue 17: "a 60 s version in CI"). Its ~300 streams cancelled after their first
# response can make Triton 2.51 keep `epd` from unloading at the session's stop: a gRPC frontend
# race fixed upstream after 2.51 (docs/benchmarks/cancel-storm.md). The stop check reports that
# case, and only that case, as a TritonHeldModel warning (docs/benchmarks/soak.md); it costs
# the run Triton's exit timeout. epd's stub died under this load ("double free or corruption") in
# two full runs on 2026-12-01 01:11-02:43, both with a BLS reader thread per stream (e896481), and
# in no soak or full run since that was reverted (5bfc5cb).

STUB_FD_SLACK = 4  # an fd or two may be opened lazily by a library on first use


def test_soak_a_minute_of_mixed_load_leaks_nothing(server: TritonServer) -> None:
    assert server.process is not None
    result = run_soak(server.grpc_url, server.process.pid, CACHE_POLICY.path, server.metrics_url,
                      duration_s=60, concurrency=4, sample_s=3.0, deadline_s=180.0)
    verdict = result["verdict"]
    summary = {k: v for k, v in verdict.items() if k != "flat"}
    print(f"soak verdict: {json.dumps(summary)}")  # RSS/fd growth is shown, not asserted (60 s is noisy)
    growth = {role: {m: round(g["change"], 4) for m, g in metrics.items() if g}
              for role, metrics in verdict["flat"].items()}
    print(f"soak growth first->last tenth: {json.dumps(growth)}")
    assert verdict["requests"]["success"] > 0, summary
    assert verdict["good_errors"] == 0, summary
    assert verdict["bad_inputs"] > 0 and verdict["bad_inputs_coded"] == verdict["bad_inputs"], summary
    assert verdict["hangs"] == 0, summary
    assert verdict["idle_active_leases"] == 0, summary
    assert all(count == 0 for count in verdict["idle_unfinished"].values()), summary

    first, idle = result["samples"][0], result["samples"][-1]
    unique = verdict["by_kind"]["unique"]["success"] + verdict["by_kind"]["unique"]["error"]
    assert idle["store"]["entries"] <= first["store"]["entries"] + unique + 6  # 6: the pool of repeated images
    # fds against the first sample after the warm-up: epd's first requests open what its paths keep
    # open (2026-12-01: epd's stub went 26 -> 33 fds within the 12 s warm-up, then stayed flat to the end).
    warm = next(s for s in result["samples"] if s["phase"] == "load" and s["t_s"] >= result["warmup_s"])
    grown = {role: (warm["processes"][role]["fds"], idle["processes"][role]["fds"])
             for role in warm["processes"] if role.startswith("stub:") and role in idle["processes"]}
    assert grown and all(after - before <= STUB_FD_SLACK for before, after in grown.values()), grown

"""Peer comparison in one run: our Triton modes against vLLM's own ways of serving the
same model on the same machine, with the same workload and the same metric code.

Server groups (``bench.peer_servers``: ``triton``, ``vllm-colocated``, ``vllm-epd``) are
started and stopped one after another (never two at once: they would share the cores and
/dev/shm). For each group: start, sweep its modes (``Sweep``, the code ``bench run`` uses),
then the equality pass (``bench.peer_equality``: the same fixed requests sent one at a time
to every served model, greedy token ids and prompt lengths compared across all modes), then
stop. In the ``vllm-epd`` group, ``ec_load_proof`` also shows that the consumer reads the
stored encoder cache (zeroed embeddings change its answer) rather than encoding the image
again. The results are merged into one summary with ratios against ``llm``, against the
best peer, and the peer comparison's goals (docs/benchmarks/peers.md) checked at every load
point (``bench.peers_report``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.metrics import RequestRecord
from bench.peer_equality import equality_requests, equality_table, run_equality
from bench.peer_servers import COLOCATED, PEER_MODELS, VLLM_EPD, PeerSettings, triton_group, vllm_colocated, vllm_epd
from bench.peers_report import (
    agreement_by_policy,
    best_peer_ratios,
    goal_checks,
    model_of,
    validity_warnings,
)
from bench.sweep import ModeSpec, Sweep, SweepConfig, SweepOutput, harness_cost, ratios_vs_baseline
from bench.workload import WorkloadBuilder
from builders.processes import StartError


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class PeerRunConfig:
    sweep: SweepConfig  # all modes; each group runs its own share
    settings: PeerSettings
    equality_unique: int = 8
    equality_repeated: int = 8
    # Before each group: wait up to this long for other processes to leave the CPUs.
    wait_quiet_s: float = 0.0
    quiet_share: float = 0.25


async def _sweep(sweep: Sweep, make_target: Callable[[], Any]) -> SweepOutput:
    return await sweep.run(make_target())  # the target is made inside the loop that uses it


def group_of(model: str) -> str:
    return model if model in PEER_MODELS else "triton"


def busy_share(window_s: float = 5.0) -> float:
    """Share of all cores busy over ``window_s`` (every process: run it while no server of
    ours is up and it measures other people's work)."""
    import psutil

    from bench.server_stats import machine_busy_s

    before, started = machine_busy_s(), time.perf_counter()
    time.sleep(window_s)
    return (machine_busy_s() - before) / ((time.perf_counter() - started) * (psutil.cpu_count() or 1))


def wait_for_quiet(max_wait_s: float, share: float) -> dict[str, float]:
    """Wait (at most ``max_wait_s``) until the machine's CPUs are busy less than ``share``."""
    started = time.perf_counter()
    busy = busy_share()
    while busy >= share and time.perf_counter() - started < max_wait_s:
        _log(
            f"[peers] other work keeps {busy:.0%} of the CPUs busy; waiting for < {share:.0%} "
            f"({max_wait_s - (time.perf_counter() - started):.0f} s left)"
        )
        busy = busy_share()
    return {"waited_s": time.perf_counter() - started, "busy_share_at_start": busy}


class PeerRun:
    """Groups in order (triton, vllm-colocated, vllm-epd), one server group at a time."""

    GROUP_ORDER = ("triton", COLOCATED, VLLM_EPD)

    def __init__(self, config: PeerRunConfig, start_triton: Callable[[], Any]) -> None:
        self.config = config
        self.start_triton = start_triton
        builder = WorkloadBuilder(config.sweep.workload)
        self.eq_requests = equality_requests(builder, config.equality_unique, config.equality_repeated)
        # A fresh image for the EC-load proof; every other model answers it for reference.
        self.proof_request = builder.build(1, 0.0, "equality", 2)[0]
        self.proof_tokens: dict[str, list[int]] = {}
        self.outputs: list[SweepOutput] = []
        self.records: dict[tuple[str, str], list[RequestRecord]] = {}
        self.equality_rows: list[dict[str, Any]] = []
        self.groups: list[dict[str, Any]] = []
        self.skipped: list[dict[str, Any]] = []
        self.ec_proof: dict[str, Any] | None = None

    def _group(self, name: str, models: Sequence[str]) -> Any:
        if name == "triton":
            return triton_group(self.start_triton, models)
        if name == COLOCATED:
            return vllm_colocated(self.config.settings)
        return vllm_epd(self.config.settings)

    def _group_budget(self, modes: Sequence[ModeSpec]) -> float | None:
        budget = self.config.sweep.time_budget_s
        if budget is None:
            return None
        return budget * len(modes) / max(len(self.config.sweep.modes), 1)

    def run(self) -> SweepOutput:
        started = time.perf_counter()
        for name in self.GROUP_ORDER:
            group_modes = [m for m in self.config.sweep.modes if group_of(m.model) == name]
            if group_modes:
                self._run_group(name, group_modes)
        return self._merge(time.perf_counter() - started)

    def _run_group(self, name: str, group_modes: list[ModeSpec]) -> None:
        models = list(dict.fromkeys(m.model for m in group_modes))
        meta: dict[str, Any] = {"group": name, "modes": [m.label for m in group_modes]}
        self.groups.append(meta)
        if self.config.wait_quiet_s > 0:
            meta["quiet"] = wait_for_quiet(self.config.wait_quiet_s, self.config.quiet_share)
        group_started = time.perf_counter()
        _log(f"[peers] starting {name} for {', '.join(meta['modes'])}")
        try:
            with self._group(name, models) as handle:
                _log(f"[peers] {name} ready in {handle.ready_s:.0f} s at {handle.url}")
                meta.update(url=handle.url, ready_s=handle.ready_s, **handle.description)
                sweep_config = dataclasses.replace(
                    self.config.sweep, modes=group_modes, time_budget_s=self._group_budget(group_modes)
                )
                sweep = Sweep(sweep_config, handle.url, handle.metrics_url, None)
                sweep.meter.server_pids = list(handle.pids)
                output = asyncio.run(_sweep(sweep, lambda: handle.make_target(False)))
                sweep_s = time.perf_counter() - group_started - handle.ready_s
                meta.update(server=output.summary["server"], sweep_s=sweep_s)
                self.outputs.append(output)
                self.records.update(sweep.records)
                checks_started = time.perf_counter()
                ran_models = {e["model"] for e in output.summary["modes"] if e["status"] == "ran"}
                served = [m for m in models if m in ran_models]
                for model in served:
                    self.equality_rows += asyncio.run(
                        run_equality(
                            lambda: handle.make_target(True),
                            model,
                            self.eq_requests,
                            self.config.sweep.request_timeout_s,
                        )
                    )
                    if handle.ec_proof is None:
                        proof = asyncio.run(
                            run_equality(
                                lambda: handle.make_target(False),
                                model,
                                [("unique", self.proof_request)],
                                self.config.sweep.request_timeout_s,
                            )
                        )
                        self.proof_tokens[model] = proof[0]["output_token_ids"]
                if handle.ec_proof is not None and served:
                    self.ec_proof = handle.ec_proof(self.proof_request, dict(self.proof_tokens))
                    _log(f"[peers] EC load proof: {self.ec_proof['reason']}")
                meta["equality_s"] = time.perf_counter() - checks_started
        except Exception as exc:  # one broken group must not lose the others' results
            what = "did not start" if isinstance(exc, StartError) else f"failed ({type(exc).__name__})"
            _log(f"[peers] {name} {what}: {exc}")
            if not isinstance(exc, StartError):
                traceback.print_exc()
            ran = {p["mode"] for out in self.outputs for p in out.summary["points"]}
            self.skipped += [
                {
                    "label": m.label,
                    "model": m.model,
                    "media": m.media,
                    "status": "skipped",
                    "reason": f"{name} {what}: {str(exc).splitlines()[0] if str(exc) else ''}",
                }
                for m in group_modes
                if m.label not in ran
            ]
            meta["error"] = f"{what}: {exc}"
            return
        meta["wall_s"] = time.perf_counter() - group_started
        _log(f"[peers] {name} done in {meta['wall_s']:.0f} s (stopped)")

    def _merge(self, wall_s: float) -> SweepOutput:
        config = self.config.sweep
        order = {m.label: i for i, m in enumerate(config.modes)}
        mode_entries = [m for out in self.outputs for m in out.summary["modes"]] + self.skipped
        mode_entries.sort(key=lambda m: order.get(m["label"], len(order)))
        points = [p for out in self.outputs for p in out.summary["points"]]
        points.sort(key=lambda p: order.get(p["mode"], len(order)))  # stable: load order kept
        raw = [r for out in self.outputs for r in out.raw]
        _label_peer_stages(points)
        groups, records, equality_rows = self.groups, self.records, self.equality_rows
        versions = "; ".join(
            f"{g['group']}: {g['server'].get('name')} {g['server'].get('version')}" for g in groups if "server" in g
        )
        summary = {
            "server": {
                "url": "one server group at a time (see peers.groups)",
                "name": "triton + vLLM peers",
                "version": versions,
            },
            "config": config.describe(),
            "modes": mode_entries,
            "points": points,
            "ratios_vs_baseline": ratios_vs_baseline(points, config.baseline),
            "token_agreement_vs_baseline": agreement_by_policy(records, config.baseline),
            "harness_cost": harness_cost(points),
            "run_wall_s": wall_s,
            "peers": {
                "groups": groups,
                "ratios_vs_best_peer": best_peer_ratios(points),
                "goals": goal_checks(points),
                "warnings": validity_warnings(points),
                "equality": equality_table(equality_rows, config.baseline) | {"rows": equality_rows},
                "ec_load_proof": self.ec_proof,
                "settings": {
                    "model_dir": str(self.config.settings.model_dir),
                    "engine_args": self.config.settings.engine_args,
                    "vllm_env": self.config.settings.vllm_env,
                },
            },
        }
        return SweepOutput(summary, raw)


PEER_EPD_STAGE_SOURCE = (
    "router + client: encode = router's encoder round trip; prefill = TTFT - encode (consumer: "
    "preprocess again, EC load, prefill); decode = e2e - TTFT"
)


def _label_peer_stages(points: Sequence[dict[str, Any]]) -> None:
    for point in points:
        if point.get("status") == "ran" and model_of(point["mode"]) == VLLM_EPD and point["stages"].get("ms"):
            point["stages"]["source"] = PEER_EPD_STAGE_SOURCE

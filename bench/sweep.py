"""Modes x load points x repetitions against one server -> one results document.

A mode is a model name with an optional media policy: ``llm``, ``ensemble``, ``epd``,
``epd:repeated`` (reused media from a small pool, ``repeated_reuse_ratio``, prompts differ),
``epd:unique`` (no reuse) or ``epd:identical`` (every request the same: one pool image, one
prompt), and for ``epd`` an optional serving path (``epd:adaptive``, ``epd:disaggregated:repeated``,
``epd:colocated:identical``), sent as the request parameter ``path``, and an optional ``again``
(``llm:unique:again``): the same mode once more on requests of its own, a control that shows how
far one mode measured twice in the same run lands from itself. A mode whose model is not loaded
is reported as skipped.
For each (mode, point): warm-up requests (excluded), then ``reps`` measured runs whose
summaries are reduced to their median; /metrics and CPU time are read around each run.
Modes run one after the other (every point of a mode, then the next mode), or with
``interleave`` point by point (every mode at the first point, then every mode at the next) and
within a point repetition by repetition (every mode's first repetition, then every mode's
second, in an order drawn each round), so that on a shared machine whose load drifts the
modes compared at one point ran seconds apart, not a sweep (or a mode's repetitions) apart.
In the serving-path benchmark's runs 1-9 (docs/benchmarks/serving-paths.md) ``interleave`` ran
a mode's repetitions back to back; within-mode spread then showed up as one mode's bias (the same
path measured 1.44x apart at one point of run 9).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.loadgen import LoadPoint
from bench.metrics import RequestRecord, Slo
from bench.path_choice import adaptive_choices
from bench.point_run import PointRun, log, not_run
from bench.server_stats import DEFAULT_CACHE_HIT_METRIC, DEFAULT_ENCODE_METRIC, CpuMeter, ModeLayout, discover_layout
from bench.stages import disaggregation_reading
from bench.triton_target import TritonGrpcTarget
from bench.workload import WorkloadBuilder, WorkloadSpec

MEDIA_POLICIES = ("default", "unique", "repeated", "identical")
PATH_POLICIES = ("adaptive", "disaggregated", "colocated")  # epd's (python_backends/contract)
# Request keys of an ``again`` mode: repetition + offset (under point_run.NOISE_RETRY_KEY_STRIDE), so
# that the control never sends a request (prompt, image) its original sent: a cache hit is not a control.
AGAIN_KEY_OFFSET = 500
AGAIN = "again"
# epd reads decode as one BLS stream (the pattern polls replaced; the server must allow it:
# python_backends/contract DECODE_READS), to measure what the polls cost side by side.
STREAM_DECODE = "stream-decode"
RATIO_METRICS = (
    ("ttft_ms", "p50"),
    ("ttft_ms", "p90"),
    ("tpot_ms", "p50"),
    ("itl_ms", "p50"),
    ("e2e_ms", "p50"),
    ("e2e_ms", "p90"),
    ("request_throughput", None),
    ("output_token_throughput", None),
)


@dataclass(frozen=True)
class ModeSpec:
    label: str
    model: str
    media: str = "default"
    path: str | None = None  # epd's serving path (request parameter ``path``)
    again: bool = False  # a control: the same mode again, on requests of its own
    stream_decode: bool = False  # epd reads decode as a stream (request parameter ``decode_reads``)

    @classmethod
    def parse(cls, text: str) -> ModeSpec:
        model, *options = text.split(":")
        media, path, again, stream_decode = "default", None, False, False
        for option in options:
            if option in MEDIA_POLICIES and media == "default":
                media = option
            elif option in PATH_POLICIES and path is None:
                path = option
            elif option == AGAIN and not again:
                again = True
            elif option == STREAM_DECODE and not stream_decode:
                stream_decode = True
            else:
                raise ValueError(
                    f"mode {text!r}: use MODEL[:PATH][:MEDIA][:{AGAIN}][:{STREAM_DECODE}], PATH one of "
                    f"{PATH_POLICIES} (epd), MEDIA one of {MEDIA_POLICIES[1:]}"
                )
        if not model:
            raise ValueError(f"mode {text!r} names no model")
        return cls(text, model, media, path, again, stream_decode)

    def key_rep(self, rep: int) -> int:
        """The repetition number its requests are drawn with (``again``: a range of its own)."""
        return rep + AGAIN_KEY_OFFSET if self.again else rep

    def reuse_ratio(self, spec: WorkloadSpec) -> float:
        return {"default": spec.reuse_ratio, "unique": 0.0, "repeated": spec.repeated_reuse_ratio, "identical": 1.0}[
            self.media
        ]

    @property
    def identical(self) -> bool:
        return self.media == "identical"

    @property
    def media_namespace(self) -> str:
        """epd's fixed paths get unique images of their own: one epd mode's encodes would make
        another's unique images store hits. ``llm`` and ``epd``/``epd:adaptive`` (the pair the
        path goals compare) see the same images, so their tokens compare request by request."""
        return f"{self.path}/" if self.path in ("disaggregated", "colocated") else ""

    def prepare_options(self) -> dict[str, Any]:
        """Keyword arguments of the target's ``prepare`` for this mode (a path: Triton targets only)."""
        parameters: dict[str, str] = {"path": self.path} if self.path else {}
        if self.stream_decode:
            parameters["decode_reads"] = "stream"
        return {"parameters": parameters} if parameters else {}


@dataclass
class SweepConfig:
    modes: list[ModeSpec]
    points: list[LoadPoint]
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    requests_per_point: int = 32
    warmup_requests: int = 4
    reps: int = 1
    max_seconds_per_point: float = 120.0
    request_timeout_s: float = 120.0
    time_budget_s: float | None = None
    slo: Slo = field(default_factory=Slo)
    baseline: str = "llm"
    max_inflight: int = 256
    cache_hit_metric: str = DEFAULT_CACHE_HIT_METRIC
    encode_metric: str = DEFAULT_ENCODE_METRIC
    progress: bool = True
    # Shared machines: a repetition during which other processes took more than this share
    # of the CPUs is measured again (fresh requests), at most ``noise_retries`` times.
    max_noise: float | None = None
    noise_retries: int = 2
    # Warm-up of modes with reuse starts with one request per pool image (WorkloadBuilder.pool_primers).
    prime_pool: bool = False
    # Point by point (every mode at a point before the next point) instead of mode by mode.
    interleave: bool = False

    def describe(self) -> dict[str, Any]:
        return {
            "modes": [m.label for m in self.modes],
            "points": [p.label for p in self.points],
            "workload": self.workload.describe(),
            "requests_per_point": self.requests_per_point,
            "warmup_requests": self.warmup_requests,
            "reps": self.reps,
            "max_seconds_per_point": self.max_seconds_per_point,
            "request_timeout_s": self.request_timeout_s,
            "time_budget_s": self.time_budget_s,
            "slo_ms": {"ttft": self.slo.ttft_ms, "tpot": self.slo.tpot_ms, "e2e": self.slo.e2e_ms},
            "baseline": self.baseline,
            "cache_hit_metric": self.cache_hit_metric,
            "encode_metric": self.encode_metric,
            "max_noise": self.max_noise,
            "noise_retries": self.noise_retries,
            "prime_pool": self.prime_pool,
            "interleave": self.interleave,
        }


@dataclass
class SweepOutput:
    summary: dict[str, Any]
    raw: list[dict[str, Any]]


class Sweep:
    """One run of a ``SweepConfig`` against one server (see module docstring)."""

    def __init__(
        self,
        config: SweepConfig,
        grpc_url: str,
        metrics_url: str | None,
        server_pid: int | None,
        halted: Callable[[], str | None] | None = None,
    ) -> None:
        """``halted``: why the server can no longer be measured (a stage died or hangs), else None;
        asked before each point and repetition: what is left is then reported as not run."""
        self.config = config
        self.halted = halted or (lambda: None)
        self.grpc_url = grpc_url
        self.metrics_url = metrics_url
        self.meter = CpuMeter(server_pid)
        self.builder = WorkloadBuilder(config.workload)
        self.raw: list[dict[str, Any]] = []
        self.records: dict[tuple[str, str], list[RequestRecord]] = {}
        self.started = 0.0
        self.mode_deadline: float | None = None

    def _over_budget(self) -> bool:
        return self.mode_deadline is not None and time.perf_counter() > self.mode_deadline

    def _not_running(self, budget: str) -> str | None:
        """Why the next point does not run (the server was lost, or ``budget`` was spent), if so."""
        halted = self.halted()
        if halted is not None:
            return halted
        return f"{budget} was spent" if self._over_budget() else None

    def _start_mode_clock(self, modes_left: int) -> None:
        """Split what is left of the time budget evenly over the modes still to run, so a
        slow first mode cannot starve the last one (each mode then has its low loads at least)."""
        budget = self.config.time_budget_s
        if budget is None:
            return
        now = time.perf_counter()
        remaining = max(0.0, self.started + budget - now)
        self.mode_deadline = now + remaining / max(modes_left, 1)

    async def run(self, target: Any = None) -> SweepOutput:
        """``target`` defaults to a gRPC client of ``grpc_url`` (tests pass a scripted one)."""
        self.started = time.perf_counter()
        target = target or TritonGrpcTarget(self.grpc_url)
        try:
            server = await target.client.get_server_metadata(as_json=True)
            reasons = {m.label: await target.not_ready_reason(m.model) for m in self.config.modes}
            runnable = [m for m in self.config.modes if reasons[m.label] is None]
            modes, points = [], []
            for mode in self.config.modes:
                if reasons[mode.label] is not None:
                    log(f"[bench] skipping mode {mode.label}: {reasons[mode.label]}")
                    modes.append(
                        {
                            "label": mode.label,
                            "model": mode.model,
                            "media": mode.media,
                            "status": "skipped",
                            "reason": reasons[mode.label],
                        }
                    )
                    continue
                if not self.config.interleave:
                    self._start_mode_clock(len(runnable) - runnable.index(mode))
                    mode_entry, mode_points = await self._run_mode(target, mode)
                    modes.append(mode_entry)
                    points.extend(mode_points)
            if self.config.interleave:
                interleaved_modes, points = await self._run_interleaved(target, runnable)
                order = {label: i for i, label in enumerate(m.label for m in self.config.modes)}
                modes = sorted(modes + interleaved_modes, key=lambda m: order[m["label"]])
        finally:
            await target.close()
        summary = {
            "server": {"url": self.grpc_url, "name": server.get("name"), "version": server.get("version")},
            "config": self.config.describe(),
            "modes": modes,
            "points": points,
            "ratios_vs_baseline": self._ratios(points),
            "token_agreement_vs_baseline": self._token_agreement(),
            "adaptive_choices": adaptive_choices(points, self.config.modes, self.config.baseline),
            "harness_cost": harness_cost(points),
            "run_wall_s": time.perf_counter() - self.started,
            "halted": self.halted(),
        }
        return SweepOutput(summary, self.raw)

    async def _mode_entry(self, target: Any, mode: ModeSpec) -> tuple[dict[str, Any], ModeLayout]:
        entry: dict[str, Any] = {"label": mode.label, "model": mode.model, "media": mode.media}
        layout = await discover_layout(target.client, mode.model)
        entry.update(status="ran", reuse_ratio=mode.reuse_ratio(self.config.workload), layout=layout.to_json())
        return entry, layout

    async def _point_or_skip(
        self, target: Any, mode: ModeSpec, layout: ModeLayout, index: int, point: LoadPoint, share: str
    ) -> dict[str, Any]:
        if (reason := self._not_running(share)) is not None:
            log(f"[bench] {mode.label} {point.label} not run: {reason}")
            return not_run(mode, point, reason)
        return await self._run_point(target, mode, layout, index, point)

    async def _run_mode(self, target: Any, mode: ModeSpec) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        entry, layout = await self._mode_entry(target, mode)
        points = []
        for index, point in enumerate(self.config.points):
            share = "this mode's share of --time-budget"
            points.append(await self._point_or_skip(target, mode, layout, index, point, share))
        self._read(entry, mode, points)
        return entry, points

    async def _run_interleaved(
        self, target: Any, modes: Sequence[ModeSpec]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Every mode at one point before the next point, and at a point repetition by
        repetition: every mode's warm-up, then round r runs every mode's repetition r, in an
        order drawn per round (seeded: :func:`round_order`). The time budget is the sweep's."""
        budget = self.config.time_budget_s
        self.mode_deadline = None if budget is None else self.started + budget
        entries = [await self._mode_entry(target, mode) for mode in modes]
        per_mode: list[list[dict[str, Any]]] = [[] for _ in modes]
        for index, point in enumerate(self.config.points):
            if (reason := self._not_running("--time-budget")) is not None:
                log(f"[bench] {point.label} not run: {reason}")
                for mode, mode_points in zip(modes, per_mode, strict=True):
                    mode_points.append(not_run(mode, point, reason))
                continue
            runs = [
                PointRun(self, target, mode, layout, index, point)
                for mode, (_, layout) in zip(modes, entries, strict=True)
            ]
            for run in runs:
                await run.warm()
            for rep in range(self.config.reps):
                for position in round_order(len(runs), self.config.workload.seed, index, rep):
                    if self.halted() is None:
                        await runs[position].measure(rep)
            for run, mode_points in zip(runs, per_mode, strict=True):
                mode_points.append(run.result_ornot_run())
        for mode, (entry, _), mode_points in zip(modes, entries, per_mode, strict=True):
            self._read(entry, mode, mode_points)
        return [entry for entry, _ in entries], [p for mode_points in per_mode for p in mode_points]

    def _read(self, entry: dict[str, Any], mode: ModeSpec, points: Sequence[dict[str, Any]]) -> None:
        ran = [p for p in points if p.get("status") == "ran"]
        if ran:
            # Read at the highest closed-loop concurrency: that is where splitting stages
            # could pay; an open-loop point stands in when there is no closed-loop one.
            closed = [p for p in ran if p["load_kind"] == "concurrency"]
            top = max(closed, key=lambda p: p["load"]) if closed else ran[-1]
            entry["reading"] = disaggregation_reading(
                mode.label, top["load_label"], top["stages"], top["load"] if closed else None
            )

    async def _run_point(
        self, target: Any, mode: ModeSpec, layout: ModeLayout, index: int, point: LoadPoint
    ) -> dict[str, Any]:
        run = PointRun(self, target, mode, layout, index, point)
        await run.warm()
        for rep in range(self.config.reps):
            if self.halted() is None:
                await run.measure(rep)
        return run.result_ornot_run()

    def _ratios(self, points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        return ratios_vs_baseline(points, self.config.baseline)

    def _token_agreement(self) -> dict[str, float | None]:
        """Share of requests whose output tokens equal the baseline's for the same request
        (greedy decoding makes this 1.0 when the modes serve the same model); compared only
        where both modes sent the same media."""
        workload = self.config.workload
        modes = {m.label: m for m in self.config.modes}
        base_mode = modes.get(self.config.baseline)
        agreement: dict[str, float | None] = {}
        if base_mode is None:
            return agreement
        for (label, load), records in self.records.items():
            base = self.records.get((self.config.baseline, load))
            if label == self.config.baseline or base is None:
                continue
            mode = modes[label]
            if mode.reuse_ratio(workload) != base_mode.reuse_ratio(workload):
                continue
            if mode.media_namespace != base_mode.media_namespace:  # images of its own: no pairs to compare
                continue
            base_tokens = {r.key: r.output_token_ids for r in base if r.ok}
            pairs = [(r.output_token_ids, base_tokens[r.key]) for r in records if r.ok and r.key in base_tokens]
            agreement[f"{label} {load}"] = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
        return agreement


def round_order(modes: int, seed: int, point: int, rep: int) -> list[int]:
    """The order of the modes in one interleaved round: a permutation drawn per (point, round).
    Each round once rotated one fixed order by one mode (docs/benchmarks/serving-paths.md, run
    17), which kept nearly every mode right after the same other one in every round: whatever a mode leaves behind (an
    engine warm or cold, work still running) then biased the next one the same way each time.
    Drawn orders spread that over the modes."""
    return [int(i) for i in np.random.default_rng([seed, 11, point, rep]).permutation(modes)]


def ratios_vs_baseline(points: Sequence[dict[str, Any]], baseline_mode: str) -> list[dict[str, Any]]:
    """Each mode's RATIO_METRICS over the baseline mode's at the same load point."""
    baseline = {p["load_label"]: p for p in points if p["mode"] == baseline_mode and p.get("status") == "ran"}
    ratios = []
    for p in points:
        base = baseline.get(p.get("load_label", ""))
        if p.get("status") != "ran" or base is None or p["mode"] == baseline_mode:
            continue
        row: dict[str, Any] = {"mode": p["mode"], "load_label": p["load_label"]}
        for metric, stat in RATIO_METRICS:
            row[f"{metric}_{stat}" if stat else metric] = _ratio(
                _pick(p["summary"], metric, stat), _pick(base["summary"], metric, stat)
            )
        ratios.append(row)
    return ratios


def _pick(summary: dict[str, Any], metric: str, stat: str | None) -> float | None:
    value = summary.get(metric)
    return value.get(stat) if stat and isinstance(value, dict) else value


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def harness_cost(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Client (load generator) CPU per request against the server's, over all measured runs."""
    client = server = 0.0
    requests = 0
    server_known = True
    others = []
    for point in points:
        for rep in point.get("reps", []):
            cpu = rep["cpu"]
            if cpu.get("other_processes_cpu_share") is not None:
                others.append(cpu["other_processes_cpu_share"])
            client += cpu["client_cpu_s"]
            requests += rep["requests"] + rep["errors"]
            if cpu["server_cpu_s"] is None:
                server_known = False
            else:
                server += cpu["server_cpu_s"]
    per = max(requests, 1)
    return {
        "requests": requests,
        "client_cpu_s": client,
        "server_cpu_s": server if server_known else None,
        "client_cpu_ms_per_request": 1000.0 * client / per,
        "server_cpu_ms_per_request": 1000.0 * server / per if server_known else None,
        "client_share_of_server_cpu": client / server if server_known and server else None,
        # Share of the machine's CPU that other processes took during the measured windows.
        "other_processes_cpu_share_mean": float(np.mean(others)) if others else None,
        "other_processes_cpu_share_max": max(others) if others else None,
    }

"""One mode at one load point of a sweep (bench/sweep.py): warm-up, measured repetitions (each
measured again with fresh requests while other processes take too much of the CPUs), /metrics and
CPU time around each, and the point's entry of the results document."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from bench.loadgen import LoadPoint, closed_loop, run_point
from bench.metrics import RequestRecord, median_summary, summarize
from bench.server_stats import ModeLayout, counter_deltas, cpu_usage, per_model_server_ms, scrape, sum_counter
from bench.stages import stage_breakdown

if TYPE_CHECKING:
    from bench.sweep import ModeSpec, Sweep

# Request keys of a noise retry: repetition + stride x attempt, never a key measured before.
NOISE_RETRY_KEY_STRIDE = 1000


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def not_run(mode: ModeSpec, point: LoadPoint, reason: str) -> dict[str, Any]:
    return {"mode": mode.label, "load_label": point.label, "status": f"not run: {reason}"}


@dataclass
class PointRun:
    """One mode at one load point: its warm-up, its repetitions (each measured again with fresh
    requests while other processes took more than ``max_noise`` of the CPUs), its point entry."""

    sweep: Sweep  # the run this point belongs to: its config, builder, meter, raw output, records
    target: Any
    mode: ModeSpec
    layout: ModeLayout
    index: int
    point: LoadPoint
    reps: list[dict[str, Any]] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)

    @property
    def reuse(self) -> float:
        return self.mode.reuse_ratio(self.sweep.config.workload)

    async def _send(self, prepared: Any) -> RequestRecord:
        return await self.target.send(self.mode.model, prepared, self.sweep.config.request_timeout_s)

    def _prepare(self, requests: Sequence[Any]) -> list[Any]:
        return [self.target.prepare(r, self.mode.model, **self.mode.prepare_options()) for r in requests]

    def _build(self, count: int, phase: str, rep: int) -> list[Any]:
        mode = self.mode
        return self.sweep.builder.build(count, self.reuse, phase, self.index, rep, mode.identical, mode.media_namespace)

    async def warm(self) -> None:
        config = self.sweep.config
        if not config.warmup_requests:
            return
        # prime_pool: a mode with reuse first shows the server every pool image (its repeated media).
        primers = self.sweep.builder.pool_primers() if self.reuse > 0 and config.prime_pool else []
        warm = self._prepare(primers + self._build(config.warmup_requests, "warmup", self.mode.key_rep(0)))
        await closed_loop(self._send, warm, self.point.warmup_concurrency, config.max_seconds_per_point, lambda: None)

    async def measure(self, rep: int) -> None:
        config, mode = self.sweep.config, self.mode
        for attempt in range(config.noise_retries + 1):
            # A retry gets fresh requests (its own key range): the discarded attempt's
            # unique images are in the server's caches now.
            key_rep = mode.key_rep(rep) + NOISE_RETRY_KEY_STRIDE * attempt
            items = self._prepare(self._build(config.requests_per_point, "measure", key_rep))
            rep_summary, rep_records = await self._measure(items, rep)
            other = rep_summary["cpu"].get("other_processes_cpu_share")
            quiet = config.max_noise is None or other is None or other <= config.max_noise
            if quiet or attempt == config.noise_retries:
                break
            log(
                f"[bench] {mode.label} {self.point.label} rep {rep + 1}: other processes took {other:.0%} of the CPUs "
                f"(> {config.max_noise:.0%}); measuring this repetition again with fresh requests"
            )
        rep_summary["noisy_attempts_discarded"] = attempt
        self.reps.append(rep_summary)
        self.records.extend(rep_records)
        self.sweep.raw.extend(
            {"mode": mode.label, "load_label": self.point.label, "rep": rep, **r.to_json()} for r in rep_records
        )

    async def _measure(self, items: list[Any], rep: int) -> tuple[dict[str, Any], list[RequestRecord]]:
        sweep, config, mode, point = self.sweep, self.sweep.config, self.mode, self.point
        rng = np.random.default_rng([config.workload.seed, 7, self.index, rep])
        description = f"{mode.label} {point.label} rep {rep + 1}/{config.reps}"
        before_metrics = scrape(sweep.metrics_url)
        # Objects made so far (workload, earlier records) never need collecting again: a
        # full GC pass in the middle of a point would show up as client-side latency.
        gc.collect()
        gc.freeze()
        with tqdm(total=len(items), desc=description, leave=False, disable=not config.progress, file=sys.stderr) as bar:
            before_cpu = sweep.meter.sample()
            result = await run_point(
                self._send, items, point, config.max_seconds_per_point, rng, lambda: bar.update(1), config.max_inflight
            )
            after_cpu = sweep.meter.sample()
        deltas = counter_deltas(before_metrics, scrape(sweep.metrics_url))
        summary = summarize(result.records, config.slo)
        instances = self.layout.total_instances or 1
        summary.update(
            not_sent=result.not_sent,
            max_dispatch_lag_ms=result.max_dispatch_lag_s * 1000.0,
            request_throughput_per_instance=_per(summary["request_throughput"], instances),
            output_token_throughput_per_instance=_per(summary["output_token_throughput"], instances),
            cache_hits=sum_counter(deltas, config.cache_hit_metric),
            encodes=sum_counter(deltas, config.encode_metric),
            cpu=cpu_usage(before_cpu, after_cpu, len(result.records)),
            load_average_1m=os.getloadavg()[0],
            per_model_server_ms=per_model_server_ms(deltas, self.layout.models),
            server_counters=deltas,
        )
        ttft = summary["ttft_ms"]["p50"]
        log(
            f"[bench] {description}: {summary['requests']} ok, {summary['errors']} errors, "
            f"TTFT p50 {ttft if ttft is None else round(ttft)} ms, "
            f"{_fmt(summary['request_throughput'])} req/s, {_fmt(summary['output_token_throughput'])} tok/s"
        )
        return summary, result.records

    def result_ornot_run(self) -> dict[str, Any]:
        """The point's entry; a point during which the server was lost is not run (its records
        stay in the raw output)."""
        halted = self.sweep.halted()
        return self.result() if halted is None else not_run(self.mode, self.point, halted)

    def result(self) -> dict[str, Any]:
        mode, point = self.mode, self.point
        self.sweep.records[(mode.label, point.label)] = self.records
        summary = median_summary(self.reps)
        return {
            "mode": mode.label,
            "model": mode.model,
            "status": "ran",
            "load_kind": point.kind,
            "pattern": point.pattern,
            "load": point.value,
            "load_label": point.label,
            "summary": summary,
            "reps": self.reps,
            "stages": stage_breakdown(self.records, summary.get("per_model_server_ms", {}), self.layout),
        }


def _per(value: float | None, instances: int) -> float | None:
    return None if value is None else value / instances


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"

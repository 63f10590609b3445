"""Per-request records and the metric math: TTFT, TPOT, ITL, e2e, throughput, goodput.

Definitions (the ones vLLM's and SGLang's serving benchmarks use):

* TTFT: send -> first response carrying output.
* e2e: send -> last response.
* TPOT: (e2e - TTFT) / (output tokens - 1), per request; requests with one token have none.
* ITL: gaps between consecutive responses. A response that carries k > 1 tokens
  (the engine batched several steps) counts as k gaps of gap/k each, as SGLang does,
  so ITL percentiles stay per token.
* Throughput: completed requests (and their output tokens) / measured window, the
  window running from the first send to the last response of the measured requests.
* Goodput: completed requests per second that met every SLO given (TTFT and/or TPOT
  and/or e2e), as in DistServe and vLLM's ``--goodput``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from bench.workload import BenchRequest

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What one request did, in seconds relative to its send time (``sent_at`` is
    relative to the start of its load point)."""

    key: str
    sent_at: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str = ""
    error: str | None = None
    # Optional per-request server outputs: stage timings (ms) and cache hits.
    stage_ms: dict[str, float] = field(default_factory=dict)
    cache_hits: int | None = None
    serving_path: str | None = None  # epd: the path that served it
    num_images: int = 0
    reused_images: int = 0
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def output_tokens(self) -> int:
        """Server's count when it sent one, else what the chunks carried."""
        return self.num_output_tokens or sum(self.chunk_tokens) or len(self.chunk_times)

    @classmethod
    async def of_request(
        cls,
        request: BenchRequest,
        stream: Callable[[RequestRecord, float], Awaitable[None]],
        timeout_s: float,
    ) -> RequestRecord:
        """The record of one request that ``stream(record, started)`` sends and reads; a
        target's transport and server errors end up in ``record.error``, never raised."""
        record = cls(key=request.key, num_images=len(request.images), reused_images=request.reused_images)
        started = time.perf_counter()
        try:
            await asyncio.wait_for(stream(record, started), timeout_s)
        except asyncio.TimeoutError:
            record.error = f"timeout after {timeout_s:.0f} s"
        except Exception as exc:  # one failed request must not end the run
            record.error = f"{type(exc).__name__}: {exc}"
        return record

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        # Microseconds are plenty and keep raw.json small enough to commit.
        data["sent_at"] = round(self.sent_at, 6)
        data["chunk_times"] = [round(t, 6) for t in self.chunk_times]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**data)


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; None means 'not judged'."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))


def ttft_s(record: RequestRecord) -> float:
    return record.chunk_times[0]


def e2e_s(record: RequestRecord) -> float:
    return record.chunk_times[-1]


def tpot_s(record: RequestRecord) -> float | None:
    tokens = record.output_tokens
    if tokens < 2:
        return None
    return (e2e_s(record) - ttft_s(record)) / (tokens - 1)


def inter_token_latencies(chunk_times: Sequence[float], chunk_tokens: Sequence[int] | None = None) -> list[float]:
    """Per-token gaps from response arrival times; a k-token response gives k gaps of gap/k.

    ``chunk_tokens`` may be empty (server sent no token ids): then one token per response.
    """
    tokens = list(chunk_tokens) if chunk_tokens else [1] * len(chunk_times)
    gaps: list[float] = []
    for i in range(1, len(chunk_times)):
        gap = chunk_times[i] - chunk_times[i - 1]
        k = max(tokens[i], 1) if i < len(tokens) else 1
        gaps.extend([gap / k] * k)
    return gaps


def distribution(values: Iterable[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean and percentiles (numpy's linear interpolation); None when there is no value."""
    array = np.asarray([v for v in values if v is not None], dtype=float) * scale
    if array.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    quantiles = np.percentile(array, PERCENTILES)
    return {"mean": float(array.mean()), **{f"p{p}": float(q) for p, q in zip(PERCENTILES, quantiles, strict=True)}}


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    if not record.ok:
        return False
    checks = (
        (slo.ttft_ms, ttft_s(record)),
        (slo.tpot_ms, tpot_s(record)),
        (slo.e2e_ms, e2e_s(record)),
    )
    # A request without a TPOT (one token) cannot violate a TPOT objective.
    return all(limit is None or value is None or value * 1000.0 <= limit for limit, value in checks)


def measured_window_s(records: Sequence[RequestRecord]) -> float:
    """First send -> last response among the completed requests."""
    done = [r for r in records if r.ok]
    if not done:
        return 0.0
    start = min(r.sent_at for r in done)
    end = max(r.sent_at + e2e_s(r) for r in done)
    return end - start


def goodput(records: Sequence[RequestRecord], slo: Slo, window_s: float) -> float | None:
    if not slo.any or window_s <= 0:
        return None
    return sum(meets_slo(r, slo) for r in records) / window_s


def summarize(records: Sequence[RequestRecord], slo: Slo = Slo()) -> dict[str, Any]:
    """The summary of one load point (one repetition); milliseconds for latencies."""
    done = [r for r in records if r.ok]
    window = measured_window_s(records)
    output_tokens = sum(r.output_tokens for r in done)
    summary: dict[str, Any] = {
        "requests": len(done),
        "errors": len(records) - len(done),
        "window_s": window,
        "request_throughput": len(done) / window if window > 0 else None,
        "output_token_throughput": output_tokens / window if window > 0 else None,
        "ttft_ms": distribution((ttft_s(r) for r in done), 1000.0),
        "tpot_ms": distribution((tpot_s(r) for r in done), 1000.0),
        "itl_ms": distribution(
            (gap for r in done for gap in inter_token_latencies(r.chunk_times, r.chunk_tokens)), 1000.0
        ),
        "e2e_ms": distribution((e2e_s(r) for r in done), 1000.0),
        "mean_input_tokens": _mean(r.num_input_tokens for r in done),
        "mean_output_tokens": _mean(r.output_tokens for r in done),
        "goodput": goodput(records, slo, window),
        "goodput_fraction": (sum(meets_slo(r, slo) for r in records) / len(records)) if slo.any and records else None,
    }
    hits = [r.cache_hits for r in done if r.cache_hits is not None]
    summary["cache_hits_reported"] = sum(hits) if hits else None
    paths = [r.serving_path for r in done if r.serving_path]
    summary["serving_paths"] = {path: paths.count(path) for path in sorted(set(paths))} if paths else None
    return summary


def _mean(values: Iterable[float]) -> float | None:
    array = np.fromiter(values, dtype=float)
    return float(array.mean()) if array.size else None


def median_summary(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median of each numeric leaf across repetitions (nested dicts kept as they are)."""
    keys = list(dict.fromkeys(key for s in summaries for key in s))  # a counter may move in one rep only
    merged: dict[str, Any] = {}
    for key in keys:
        values = [s.get(key) for s in summaries]
        if any(isinstance(v, dict) for v in values):
            merged[key] = median_summary([v for v in values if isinstance(v, dict)])
        elif all(v is None or isinstance(v, (int, float)) for v in values):
            numbers = [v for v in values if v is not None]
            merged[key] = float(np.median(numbers)) if numbers else None
        else:
            merged[key] = next(v for v in values if v is not None)
    return merged

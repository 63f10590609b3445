"""Closed- and open-loop dispatch of prepared requests, bounded in count and time.

* Closed loop (``concurrency``): N workers, each sends its next request as soon as its
  previous one finished; the usual concurrency sweep.
* Open loop (``rate``): requests leave at precomputed times, Poisson (exponential gaps)
  or in bursts of ``burst_size`` every ``burst_size / rate`` seconds, whether or not
  earlier ones finished. Latencies count from the *scheduled* time, so a lagging client
  or a full in-flight cap shows up as latency instead of hiding (coordinated omission).

Both stop issuing requests once ``max_seconds`` have passed; what was issued finishes
(each request has its own timeout in the target).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.metrics import RequestRecord

Send = Callable[[Any], Awaitable[RequestRecord]]
Tick = Callable[[], None]
ARRIVAL_PATTERNS = ("poisson", "burst")


@dataclass(frozen=True)
class LoadPoint:
    """One point of a sweep: ``concurrency`` N (closed loop) or ``rate`` R req/s (open loop)."""

    kind: str  # "concurrency" | "rate"
    value: float
    pattern: str = "closed"  # "closed" | "poisson" | "burst"
    burst_size: int = 1

    @property
    def label(self) -> str:
        if self.kind == "concurrency":
            return f"c={int(self.value)}"
        burst = f"x{self.burst_size}" if self.pattern == "burst" else ""
        return f"{self.pattern}{burst} {self.value:g}/s"

    @property
    def warmup_concurrency(self) -> int:
        return int(self.value) if self.kind == "concurrency" else max(1, min(4, int(np.ceil(self.value))))


@dataclass
class LoadResult:
    records: list[RequestRecord]
    wall_s: float
    not_sent: int = 0  # requests left when the time bound hit
    max_dispatch_lag_s: float = 0.0  # open loop: worst lateness of a send vs its schedule
    extra: dict[str, Any] = field(default_factory=dict)


def arrival_offsets(pattern: str, rate: float, count: int, rng: np.random.Generator, burst_size: int = 1) -> np.ndarray:
    """Send times (s from the start) of ``count`` requests at mean ``rate`` req/s."""
    if rate <= 0:
        raise ValueError("request rate must be > 0")
    if pattern == "poisson":
        gaps = rng.exponential(1.0 / rate, size=count)
        return np.concatenate(([0.0], np.cumsum(gaps[:-1]))) if count else gaps  # first one at once
    if pattern == "burst":
        if burst_size < 1:
            raise ValueError("burst size must be >= 1")
        return (np.arange(count) // burst_size) * (burst_size / rate)
    raise ValueError(f"unknown arrival pattern {pattern!r}; use one of {ARRIVAL_PATTERNS}")


async def closed_loop(send: Send, items: Sequence[Any], concurrency: int, max_seconds: float, tick: Tick) -> LoadResult:
    pending = iter(items)  # shared by the workers: each takes the next item (one loop, no lock needed)
    records: list[RequestRecord] = []
    started = time.perf_counter()

    async def worker() -> None:
        for item in pending:
            sent_at = time.perf_counter() - started
            if sent_at > max_seconds:
                return
            record = await send(item)
            record.sent_at = sent_at
            records.append(record)
            tick()

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    return LoadResult(records, time.perf_counter() - started, not_sent=len(items) - len(records))


async def open_loop(
    send: Send,
    items: Sequence[Any],
    offsets: Sequence[float],
    max_seconds: float,
    max_inflight: int,
    tick: Tick,
) -> LoadResult:
    records: list[RequestRecord] = []
    lags: list[float] = [0.0]
    slots = asyncio.Semaphore(max_inflight)
    started = time.perf_counter()

    async def one(item: Any, offset: float) -> None:
        async with slots:
            lag = time.perf_counter() - started - offset
            lags.append(lag)
            record = await send(item)
        record.sent_at = offset
        record.chunk_times = [t + lag for t in record.chunk_times]  # count from the schedule
        records.append(record)
        tick()

    tasks = []
    for item, offset in zip(items, offsets, strict=True):
        if offset > max_seconds:
            break
        delay = started + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(item, float(offset))))
    await asyncio.gather(*tasks)
    return LoadResult(records, time.perf_counter() - started, len(items) - len(tasks), max(lags))


async def run_point(
    send: Send,
    items: Sequence[Any],
    point: LoadPoint,
    max_seconds: float,
    rng: np.random.Generator,
    tick: Tick,
    max_inflight: int = 256,
) -> LoadResult:
    if point.kind == "concurrency":
        return await closed_loop(send, items, int(point.value), max_seconds, tick)
    offsets = arrival_offsets(point.pattern, point.value, len(items), rng, point.burst_size)
    return await open_loop(send, items, offsets, max_seconds, max_inflight, tick)

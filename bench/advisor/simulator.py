"""Discrete-event model (SimPy) of colocated and disaggregated (xE+yP+zD, xE+yPD) serving.

What it models, and why each piece is there:
- An engine is vLLM-like continuous batching: one step at a time; a step prefills the waiting
  prompts that fit and advances every running sequence by one token, and costs
  ``EngineCosts.step_ms`` (so TPOT grows with the batch, TTFT waits for the step in progress).
- The colocated engine also runs the vision tower inside its step (``vit_ms_per_patch``): an image
  stalls every decoding sequence of that step (the interference disaggregation removes).
- Frontends (the ``llm`` python model, the ``epd`` BLS) are serial Python: per-request work and
  per-token relaying queue behind each other.
- ``Profile.shared_cpu_slots``: on a CPU machine every piece of work above also needs a core from
  one shared pool (a SimPy ``Resource``), taken in time slices so that concurrent work shares the
  cores round-robin like the OS scheduler; without it each instance owns its device.
- ``Profile.cpu_sets``: each role on cores of its own instead (``--cpus``): one such pool per
  distinct set, so the encoders never slow the PD engine down and the reverse.
Latencies are measured per request as a client sees them (TTFT = first token relayed, e2e = last).
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import statistics
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import simpy

from bench.advisor.profiles import CPU_ROLES, EngineCosts, FrontendCosts, Profile

Proc = Generator[Any, Any, Any]


@dataclass(frozen=True)
class Layout:
    """``colocated`` (n engines, each E+P+D) or disaggregated: x encoders + y prefill + z decode
    engines, or x encoders + y combined prefill/decode (PD) engines."""

    colocated: int = 0
    encoders: int = 0
    prefills: int = 0
    decodes: int = 0
    pds: int = 0

    @classmethod
    def parse(cls, text: str) -> Layout:
        text = text.strip().upper()
        if m := re.fullmatch(r"COLOCATED(?:[:X](\d+))?", text):
            return cls(colocated=int(m.group(1) or 1))
        if m := re.fullmatch(r"(\d+)E\+(\d+)P\+(\d+)D", text):
            return cls(encoders=int(m.group(1)), prefills=int(m.group(2)), decodes=int(m.group(3)))
        if m := re.fullmatch(r"(\d+)E\+(\d+)PD", text):
            return cls(encoders=int(m.group(1)), pds=int(m.group(2)))
        raise ValueError(f"layout {text!r}: use colocated[:N], xE+yP+zD or xE+yPD")

    @property
    def is_colocated(self) -> bool:
        return self.colocated > 0

    @property
    def instances(self) -> int:
        return self.colocated + self.encoders + self.prefills + self.decodes + self.pds

    @property
    def label(self) -> str:
        if self.is_colocated:
            return "colocated" if self.colocated == 1 else f"colocated:{self.colocated}"
        if self.pds:
            return f"{self.encoders}E+{self.pds}PD"
        return f"{self.encoders}E+{self.prefills}P+{self.decodes}D"


@dataclass(frozen=True)
class Workload:
    """Closed loop at ``concurrency`` or open loop at ``request_rate`` (Poisson), seeded."""

    concurrency: int | None = 1
    request_rate: float | None = None
    images_per_request: int = 1
    image_size: tuple[int, int] = (640, 480)
    # Mixed sizes (the article's workload): each image drawn from these; empty: ``image_size``.
    image_sizes: tuple[tuple[int, int], ...] = ()
    prompt_tokens: int = 32
    output_tokens: int = 32
    hit_ratio: float = 0.0
    requests: int = 96
    warmup: int = 8
    seed: int = 0


@dataclass
class _Sink:
    """Where a job's tokens go: relayed by ``frontend``; stamps TTFT and fires ``done`` on the last."""

    frontend: _Serial
    times: RequestTimes
    done: simpy.Event
    count_first: bool = True


@dataclass
class _Job:
    prefill_tokens: int
    vit_patches: int
    tokens: int  # tokens this engine generates for the job
    sink: _Sink
    generated: int = 0


@dataclass
class RequestTimes:
    sent: float
    encoded: float = float("nan")  # disaggregated: embeddings ready (the epd ``encode`` timing ends)
    first: float = float("nan")
    done: float = float("nan")


@dataclass
class Prediction:
    layout: str
    workload: Workload
    ttft_ms: dict[str, float]
    e2e_ms: dict[str, float]
    request_throughput: float
    cpu_ms_per_request: float | None = None  # shared-CPU profiles: busy core-ms per request, spin included
    stages_ms: dict[str, float] = field(default_factory=dict)  # disaggregated: mean encode/prefill/decode
    records: list[RequestTimes] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        return {
            "layout": self.layout,
            "ttft_ms": self.ttft_ms,
            "e2e_ms": self.e2e_ms,
            "request_throughput": self.request_throughput,
            "cpu_ms_per_request": self.cpu_ms_per_request,
            "stages_ms": self.stages_ms,
        }


class _Machine:
    """Where work runs: the shared CPU pool (time-sliced) or a dedicated device (plain delay)."""

    def __init__(self, env: simpy.Environment, profile: Profile, seed: int, slots: int | None) -> None:
        self.env = env
        self.slice_ms = profile.time_slice_ms
        self.cpu = simpy.Resource(env, capacity=slots) if slots else None
        self.spin_yields = profile.spin_yields
        # Service times vary (lognormal with mean 1 and coefficient of variation service_cv).
        self.rng = random.Random(seed + 2)
        self.sigma = math.sqrt(math.log1p(profile.service_cv**2))
        self.busy_ms = 0.0

    def spin(self, ms: float) -> None:
        """CPU burnt off the request's path (idle worker threads spinning): competes, delays nobody directly."""
        if self.cpu is not None and ms > 0:
            self.env.process(self._sliced(ms, idle_only=self.spin_yields))

    def work(self, ms: float, threads: int = 1) -> Proc:
        if ms <= 0:
            return
        if self.sigma > 0:
            ms *= self.rng.lognormvariate(-(self.sigma**2) / 2, self.sigma)
        if self.cpu is None:
            yield self.env.timeout(ms)
            return
        if threads <= 1:
            yield from self._sliced(ms)
            return
        parts = [self.env.process(self._sliced(ms / threads)) for _ in range(threads)]
        yield self.env.all_of(parts)

    def _sliced(self, ms: float, idle_only: bool = False) -> Proc:
        """``ms`` of CPU in time slices. ``idle_only`` (spinning that yields): only on cores nobody
        else wants, stopping as soon as work queues for the CPU."""
        assert self.cpu is not None
        cpu = self.cpu
        left = ms
        while left > 1e-9 and not (idle_only and (cpu.count >= cpu.capacity or cpu.queue)):
            with cpu.request() as slot:
                yield slot
                run = min(self.slice_ms, left)
                yield self.env.timeout(run)
                left -= run
                self.busy_ms += run


class _Serial:
    """One-at-a-time server (a Python frontend under its GIL, an encoder instance)."""

    def __init__(self, env: simpy.Environment, machine: _Machine, threads: int = 1, spin_ms: float = 0.0) -> None:
        self.env, self.machine, self.threads, self.spin_ms = env, machine, threads, spin_ms
        self.lock = simpy.Resource(env, capacity=1)

    @property
    def load(self) -> int:
        return self.lock.count + len(self.lock.queue)

    def run(self, ms: float) -> Proc:
        with self.lock.request() as turn:
            yield turn
            yield from self.machine.work(ms, self.threads)
        self.machine.spin(self.spin_ms * self.threads)


class _Engine:
    """Continuous batching: each step prefills what fits and decodes one token for every running job."""

    def __init__(
        self, env: simpy.Environment, machine: _Machine, costs: EngineCosts, relay: FrontendCosts, own_stub: bool
    ) -> None:
        self.env, self.machine, self.costs, self.relay = env, machine, costs, relay
        # Disaggregated engines live in their own Python model (prefill, decode): that process handles each
        # step's output before the epd BLS forwards the tokens, so the two relay halves overlap.
        self.stub = _Serial(env, machine) if own_stub else None
        self.waiting: deque[_Job] = deque()
        self.running: list[_Job] = []
        self.wake = env.event()
        env.process(self._loop())

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def submit(self, job: _Job) -> None:
        self.waiting.append(job)
        if not self.wake.triggered:
            self.wake.succeed()

    def _loop(self) -> Proc:
        while True:
            if not self.waiting and not self.running:
                self.wake = self.env.event()
                yield self.wake
            decoding = list(self.running)
            budget = self.costs.max_batched_tokens - len(decoding)
            new: list[_Job] = []
            while self.waiting and (self.waiting[0].prefill_tokens <= budget or not (new or decoding)):
                job = self.waiting.popleft()
                budget -= job.prefill_tokens
                new.append(job)
            ms = self.costs.step_ms(sum(j.prefill_tokens for j in new), len(decoding), sum(j.vit_patches for j in new))
            yield from self.machine.work(ms)
            self.machine.spin(self.costs.spin_ms_per_step)
            by_frontend: dict[int, list[tuple[_Job, bool, bool]]] = {}
            for job in new + decoding:
                job.generated += 1
                last = job.generated >= job.tokens
                by_frontend.setdefault(id(job.sink.frontend), []).append((job, job.generated == 1, last))
                if job in self.running and last:
                    self.running.remove(job)
                elif job in new and not last:
                    self.running.append(job)
            for batch in by_frontend.values():
                self.env.process(self._relay(batch))

    def _relay(self, batch: list[tuple[_Job, bool, bool]]) -> Proc:
        """The frontend forwards one step's tokens (per step + per token), then the client has them."""
        frontend = batch[0][0].sink.frontend
        if self.stub is not None:
            yield from self.stub.run(self.relay.relay_ms_per_step)
            yield from frontend.run(self.relay.relay_ms_per_token * len(batch))
        else:
            yield from frontend.run(self.relay.relay_ms_per_step + self.relay.relay_ms_per_token * len(batch))
        for job, first, last in batch:
            if first and job.sink.count_first:
                job.sink.times.first = self.env.now
            if last:
                job.sink.done.succeed()


def _least_loaded(pool: list[Any]) -> Any:
    return min(pool, key=lambda x: x.load)


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "mean": float("nan")}
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=10, method="inclusive") if len(ordered) > 1 else [ordered[0]] * 9
    return {"p50": statistics.median(ordered), "p90": q[8], "mean": statistics.fmean(ordered)}


class _Server:
    """One layout's instances on one machine, answering requests as a client sees them."""

    def __init__(self, env: simpy.Environment, profile: Profile, layout: Layout, seed: int) -> None:
        self.env, self.profile, self.layout = env, profile, layout
        p = profile
        # Each role's machine: one CPU pool per distinct CPU set, or one for everything (shared_cpu_slots).
        pools: dict[frozenset[int], _Machine] = {}
        for cores in p.cpu_sets.values():
            pools.setdefault(frozenset(cores), _Machine(env, p, seed + len(pools), len(cores)))
        if not pools:
            pools[frozenset()] = _Machine(env, p, seed, p.shared_cpu_slots)
        self.machines = list(pools.values())
        roles = {role: pools[frozenset(p.cpu_sets.get(role, ()))] for role in CPU_ROLES}
        machine = roles["colocated"]
        if layout.is_colocated:
            relay = p.colocated_frontend
            self.engines = [_Engine(env, machine, p.colocated_engine, relay, False) for _ in range(layout.colocated)]
            self.frontends = [_Serial(env, machine) for _ in range(layout.colocated)]
        else:
            relay = p.disaggregated_frontend
            machine, encoding = roles["pd"], roles["encoder"]
            self.frontends = [_Serial(env, machine)]
            enc = p.encoder
            threads = min(enc.threads, encoding.cpu.capacity) if encoding.cpu is not None else enc.threads
            self.encoders = [_Serial(env, encoding, threads, enc.spin_ms) for _ in range(layout.encoders)]
            self.prefills = [_Engine(env, machine, p.prefill_engine, relay, True) for _ in range(layout.prefills)]
            self.decodes = [_Engine(env, machine, p.decode_engine, relay, True) for _ in range(layout.decodes)]
            pd_costs = dataclasses.replace(p.colocated_engine, vit_ms_per_patch=0.0)
            pd_relay = p.colocated_frontend if p.pd_in_frontend else relay
            self.pds = [_Engine(env, machine, pd_costs, pd_relay, not p.pd_in_frontend) for _ in range(layout.pds)]

    def request(self, workload: Workload, rng: random.Random, times: RequestTimes) -> Proc:
        count = workload.images_per_request
        mixed = workload.image_sizes
        sizes = [rng.choice(mixed) for _ in range(count)] if mixed else [workload.image_size] * count
        hits = [rng.random() < workload.hit_ratio for _ in range(count)]
        vision = self.profile.vision
        images = [(vision.patches(*size), vision.tokens(*size), hit) for size, hit in zip(sizes, hits, strict=True)]
        prompt = workload.prompt_tokens + sum(tokens for _, tokens, _ in images)
        hit_tokens = sum(tokens for _, tokens, hit in images if hit)
        cached_tokens = hit_tokens if self.profile.hit_skips_image_prefill else 0
        missed = [patches for patches, _, hit in images if not hit]  # the patches of each image to encode
        if self.layout.is_colocated:
            hit_patches = sum(patches for patches, _, hit in images if hit)
            yield from self._colocated(workload, hits, missed, hit_patches, prompt - cached_tokens, times)
        else:
            encoded_tokens = prompt - workload.prompt_tokens - hit_tokens
            yield from self._disaggregated(workload, hits, missed, encoded_tokens, prompt, cached_tokens, times)

    def _colocated(
        self, w: Workload, hits: list[bool], missed: list[int], hit_patches: int, prefill: int, times: RequestTimes
    ) -> Proc:
        i = self.engines.index(_least_loaded(self.engines))
        engine, frontend, costs = self.engines[i], self.frontends[i], self.profile.colocated_frontend
        media_ms = len(missed) * costs.media_base_ms + costs.media_ms_per_patch * sum(missed)
        yield from frontend.run(costs.request_ms + media_ms + hits.count(True) * costs.hit_ms)
        done = self.env.event()
        vit_patches = sum(missed) + round(engine.costs.vit_hit_share * hit_patches)
        engine.submit(_Job(prefill, vit_patches, w.output_tokens, _Sink(frontend, times, done)))
        yield done

    def _disaggregated(
        self,
        w: Workload,
        hits: list[bool],
        missed: list[int],
        encoded_tokens: int,
        prompt: int,
        cached: int,
        times: RequestTimes,
    ) -> Proc:
        p, frontend = self.profile, self.frontends[0]
        costs = p.disaggregated_frontend
        yield from frontend.run(costs.request_ms + hits.count(True) * costs.hit_ms)
        call_ms = p.encoder.call_ms
        encodes = [
            self.env.process(self._encode(patches, call_ms if i == 0 else 0.0)) for i, patches in enumerate(missed)
        ]
        if encodes:
            yield self.env.all_of(encodes)
        times.encoded = self.env.now
        yield self.env.timeout(p.embedding_transfer_ms_per_token * encoded_tokens)
        if self.pds:
            done = self.env.event()
            job = _Job(prompt - cached, 0, w.output_tokens, _Sink(frontend, times, done))
            _least_loaded(self.pds).submit(job)
            yield done
            return
        first = self.env.event()
        _least_loaded(self.prefills).submit(_Job(prompt - cached, 0, 1, _Sink(frontend, times, first)))
        yield first
        if w.output_tokens <= 1:
            return
        yield self.env.timeout(p.kv_transfer_ms_per_token * prompt)
        done = self.env.event()
        # The decode engine loads the transferred KV (its prefill cost per token is the load cost).
        sink = _Sink(frontend, times, done, count_first=False)
        _least_loaded(self.decodes).submit(_Job(prompt, 0, w.output_tokens - 1, sink))
        yield done

    def _encode(self, patches: int, call_ms: float = 0.0) -> Proc:
        yield from _least_loaded(self.encoders).run(call_ms + self.profile.encoder.image_ms(patches))


def simulate(profile: Profile, layout: Layout | str, workload: Workload) -> Prediction:
    """Run one load point; deterministic for a given seed."""
    if isinstance(layout, str):
        layout = Layout.parse(layout)
    if not layout.is_colocated and (layout.encoders < 1 or not (layout.pds or (layout.prefills and layout.decodes))):
        raise ValueError(f"layout {layout.label}: a disaggregated layout needs >= 1 encoder and P+D or PD engines")
    env = simpy.Environment()
    server = _Server(env, profile, layout, workload.seed)
    rng = random.Random(workload.seed)
    total = workload.warmup + workload.requests
    records: list[RequestTimes] = []

    def one(times: RequestTimes) -> Proc:
        yield from server.request(workload, rng, times)
        times.done = env.now

    def closed_client(count: int) -> Proc:
        for _ in range(count):
            times = RequestTimes(sent=env.now)
            records.append(times)
            yield env.process(one(times))

    def open_source() -> Proc:
        assert workload.request_rate
        arrivals = random.Random(workload.seed + 1)
        for _ in range(total):
            times = RequestTimes(sent=env.now)
            records.append(times)
            env.process(one(times))
            yield env.timeout(arrivals.expovariate(workload.request_rate / 1000.0))

    if workload.request_rate:
        env.process(open_source())
    else:
        clients = max(1, workload.concurrency or 1)
        for c in range(clients):
            env.process(closed_client(total // clients + (1 if c < total % clients else 0)))
    env.run()
    measured = sorted(records, key=lambda r: r.sent)[workload.warmup :]
    window_ms = max(r.done for r in measured) - min(r.sent for r in measured) if measured else 0.0
    stages: dict[str, float] = {}
    if not layout.is_colocated and measured:
        stages = {
            "encode": statistics.fmean(r.encoded - r.sent for r in measured),
            "prefill": statistics.fmean(r.first - r.encoded for r in measured),
            "decode": statistics.fmean(r.done - r.first for r in measured),
        }
    return Prediction(
        layout=layout.label,
        workload=workload,
        ttft_ms=_percentiles([r.first - r.sent for r in measured]),
        e2e_ms=_percentiles([r.done - r.sent for r in measured]),
        request_throughput=len(measured) / (window_ms / 1000.0) if window_ms > 0 else float("nan"),
        stages_ms=stages,
        cpu_ms_per_request=(
            sum(m.busy_ms for m in server.machines) / total if server.machines[0].cpu is not None else None
        ),
        records=measured,
    )

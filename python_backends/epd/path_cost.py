"""The adaptive path rule of ``epd``: a cost model, not a threshold (Triton-free, plain data).

Per request, ``epd`` (python_backends/epd/pipeline.py) describes the work (:class:`RequestShape`:
images, how many the store lacks, their size bucket, output tokens) and asks
:meth:`PathCostModel.choose` for the path with the lower predicted completion time:

- ``colocated``: epd's own vLLM engine does everything; images go in as media (the engine
  encodes them) or, when every image is in the store, as embeddings.
  predicted = first_token[media|embeds, bucket] + (tokens - 1) * token_ms
- ``disaggregated``: missing images through the encoders, then prefill, KV transfer, decode.
  predicted = misses * encode[bucket] + prefill[bucket] + (tokens - 1) * token_ms

Each term is an estimate of the stages' own timings (what each path measured on requests it
served, per image-size bucket): the median of its last ``window`` samples (:class:`Estimate`),
kept *per unit of load*: a sample taken while ``n`` requests were running on the engines it used
counts ``time / n``, and a prediction multiplies by the load now plus one (processor sharing: an
engine that runs n requests at once gives each about 1/n of itself). ``n`` is the load averaged
over the request's life (:meth:`PathCostModel.mean_load`), not the load it started under: the
first request of a burst of 8 starts alone but runs with 7 others, and counted at load 1 it made
its path look 8x dearer per unit than it was (2026-12-02, run 6: at c=8 adaptive then left the
faster path for 24 of 32 requests and kept to the slower one). Processor sharing is only
roughly true (batching makes a busy engine cheaper per request, two cores make it dearer), so the
samples are also kept per load band (1, 2-3, 4-7, 8+): a prediction uses its band's samples once
there are ``min_samples`` of them. ``shared_compute`` says the two paths' engines share the same
processors (the cpu target: two cores for everything): then a path's load is every request in
flight, not only its own, and the paths compete for the same cores.

A path with fewer than ``min_samples`` samples of a term, or whose estimate is older than
``probe_interval_s``, gets one request (a probe, one at a time) so that its estimate stays live;
forced requests feed the estimates too. Where the paths have hardware of their own
(``shared_compute`` False), so does a path predicted within PLAUSIBLE_RATIO (2x) of the best one
whose estimate lacks samples at the band of the load now: it is measured at a new load within a
few requests. Not on shared processors: there each such probe puts a request on the other path
while this one is busy, and mixing is what costs most (below). For the same reason, on shared
processors a stale estimate is refreshed when epd is idle, and under load only once it is
``BUSY_PROBE_FACTOR`` (6) intervals old: in the 2026-12-02 benchmark (run 2) the 10 s probes that
fell on loaded points (2 of 16 requests at unique c=4) slowed that whole point 1.7x.

A path that a stale probe found still slower is probed again only after twice the interval
before, up to ``MAX_PROBE_BACKOFF`` (16) times ``probe_interval_s``; once it is the better one,
its interval is back to ``probe_interval_s``. Why: with steady load, every probe is one
request on the slower path for nothing: in the path benchmark of 2026-12-02 (run 14, the modes
interleaved round by round) epd was idle at the start of nearly every repetition with its
disaggregated estimate older than 10 s, so 1 request in 24 was a probe, and at c=8 the 7
colocated requests beside it ran slower too (adaptive 770 ms e2e p50 against 753 for colocated
forced, identical c=8: 443 against 403).

Under ``shared_compute``, while one path has more requests in flight than the other, the other
one is taken only when it is predicted ``switch_margin`` (20%) faster (reason ``kept``
otherwise): in the 2026-12-01 benchmark, points where adaptive split its requests between the
paths were slower than either path alone (unique c=4: 11 colocated + 5 disaggregated, e2e p50
2878 ms against 482 and 2065), since two sets of busy engines on two cores slow everyone down,
which the per-request estimates cannot see; and the samples taken while mixed, slow on both
paths, then pushed the choice back and forth. So under ``shared_compute`` a request that ran
while the other path had requests in flight adds no sample (:meth:`PathCostModel.sample_load`).

Everything here runs on epd's event loop thread (no locking).

Why a windowed median and not an EWMA (what this module first used): in the path benchmark of
2026-12-01 the first request epd's colocated engine ever served took 1052 ms to its first token
and 122 ms per token (a cold engine), against ~150 ms and ~10-20 ms warm. As an EWMA's first
sample that one request *was* the estimate; adaptive then sent every request to the slower
disaggregated path, and the colocated estimate, refreshed only by one probe per 30 s at
alpha 0.2, needed minutes to come down (25 of 28 requests at c=1 on the wrong path, e2e p50
3x llm's). On a shared machine single samples also spike several-fold when other processes
run. A median of the last few samples ignores such an outlier as soon as two normal samples
follow, and still follows a lasting change within half a window. The probe interval is 10 s
(it was 30 s): on a machine whose load drifts, an estimate minutes old is compared with a fresh
one of the other path; a probe is one request on the slower path, a few percent of requests at
the loads measured here.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from python_backends import contract

# Image-size buckets by the largest image's pixels: upper bounds (inclusive) and labels.
SIZE_BUCKETS: tuple[tuple[int, str], ...] = (
    (0, "none"),
    (320 * 320, "small"),
    (800 * 600, "medium"),
    (1600 * 1200, "large"),
)
LARGEST_BUCKET = "xlarge"
ANY_BUCKET = "any"  # the fallback estimate of a stage, over every bucket


def size_bucket(pixels: int) -> str:
    for bound, label in SIZE_BUCKETS:
        if pixels <= bound:
            return label
    return LARGEST_BUCKET


@dataclass(frozen=True)
class RequestShape:
    """What a request asks of the engines, known before it is served."""

    images: int
    misses: int  # images the embedding store does not hold
    largest_pixels: int
    output_tokens: int

    @property
    def bucket(self) -> str:
        return size_bucket(self.largest_pixels)

    @property
    def image_form(self) -> str:
        """How the colocated path hands the images to its engine."""
        return "embeds" if self.misses == 0 else "media"


MAX_BAND = 8


def load_band(load: int) -> int:
    """Loads 1, 2-3, 4-7 and 8+ as 1, 2, 4 and 8: estimates are kept per band (module docstring)."""
    band = 1
    while band * 2 <= min(load, MAX_BAND):
        band *= 2
    return band


class Estimate:
    """One stage's service time per unit of load: the median of its last ``window`` samples in the
    band of the load asked about once it has ``min_samples`` there, else of its last ``window``
    samples at any load (module docstring)."""

    def __init__(self, window: int, min_samples: int) -> None:
        self.window = window
        self.min_samples = min_samples
        self.recent: deque[float] = deque(maxlen=window)
        self.by_band: dict[int, deque[float]] = {}
        self.band_updated_at: dict[int, float] = {}
        self.samples = 0  # every sample ever added
        self.updated_at = 0.0

    def add(self, sample: float, load: float, now: float) -> None:
        band = load_band(max(1, round(load)))
        self.recent.append(sample)
        self.by_band.setdefault(band, deque(maxlen=self.window)).append(sample)
        self.band_updated_at[band] = now
        self.samples += 1
        self.updated_at = now

    def _band_samples(self, load: int) -> deque[float]:
        return self.by_band.get(load_band(load), deque())

    def value_at(self, load: int) -> float:
        band = self._band_samples(load)
        return statistics.median(band if len(band) >= self.min_samples else self.recent) if self.recent else 0.0

    @property
    def value(self) -> float:
        """Over every load (what /metrics shows)."""
        return statistics.median(self.recent) if self.recent else 0.0

    def stale(self, now: float, max_age_s: float) -> bool:
        """Too few samples, or none for ``max_age_s``."""
        return self.samples < self.min_samples or now - self.updated_at > max_age_s

    def stale_at(self, load: int, now: float, max_age_s: float) -> bool:
        """Too few samples at this load's band, or none there for ``max_age_s``."""
        band = load_band(load)
        return len(self._band_samples(load)) < self.min_samples or now - self.band_updated_at[band] > max_age_s


@dataclass(frozen=True)
class LoadMark:
    """A request's start on its path's load-time integral (:meth:`PathCostModel.started`)."""

    path: str
    at: float
    area: float
    other_area: float  # the other paths' requests in flight, integrated over time
    load: int  # the load it started under, itself included
    probe: bool = False


@dataclass(frozen=True)
class Decision:
    path: str
    reason: str  # "predicted", "kept", "probe", "forced", "policy", "only", "encoder pinned", "dominates",
    # "grammar logprobs" (pipeline.serving)
    predicted_ms: dict[str, float | None] = field(default_factory=dict)


# Estimate names: (path, stage). Stages per path are the terms of the module docstring.
COLOCATED_FIRST = "first_token"
COLOCATED_TOKEN = "token"
ENCODE = "encode"
PREFILL = "prefill"
DISAGGREGATED_TOKEN = "token"


# A path predicted slower than this times the best one is not probed at a new load band.
PLAUSIBLE_RATIO = 2.0
# Under shared compute a stale path is probed at once when epd is idle, else only once its
# estimate is this many probe intervals old.
BUSY_PROBE_FACTOR = 6
# A path each probe finds slower is probed at most this many probe intervals apart (backoff).
MAX_PROBE_BACKOFF = 16


class PathCostModel:
    def __init__(
        self,
        *,
        window: int = 8,
        min_samples: int = 3,
        probe_interval_s: float = 10.0,
        shared_compute: bool = True,
        switch_margin: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"need window >= 1 and 1 <= min_samples <= window, got {window}, {min_samples}")
        self.window = window
        self.min_samples = min_samples
        self.probe_interval_s = probe_interval_s
        self.shared_compute = shared_compute
        self.switch_margin = switch_margin
        self.clock = clock
        self.estimates: dict[tuple[str, str, str], Estimate] = {}  # (path, stage, bucket) -> ms per unit of load
        self.in_flight = dict.fromkeys(contract.SERVING_PATHS, 0)
        self._load_area = dict.fromkeys(contract.SERVING_PATHS, 0.0)  # the integral of load(path) over time
        self._other_area = dict.fromkeys(contract.SERVING_PATHS, 0.0)  # of the other paths' requests in flight
        self._integrated_at = clock()
        self._probing: str | None = None
        # Each path's time between stale probes (backoff), and the path a stale probe is checking.
        self.probe_intervals = dict.fromkeys(contract.SERVING_PATHS, probe_interval_s)
        self._checking: str | None = None
        self.last: Decision | None = None

    # ------------------------------------------------------------------ load

    def load(self, path: str) -> int:
        """Requests running on the engines ``path`` uses (all of epd's when they share compute)."""
        return sum(self.in_flight.values()) if self.shared_compute else self.in_flight[path]

    def _integrate(self) -> float:
        """Bring every path's load-time integral up to now; returns now."""
        now = self.clock()
        elapsed, total = now - self._integrated_at, sum(self.in_flight.values())
        for path in self._load_area:
            self._load_area[path] += self.load(path) * elapsed
            self._other_area[path] += (total - self.in_flight[path]) * elapsed
        self._integrated_at = now
        return now

    def started(self, path: str, probe: bool = False) -> LoadMark:
        """A request starts on ``path``: where it starts on the load-time integral."""
        now = self._integrate()
        self.in_flight[path] += 1
        if probe:
            self._probing = path
            if self.last is not None and self.last.predicted_ms.get(path) is not None:
                self._checking = path  # known but stale: will this probe change the answer? (_back_off)
        return LoadMark(path, now, self._load_area[path], self._other_area[path], self.load(path), probe)

    def mean_load(self, mark: LoadMark) -> float:
        """The load ``mark``'s request has run under on average since it started, itself included."""
        now = self._integrate()
        if now <= mark.at:
            return float(mark.load)
        return max(1.0, (self._load_area[mark.path] - mark.area) / (now - mark.at))

    def sample_load(self, mark: LoadMark) -> float | None:
        """The load to count the timings of ``mark``'s request under (:meth:`mean_load`), or None
        to drop them: under shared compute, when the other path had requests in flight meanwhile.
        Such a sample is slow on both paths and says nothing of either alone (2026-12-02, run 7:
        3 colocated requests that ran beside one disaggregated probe took 48 ms per token against
        7.5 alone, and sent the next 29 requests of that point to the slower path). A probe's own
        sample is kept: under load a probe always runs beside the other path, and dropping it left
        its path unknown, probed again at once (run 8: one request in 4 at unique c=4)."""
        load = self.mean_load(mark)
        mixed = self._other_area[mark.path] - mark.other_area > 0.0
        return None if self.shared_compute and mixed and not mark.probe else load

    def finished(self, path: str) -> None:
        self._integrate()
        self.in_flight[path] -= 1
        if self._probing == path:
            self._probing = None

    # ------------------------------------------------------------------ samples

    def _add(self, path: str, stage: str, bucket: str, ms: float, load: float) -> None:
        per_unit = ms / max(load, 1.0)
        now = self.clock()
        for key in dict.fromkeys(((path, stage, bucket), (path, stage, ANY_BUCKET))):  # once when bucket is "any"
            self.estimates.setdefault(key, Estimate(self.window, self.min_samples)).add(per_unit, load, now)

    def observe_colocated(
        self, shape: RequestShape, first_ms: float, decode_ms: float, tokens: int, load: float
    ) -> None:
        """A colocated request finished: time to its first token and to the rest."""
        self._add(contract.COLOCATED_PATH, f"{COLOCATED_FIRST}/{shape.image_form}", shape.bucket, first_ms, load)
        if tokens > 1:
            self._add(contract.COLOCATED_PATH, COLOCATED_TOKEN, ANY_BUCKET, decode_ms / (tokens - 1), load)

    def observe_disaggregated(
        self, shape: RequestShape, timings: dict[str, float], tokens: int, load: float, encoded: int
    ) -> None:
        """A disaggregated request finished with its pipeline ``timings`` (ms per stage)."""
        path = contract.DISAGGREGATED_PATH
        if encoded and "encode" in timings:
            self._add(path, ENCODE, shape.bucket, timings["encode"] / encoded, load)
        if "prefill" in timings:
            self._add(path, PREFILL, shape.bucket, timings["prefill"], load)
        if tokens > 1 and "decode" in timings:
            self._add(path, DISAGGREGATED_TOKEN, ANY_BUCKET, timings["decode"] / (tokens - 1), load)

    # ------------------------------------------------------------------ predictions

    def _estimate(self, path: str, stage: str, bucket: str) -> Estimate | None:
        return self.estimates.get((path, stage, bucket)) or self.estimates.get((path, stage, ANY_BUCKET))

    def _terms(self, path: str, shape: RequestShape) -> list[tuple[Estimate | None, float]] | None:
        """(estimate, multiplier) per term of ``path``'s prediction for ``shape``."""
        tokens_after_first = max(shape.output_tokens - 1, 0)
        if path == contract.COLOCATED_PATH:
            first = self._estimate(path, f"{COLOCATED_FIRST}/{shape.image_form}", shape.bucket)
            return [(first, 1.0), (self._estimate(path, COLOCATED_TOKEN, ANY_BUCKET), tokens_after_first)]
        terms = [
            (self._estimate(path, PREFILL, shape.bucket), 1.0),
            (self._estimate(path, DISAGGREGATED_TOKEN, ANY_BUCKET), tokens_after_first),
        ]
        if shape.misses:
            terms.append((self._estimate(path, ENCODE, shape.bucket), float(shape.misses)))
        return terms

    def predict(self, path: str, shape: RequestShape) -> float | None:
        """Predicted completion time (ms) of ``shape`` on ``path`` now; None while unknown."""
        terms = self._terms(path, shape)
        if terms is None or any(est is None for est, times in terms if times):
            return None
        load = self.load(path) + 1
        unit = sum(est.value_at(load) * times for est, times in terms if est is not None and times)
        return unit * load

    def _needs_probe(self, path: str, shape: RequestShape, predicted: float | None, best: float | None) -> bool:
        """A term of ``path`` is unknown or stale, or stale at the load now while ``path`` is
        predicted within PLAUSIBLE_RATIO of the best (a path far behind is not worth a probe at
        every new load: each probe is one request on the slower path)."""
        estimates = [est for est, times in self._terms(path, shape) or [] if times]
        now = self.clock()
        if any(est is None for est in estimates):
            return True
        interval = self.probe_intervals[path]
        if self.shared_compute:
            # A probe while others run slows them all (see choose): it waits for an idle moment,
            # unless the estimate has aged BUSY_PROBE_FACTOR intervals. No probe per load band:
            # that too would mix the paths.
            idle = not any(self.in_flight.values())
            max_age = interval * (1 if idle else BUSY_PROBE_FACTOR)
            return any(est.stale(now, max_age) for est in estimates if est)
        if any(est.stale(now, interval) for est in estimates if est):
            return True
        load = self.load(path) + 1
        plausible = predicted is not None and best is not None and predicted < PLAUSIBLE_RATIO * best
        return plausible and any(est.stale_at(load, now, self.probe_interval_s) for est in estimates if est)

    def _busy_path(self) -> str | None:
        """The path with more requests in flight than the other (None when idle or even), not
        counting a probe: a probe that made its path the busy one would keep every following
        request there (2026-12-02: a probe at the start of a burst of 8 took 6 of the other 7 along)."""
        in_flight = dict(self.in_flight)
        if self._probing is not None:
            in_flight[self._probing] -= 1
        counts = sorted(in_flight.items(), key=lambda item: item[1], reverse=True)
        return counts[0][0] if counts[0][1] > counts[1][1] else None

    def choose(self, shape: RequestShape, available: Iterable[str]) -> Decision:
        """The path for ``shape`` among ``available`` ones (the rule of the module docstring)."""
        paths = [p for p in contract.SERVING_PATHS if p in set(available)]
        if not paths:
            raise ValueError("no serving path is available")
        predicted = {p: self.predict(p, shape) for p in paths}
        if len(paths) == 1:
            decision = Decision(paths[0], "only", predicted)
        else:
            known = {p: ms for p, ms in predicted.items() if ms is not None}
            best = min(known, key=lambda p: known[p]) if known else paths[-1]
            self._back_off(best)
            busy = self._busy_path()
            stale = [p for p in paths if p != best and self._needs_probe(p, shape, predicted[p], known.get(best))]
            if stale and self._probing is None:
                decision = Decision(stale[0], "probe", predicted)
            elif (
                self.shared_compute and busy in known and best != busy
                and known[best] > (1 - self.switch_margin) * known[busy]
            ):
                decision = Decision(busy, "kept", predicted)
            else:
                decision = Decision(best, "predicted", predicted)
        self.last = decision
        return decision

    def _back_off(self, best: str) -> None:
        """The best path's probe interval is the base one. Once a stale probe has finished, its
        path's interval doubles if the path is still not the best (up to MAX_PROBE_BACKOFF)."""
        self.probe_intervals[best] = self.probe_interval_s
        path = self._checking
        if path is None or self._probing == path:
            return
        self._checking = None
        if path != best:
            self.probe_intervals[path] = min(2 * self.probe_intervals[path], MAX_PROBE_BACKOFF * self.probe_interval_s)

    def snapshot(self) -> dict[tuple[str, str, str], float]:
        """(path, stage, bucket) -> current estimate in ms per unit of load (for /metrics)."""
        return {key: est.value for key, est in self.estimates.items()}

"""Which encoder an image goes to: THE rule (:func:`home`), and for remote encoder servers the
router around it (bounded load, a circuit breaker per encoder). See docs/scale-out.md.

- **Home** (:func:`home`, one rule for every encoder): among the candidates, the one with the
  highest ``hash(candidate, key)`` (rendezvous / highest-random-weight hashing). Adding or
  removing one of N candidates moves only the keys it wins or held: ~1/N of the homes. The local
  path (``epd/references.py``: ``encoder_<i>`` models over BLS) applies it to this server's
  encoder model names; the remote path (:class:`Router`) to the healthy encoder servers.
- **Bounded load** (remote): when the home already has ``bound`` encodes in flight
  (``ceil(load_factor * (in flight + 1) / healthy)``, at least ``min_bound``), the image goes to
  the least-loaded healthy encoder instead (ties: rendezvous order), as in consistent hashing
  with bounded loads.
- **Breaker** (remote): ``fail_threshold`` failed calls in a row open an encoder's breaker for a
  back-off (doubled at each failed probe, up to ``max_backoff_s``); then one probe call is let
  through (half-open): success closes it, failure opens it again.

Who calls what: the remote encoders (``scaleout/remote.py``) ask :meth:`Router.choose` for each
image that the local store does not hold, wrap the call in :meth:`Router.calling` and report
the outcome; membership (``scaleout/membership.py``) calls :meth:`Router.set_endpoints` and
:meth:`Router.set_ready`. Everything runs on the ``epd`` event loop (one thread), so the
counters need no lock.

Hand-written on purpose: the hashing is a dozen lines, and ``pybreaker`` counts calls made
through its own wrapper (sync, or Tornado for async), which does not fit calls that are routed
first and awaited on asyncio later.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field


class BreakerState(enum.IntEnum):
    """Exposed as a gauge value: 0 closed (in use), 1 open (out), 2 half-open (one probe)."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class NoEncoderAvailable(RuntimeError):
    """No healthy encoder: every one is unknown, not ready or has its breaker open."""


@dataclass
class CircuitBreaker:
    """One encoder's breaker; ``clock`` is injectable for tests."""

    fail_threshold: int = 3
    backoff_s: float = 2.0
    max_backoff_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    failures_in_a_row: int = 0
    opened_at: float | None = None
    current_backoff_s: float = 0.0
    probing: bool = False
    opens: int = 0  # times it opened (at the threshold or after a failed probe), for a metric

    def __post_init__(self) -> None:
        if self.fail_threshold < 1 or self.backoff_s <= 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("breaker needs fail_threshold >= 1 and 0 < backoff_s <= max_backoff_s")

    @property
    def state(self) -> BreakerState:
        if self.opened_at is None:
            return BreakerState.CLOSED
        if self.probing or self.clock() - self.opened_at >= self.current_backoff_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def allows(self) -> bool:
        """Whether a call may go to this encoder now (a half-open breaker lets one probe at a time)."""
        state = self.state
        return state == BreakerState.CLOSED or (state == BreakerState.HALF_OPEN and not self.probing)

    def started(self) -> None:
        if self.state == BreakerState.HALF_OPEN:
            self.probing = True

    def succeeded(self) -> None:
        self.failures_in_a_row, self.opened_at, self.current_backoff_s, self.probing = 0, None, 0.0, False

    def failed(self) -> None:
        self.failures_in_a_row += 1
        if self.probing:  # a failed probe: out again, for longer
            self.current_backoff_s = min(self.current_backoff_s * 2, self.max_backoff_s)
            self.opened_at, self.probing = self.clock(), False
            self.opens += 1
        elif self.opened_at is None and self.failures_in_a_row >= self.fail_threshold:
            self.opened_at, self.current_backoff_s = self.clock(), self.backoff_s
            self.opens += 1


@dataclass
class EncoderState:
    address: str
    breaker: CircuitBreaker
    ready: bool = True  # readiness polling's last answer
    in_flight: int = 0


@dataclass(frozen=True)
class Route:
    address: str
    decision: str  # "home" or "spilled"


def weight(address: str, key: str) -> int:
    """The rendezvous weight of ``address`` for ``key`` (stable across processes and runs)."""
    digest = hashlib.blake2b(f"{address}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(addresses: Iterable[str], key: str) -> list[str]:
    """``addresses`` from the key's home down (highest weight first)."""
    return sorted(addresses, key=lambda address: (weight(address, key), address), reverse=True)


def home(candidates: Iterable[str], key: str) -> str:
    """The encoder ``key`` goes to among ``candidates`` (encoder model names or server
    addresses): the one rule, whatever the order they are listed in. ValueError if none."""
    return max(candidates, key=lambda candidate: (weight(candidate, key), candidate))


@dataclass
class Router:
    load_factor: float = 1.25
    min_bound: int = 2
    breaker: Callable[[], CircuitBreaker] = CircuitBreaker
    encoders: dict[str, EncoderState] = field(default_factory=dict)
    decisions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("home", "spilled"), 0))

    def __post_init__(self) -> None:
        if self.load_factor < 1 or self.min_bound < 1:
            raise ValueError("bounded load needs load_factor >= 1 and min_bound >= 1")

    def set_endpoints(self, addresses: Sequence[str]) -> None:
        """The current membership; kept encoders keep their breaker and load."""
        wanted = list(dict.fromkeys(addresses))
        self.encoders = {a: self.encoders.get(a) or EncoderState(a, self.breaker()) for a in wanted}

    def set_ready(self, address: str, ready: bool) -> None:
        if address in self.encoders:
            self.encoders[address].ready = ready

    def healthy(self, exclude: Iterable[str] = ()) -> list[str]:
        skip = set(exclude)
        return [a for a, s in self.encoders.items() if a not in skip and s.ready and s.breaker.allows()]

    def home(self, key: str) -> str | None:
        """The key's home among the healthy encoders (None if there is none)."""
        healthy = self.healthy()
        return home(healthy, key) if healthy else None

    def bound(self, healthy: int) -> int:
        in_flight = sum(state.in_flight for state in self.encoders.values())
        return max(self.min_bound, math.ceil(self.load_factor * (in_flight + 1) / max(healthy, 1)))

    def choose(self, key: str, exclude: Iterable[str] = ()) -> Route:
        """Where to encode ``key`` now, avoiding ``exclude`` (encoders this request already tried)."""
        healthy = self.healthy(exclude)
        if not healthy:
            raise NoEncoderAvailable(self.describe())
        order = rendezvous_order(healthy, key)
        home = order[0]
        if self.encoders[home].in_flight < self.bound(len(healthy)):
            route = Route(home, "home")
        else:
            rank = {address: i for i, address in enumerate(order)}
            route = Route(min(order, key=lambda a: (self.encoders[a].in_flight, rank[a])), "spilled")
            if route.address == home:
                route = Route(home, "home")
        self.decisions[route.decision] += 1
        return route

    @contextlib.contextmanager
    def calling(self, address: str) -> Iterator[None]:
        """Count one call in flight on ``address``; the caller reports success or failure."""
        state = self.encoders.get(address)
        if state is not None:
            state.in_flight += 1
            state.breaker.started()
        try:
            yield
        finally:
            if state is not None:
                state.in_flight -= 1

    def succeeded(self, address: str) -> None:
        if address in self.encoders:
            self.encoders[address].breaker.succeeded()

    def failed(self, address: str) -> None:
        if address in self.encoders:
            self.encoders[address].breaker.failed()

    def describe(self) -> str:
        """One line per encoder for error messages and logs."""
        if not self.encoders:
            return "no encoder endpoints configured or resolved"
        parts = [
            f"{a}: {'ready' if s.ready else 'not ready'}, breaker {s.breaker.state.name.lower()}"
            for a, s in self.encoders.items()
        ]
        return "no healthy encoder (" + "; ".join(parts) + ")"

"""Closed-loop load for the crash harness and the soak: requests of a few kinds, each one
recorded as success, a clear error (with the code or message the client saw) or a hang.

A *hang* is a request that got no answer within its deadline: the one outcome a server must
never produce, however badly a stage died. Kinds:

``unique``    a good ``epd`` request with an image never sent before (a store miss: encode);
``repeated``  a good request with an image from a small pool (store hits after the first);
``bad``       corrupt image bytes: must end in INVALID_ARG, never a hang or an internal error;
``cancel``    a good streaming request the client cancels after its first response.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from client.epd_client import ClientError, GrpcClient, chat_prompt
from tests.images import synthetic_image

SAMPLING = {"max_tokens": 8, "temperature": 0.0}
KINDS = ("unique", "repeated", "bad", "cancel")
HANG_MARK = "no response from"


def small_jpeg(seed: int, size: int = 112) -> bytes:
    """A distinct JPEG per seed (different bytes, different content key), cheap to make."""
    return synthetic_image(size, size, seed=seed)


@dataclass(frozen=True)
class Outcome:
    kind: str
    started: float  # seconds since the load began
    seconds: float
    result: str  # "success" | "error" | "hang"
    code: str = ""  # the gRPC/Triton status when the client got one
    message: str = ""

    @property
    def coded(self) -> bool:
        """An error the client can act on: it has a status, or a message naming the problem."""
        return self.result == "error" and bool(self.code or self.message)


def classify(kind: str, started: float, seconds: float, error: Exception | None, deadline_s: float) -> Outcome:
    if error is None:
        return Outcome(kind, started, seconds, "hang" if seconds > deadline_s else "success")
    message = str(error)[:300]
    code = getattr(error, "status", None) or ""
    if callable(code):  # tritonclient's InferenceServerException has a status() method
        code = code() or ""
    if HANG_MARK in message or seconds > deadline_s:
        return Outcome(kind, started, seconds, "hang", code, message)
    return Outcome(kind, started, seconds, "error", str(code), message)


class FaultLoad:
    """``concurrency`` worker threads sending requests to ``epd`` until ``stop()``.

    ``mix``: how often each kind is chosen (weights). Every outcome is kept in order.
    """

    def __init__(
        self,
        url: str,
        concurrency: int,
        deadline_s: float,
        mix: dict[str, float] | None = None,
        model: str = "epd",
        seed: int = 0,
        pool_size: int = 4,
        unique_base: int = 1_000_000,
    ) -> None:
        self.url = url
        self.model = model
        self.concurrency = concurrency
        self.deadline_s = deadline_s
        self.mix = mix or {"unique": 1.0}
        self._rng = random.Random(seed)
        self._pool = [small_jpeg(seed * 1000 + i) for i in range(pool_size)]
        self._next_unique = unique_base + seed * 100_000
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.outcomes: list[Outcome] = []
        self.began = time.monotonic()

    def _pick(self) -> tuple[str, list[bytes]]:
        with self._lock:
            kind = self._rng.choices(list(self.mix), weights=list(self.mix.values()))[0]
            if kind == "unique":
                self._next_unique += 1
                return kind, [small_jpeg(self._next_unique)]
            if kind == "bad":
                return kind, [b"\xff\xd8\xff not a jpeg " + self._rng.randbytes(32)]
            return kind, [self._rng.choice(self._pool)]

    def one(self, kind: str, images: Sequence[bytes]) -> Outcome:
        started = time.monotonic()
        client = GrpcClient(self.url, self.model)
        error: Exception | None = None
        try:
            client.generate(
                chat_prompt("Describe the picture.", len(images)),
                images,
                SAMPLING,
                cancel_after_chunks=1 if kind == "cancel" else None,
                timeout_s=self.deadline_s,
            )
        except ClientError as exc:
            error = exc
        except Exception as exc:  # tritonclient's own errors (e.g. the server went away mid-call)
            error = exc
        finally:
            try:
                client.close()
            except Exception:  # a client of a dead server may fail to close; nothing to free then
                pass
        seconds = time.monotonic() - started
        return classify(kind, started - self.began, seconds, error, self.deadline_s)

    def _worker(self) -> None:
        while not self._stop.is_set():
            outcome = self.one(*self._pick())
            with self._lock:
                self.outcomes.append(outcome)

    def start(self) -> FaultLoad:
        self.began = time.monotonic()
        for i in range(self.concurrency):
            thread = threading.Thread(target=self._worker, name=f"fault-load-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, join_s: float | None = None) -> list[Outcome]:
        """Stop sending; wait for requests in flight (each is bounded by its deadline)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(join_s if join_s is not None else self.deadline_s + 30)
        with self._lock:
            return list(self.outcomes)


def tally(outcomes: Sequence[Outcome], where: Callable[[Outcome], bool] = lambda o: True) -> dict[str, int]:
    counts = Counter(o.result for o in outcomes if where(o))
    return {name: counts.get(name, 0) for name in ("success", "error", "hang")}


def error_messages(outcomes: Sequence[Outcome], limit: int = 6) -> list[str]:
    """The distinct errors seen (code and message), most frequent first."""
    seen = Counter(f"{o.code} {o.message}".strip()[:200] for o in outcomes if o.result != "success")
    return [f"{count}x {text}" for text, count in seen.most_common(limit)]


def as_rows(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    return [asdict(o) for o in outcomes]

"""Test-only pauses at fixed points of a decoupled model's requests (the ``test_pauses`` parameter).

A server test that must cancel a request at one point of its life (before ``epd`` encodes, while
an encoder encodes, between prefill and decode, mid-decode) cannot hit that point by timing on a
shared machine. A repository generated for such a test sets, per model, a JSON object of pauses:

- ``"start"``: seconds to wait before the model starts serving the request (``epd``: before it
  hashes and encodes; ``encoder_<i>``: before it encodes, i.e. while ``epd``'s encode call is in
  flight; ``llm``: before its engine gets the request);
- ``"after_<n>"``: seconds to wait after the model sent its n-th response (``epd``/``llm`` after
  the 1st: between prefill and decode; after the 3rd: mid-decode).

Each pause writes one log line (:func:`pause_line`) before it waits, which the test watches
for: the request is then parked at that point for the pause's length. Served targets never set
the parameter, and without it no pause exists (``StagePauses.parse("")`` is empty).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

START = "start"
_AFTER = re.compile(r"after_([1-9][0-9]*)")
LOG_PREFIX = "test pause:"


def pause_line(model: str, point: str, request_id: str, seconds: float) -> str:
    """The log line written when a request reaches a pause (the tests match on its prefix)."""
    return f"{LOG_PREFIX} {model} {point} {request_id} {seconds:g}s"


@dataclass(frozen=True)
class StagePauses:
    start_s: float = 0.0
    after_s: dict[int, float] = field(default_factory=dict)  # response number -> seconds

    @classmethod
    def parse(cls, text: str) -> StagePauses:
        """``""``: none. Otherwise a JSON object of point -> seconds (> 0); anything else is a
        ValueError naming what is wrong (raised at load: the model refuses to start)."""
        if not text.strip():
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"test_pauses is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("test_pauses must be a JSON object of point -> seconds")
        start, after = 0.0, {}
        for point, seconds in raw.items():
            if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds <= 0:
                raise ValueError(f"test_pauses[{point!r}] must be a number of seconds > 0, not {seconds!r}")
            if point == START:
                start = float(seconds)
            elif (match := _AFTER.fullmatch(point)) is not None:
                after[int(match.group(1))] = float(seconds)
            else:
                raise ValueError(f"test_pauses: unknown point {point!r} (known: 'start', 'after_<n>')")
        return cls(start, after)

    def __bool__(self) -> bool:
        return bool(self.start_s or self.after_s)

    def after(self, responses: int) -> float:
        """Seconds to pause once ``responses`` responses were sent (0: none)."""
        return self.after_s.get(responses, 0.0)

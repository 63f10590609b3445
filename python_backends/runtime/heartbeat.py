"""A python-backend stub's sign of life: a file its Python touches every second, watched by the
launcher's stage watch (``builders/stage_watch.py``, ``StageWatch.hung``).

Why: a stub can deadlock inside Triton's python backend and never die. Seen in ``epd``'s stub
(docs/benchmarks/bls-deadlock.md): a thread opening a BLS stream held the GIL while it
waited for a lock held by the stub's message thread, which waited for a stream's lock held by a
reader that waited for the GIL. Its requests never end, Triton still reports the model ready, and
the process is alive, so the stage watch, which looks for dead processes, saw nothing. Such a stub
runs no Python at all any more: this thread stops too, and the file goes stale.

Enabled by ``TRITON_EPD_HEARTBEAT_DIR`` (the launcher sets it for the server it starts); one file
per stub process, named by its pid. Plain Python, no Triton import.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

HEARTBEAT_DIR_ENV = "TRITON_EPD_HEARTBEAT_DIR"
PERIOD_S = 1.0


class Heartbeat:
    """Touches ``directory/<pid>`` every ``period_s`` from a daemon thread until :meth:`stop`."""

    def __init__(self, directory: Path, period_s: float = PERIOD_S) -> None:
        self.path = directory / str(os.getpid())
        self._period_s = period_s
        self._stopped = threading.Event()
        self.path.touch()
        self._thread = threading.Thread(target=self._beat, name="epd-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stopped.wait(self._period_s):  # the wait gives the GIL up; waking needs it back
            try:
                self.path.touch()
            except OSError:  # the directory went away with its server: nobody is watching
                return

    def stop(self) -> None:
        """No more beats, and no file: a stub that unloads is not a stub that hangs."""
        self._stopped.set()
        self._thread.join(timeout=2 * self._period_s)
        self.path.unlink(missing_ok=True)


def start_heartbeat(environ: Mapping[str, str] = os.environ) -> Heartbeat | None:
    """This process's heartbeat in ``$TRITON_EPD_HEARTBEAT_DIR``, or None where it is not set."""
    directory = environ.get(HEARTBEAT_DIR_ENV)
    return Heartbeat(Path(directory)) if directory else None


def heartbeat_age_s(directory: Path, pid: int, now: float | None = None) -> float | None:
    """Seconds since process ``pid`` last beat in ``directory``; None if it has no heartbeat."""
    try:
        touched = (directory / str(pid)).stat().st_mtime
    except FileNotFoundError:
        return None
    return (time.time() if now is None else now) - touched

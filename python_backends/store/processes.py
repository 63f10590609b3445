"""Is the process that took a lease (or claimed a key) still alive?

A pid alone can be reused by a new process after the owner died, so every record also
keeps the owner's start time (``/proc/<pid>/stat`` field 22, in clock ticks since boot).
A record is dead when its pid is gone, is a zombie (exited, not yet waited for), or now
belongs to a process that started at another time. Where ``/proc`` is missing the start
time is "" and only the pid counts.
"""

from __future__ import annotations

import os

# Indexes into the fields after the command name: field 3 (state) and field 22 (starttime).
_STATE = 0
_START_TIME = 19


def _stat_fields(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            raw = stat.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; the fields after it follow the last ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    return fields if len(fields) > _START_TIME else None


def process_start_time(pid: int) -> str:
    """The start time of ``pid`` as the kernel records it, or "" when it cannot be read."""
    fields = _stat_fields(pid)
    return "" if fields is None else fields[_START_TIME].decode("ascii")


def process_is_alive(pid: int, start_time: str) -> bool:
    """True while the process that had ``pid`` when ``start_time`` was read still runs."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by another user
    fields = _stat_fields(pid)
    if fields is None:
        return True  # no /proc here: the pid is all we have
    if fields[_STATE] in (b"Z", b"X"):
        return False
    return not start_time or fields[_START_TIME].decode("ascii") == start_time

"""Turn a poll of epd's /metrics (lines "UNIX_TIME metric{labels} value", every 2 s) into the
adaptive rule's timeline: requests per path and reason, the latest predictions, and the stage
estimates (bucket "any"), one row each time something changed.

    python results/2026-12-01/adaptive/timeline.py METRICS_POLL.txt > timeline.txt
"""

from __future__ import annotations

import re
import sys

LINE = re.compile(r"^(\S+) epd_path_(estimate_ms|predicted_ms|requests)\{(.*)\} (\S+)$")


def main(path: str) -> None:
    rows: dict[str, dict[str, float]] = {}
    for line in open(path):
        m = LINE.match(line.strip())
        if not m:
            continue
        t, kind, labels_text, value = m.groups()
        labels = dict(re.findall(r'(\w+)="([^"]*)"', labels_text))
        if kind == "estimate_ms":
            if labels["bucket"] != "any":
                continue
            key = f"est {labels['path']}/{labels['stage']}"
        elif kind == "requests":
            key = f"n {labels['path']}/{labels['reason']}"
        else:
            key = f"pred {labels['path']}"
        rows.setdefault(t, {})[key] = float(value)
    previous: dict[str, float] | None = None
    start = None
    for t, row in rows.items():
        if row == previous:
            continue
        start = start or float(t)
        cells = " ".join(f"{k}={v:.0f}" for k, v in sorted(row.items()))
        print(f"t={float(t) - start:6.0f}s {cells}")
        previous = row


if __name__ == "__main__":
    main(sys.argv[1])

"""Per mode and load point of a path benchmark run (raw.json): the client's TTFT, e2e and the span
over which its tokens arrived, next to epd's own stage timings (``timing_*_ms`` outputs: hash +
lookup + encode + prefill = the server's time to its first token from the path's start; decode =
its time from the first token to the last) and their difference (TTFT - server first: ingress
before the path started plus delivery of the first response). Medians over the point's requests.

    python results/2026-12-01/adaptive/stage_lag.py results/2026-12-01/adaptive/bench/raw.json
"""

from __future__ import annotations

import collections
import json
import statistics
import sys


def med(values: list[float]) -> int:
    return round(statistics.median(values)) if values else -1


def main(path: str) -> None:
    records = json.load(open(path))["records"]
    by_point: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
    for r in records:
        if r["chunk_times"] and r.get("error") is None:
            by_point[(r["mode"], r["load_label"])].append(r)
    print(
        "| mode | load | paths | client TTFT | client e2e | client token span | server first | server decode "
        "| TTFT - server first |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for (mode, load), rs in by_point.items():
        ttft = [r["chunk_times"][0] * 1000 for r in rs]
        e2e = [r["chunk_times"][-1] * 1000 for r in rs]
        span = [(r["chunk_times"][-1] - r["chunk_times"][0]) * 1000 for r in rs]
        if mode.startswith("llm"):
            print(f"| {mode} | {load} | - | {med(ttft)} | {med(e2e)} | {med(span)} | - | - | - |")
            continue
        first = [sum((r["stage_ms"] or {}).get(k, 0) for k in ("hash", "lookup", "encode", "prefill")) for r in rs]
        decode = [(r["stage_ms"] or {}).get("decode", 0) for r in rs]
        paths = dict(collections.Counter(r["serving_path"] for r in rs))
        lag = [t - f for t, f in zip(ttft, first, strict=True)]
        cells = [med(ttft), med(e2e), med(span), med(first), med(decode), med(lag)]
        print(f"| {mode} | {load} | {paths} | " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])

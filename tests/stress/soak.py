"""The soak: long mixed load on ``epd`` while every server process is sampled (not a test).

Load: ``--concurrency`` closed-loop clients sending good requests with unique images (store
misses) and with images from a small pool (hits), corrupt images (must be INVALID_ARG-like
errors naming the image) and streams cancelled after their first response. Every
``--sample-s``: RSS, open fds and threads of tritonserver, each stub and each vLLM engine core;
the store's bytes, entries and active leases; the vLLM engines' unfinished requests (from
/metrics). After the load, the server idles a few seconds and is sampled once more.

Verdict (``soak.json``, ``soak.md``, ``soak.png`` under ``--out``): 0 errors on good requests,
every bad input coded, 0 hangs, 0 leases left once idle, and per process the anonymous RSS and
fds of the last tenth of the run against the first tenth after ``--warmup-s`` (flat = within 5%).
Total RSS is sampled and plotted too, but not judged: on a machine without swap it counts
file-backed library pages that the kernel drops and reloads as free memory comes and goes
(``builders.stage_watch.anonymous_rss``), so it moves with other processes' load.

    python -m tests.stress.soak --duration 600 --concurrency 8 [--url HOST:GRPC --http-url HOST:HTTP --store PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from builders.machine import describe_machine, one_line
from builders.stage_watch import sample_process, server_processes
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer
from tests.stress.fault_load import FaultLoad, Outcome, as_rows, error_messages, tally

DEFAULT_OUT = REPO_ROOT / "results" / "latest" / "soak"
MIX = {"unique": 0.3, "repeated": 0.35, "bad": 0.15, "cancel": 0.2}
FLAT_WITHIN = 0.05
UNFINISHED_GAUGE = "epd_{model}_unfinished_requests"
ENGINE_MODELS = ("prefill", "decode", "llm")
SAMPLED = ("rss", "anon", "fds", "threads")
JUDGED = ("anon", "fds")  # what must stay flat (total RSS is not judged: see the module docstring)


def scrape_gauges(metrics_url: str) -> dict[str, float]:
    """The unfinished-request gauges of the vLLM-backed models (0 when absent)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as response:
            text = response.read().decode()
    except Exception:
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        for model in ENGINE_MODELS:
            if line.startswith(UNFINISHED_GAUGE.format(model=model)):
                values[model] = values.get(model, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


class Sampler:
    """Samples every process of the server, the store and the engines every ``period_s``."""

    def __init__(self, server_pid: int, store_path: str, metrics_url: str, period_s: float, began: float) -> None:
        self.server_pid, self.store_path, self.metrics_url = server_pid, store_path, metrics_url
        self.period_s, self.began = period_s, began
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        from python_backends.store import EmbeddingStore, StoreConfig

        self._store = EmbeddingStore(StoreConfig(path=store_path))  # read-only use: metrics()

    def sample(self, phase: str) -> dict[str, Any]:
        processes = {}
        for process in server_processes(self.server_pid):
            measured = sample_process(process.pid)
            if measured is not None:
                processes[process.role] = measured
        store = self._store.metrics()
        row = {
            "t_s": round(time.monotonic() - self.began, 2),
            "phase": phase,
            "processes": processes,
            "store": {k: store[k] for k in ("bytes_used", "entries", "active_leases", "map_used_bytes")},
            "unfinished": scrape_gauges(self.metrics_url),
        }
        self.samples.append(row)
        return row

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample("load")

    def start(self) -> Sampler:
        self.sample("start")
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.period_s + 10)

    def close(self) -> None:
        self._store.close()


def bad_input_coded(outcome: Outcome) -> bool:
    """A corrupt image must end in an error that names the problem, never an internal error."""
    text = outcome.message.lower()
    return outcome.result == "error" and bool(text) and "internal" not in text and "image" in text


def growth(samples: list[dict[str, Any]], role: str, metric: str, warmup_s: float) -> dict[str, Any] | None:
    """Mean of ``metric`` over the last tenth of the load samples vs the first tenth after warm-up."""
    rows = [s["processes"][role][metric] for s in samples
            if s["phase"] == "load" and s["t_s"] >= warmup_s and metric in s["processes"].get(role, {})]  # fmt: skip
    if len(rows) < 4:
        return None
    tenth = max(1, len(rows) // 10)
    first, last = statistics.fmean(rows[:tenth]), statistics.fmean(rows[-tenth:])
    return {"first": first, "last": last, "change": (last - first) / first if first else 0.0}


def verdict(outcomes: list[Outcome], samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    good = [o for o in outcomes if o.kind in ("unique", "repeated")]
    bad = [o for o in outcomes if o.kind == "bad"]
    cancels = [o for o in outcomes if o.kind == "cancel"]
    idle = samples[-1]
    roles = sorted({role for s in samples for role in s["processes"]})
    flat = {role: {m: growth(samples, role, m, warmup_s) for m in SAMPLED} for role in roles}
    not_flat = [
        f"{role} {metric} {g['change']:+.1%}"
        for role, metrics in flat.items()
        for metric, g in metrics.items()
        if metric in JUDGED and g and abs(g["change"]) > FLAT_WITHIN
    ]
    return {
        "requests": tally(outcomes),
        "by_kind": {kind: tally(outcomes, lambda o, k=kind: o.kind == k) for kind in ("unique", "repeated", "bad",
                                                                                       "cancel")},
        "good_errors": sum(o.result != "success" for o in good),
        "bad_inputs": len(bad),
        "bad_inputs_coded": sum(bad_input_coded(o) for o in bad),
        "cancel_hangs": sum(o.result == "hang" for o in cancels),
        "hangs": sum(o.result == "hang" for o in outcomes),
        "idle_active_leases": idle["store"]["active_leases"],
        "idle_unfinished": idle["unfinished"],
        "store_entries_max": max(s["store"]["entries"] for s in samples),
        "flat": flat,
        "not_flat_within_5pct": not_flat,
        "errors_seen": error_messages(outcomes),
    }


def run_soak(grpc_url: str, server_pid: int, store_path: str, metrics_url: str, duration_s: float,
             concurrency: int, sample_s: float, deadline_s: float, idle_s: float = 8.0,
             cancels: bool = True) -> dict[str, Any]:
    """The soak against a running server; returns outcomes, samples and the verdict. Without
    ``cancels`` the same mix less its cancelled streams (what Triton 2.51 itself leaks on)."""
    mix = MIX if cancels else {kind: share for kind, share in MIX.items() if kind != "cancel"}
    load = FaultLoad(grpc_url, concurrency, deadline_s, mix, seed=11, pool_size=6)
    sampler = Sampler(server_pid, store_path, metrics_url, sample_s, time.monotonic())
    try:
        load.start()
        sampler.began = load.began
        sampler.start()
        time.sleep(duration_s)
        outcomes = load.stop()
        sampler.stop()
        time.sleep(idle_s)  # cancelled streams finish their cleanup; leases go back
        sampler.sample("idle")
    finally:
        sampler.close()
    warmup_s = min(60.0, duration_s * 0.2)
    return {"outcomes": as_rows(outcomes), "samples": sampler.samples,
            "verdict": verdict(outcomes, sampler.samples, warmup_s), "warmup_s": warmup_s}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    t = [s["t_s"] for s in samples]
    roles = sorted({role for s in samples for role in s["processes"]})
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    for metric, ax, scale, label in (("anon", axes[0][0], 1 / 2**20, "anonymous RSS, MiB"),
                                     ("fds", axes[0][1], 1, "open fds")):
        for role in roles:
            ax.plot(t, [s["processes"].get(role, {}).get(metric, float("nan")) * scale for s in samples], label=role)
        ax.set_ylabel(label)
        ax.axvline(result["warmup_s"], color="grey", linestyle=":")
    axes[0][0].legend(fontsize=7)
    axes[1][0].plot(t, [s["store"]["active_leases"] for s in samples], label="active leases")
    axes[1][0].plot(t, [s["store"]["entries"] for s in samples], label="store entries")
    axes[1][0].legend()
    for model in ENGINE_MODELS:
        axes[1][1].plot(t, [s["unfinished"].get(model, float("nan")) for s in samples], label=f"{model} unfinished")
    axes[1][1].legend()
    for ax in axes.flat:
        ax.set_xlabel("seconds")
        ax.grid(True, alpha=0.3)
    fig.suptitle("soak: mixed epd load (good unique/repeated, corrupt, cancelled)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_report(result: dict[str, Any], out: Path, command: str, load_note: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    v = result["verdict"]
    (out / "soak.json").write_text(json.dumps({"command": command, "machine": describe_machine(),
                                               "load_average": load_note, **result}, indent=1))
    plot(result, out / "soak.png")
    lines = ["# Soak", "", f"Command: `{command}`", "", f"Machine: {one_line(describe_machine())}; {load_note}", "",
             f"Requests: {v['requests']}; by kind: {v['by_kind']}", "",
             "| check | result |", "|---|---|",
             f"| errors on good requests | {v['good_errors']} |",
             f"| bad inputs coded | {v['bad_inputs_coded']} of {v['bad_inputs']} |",
             f"| hangs (any kind) | {v['hangs']} |",
             f"| active leases once idle | {v['idle_active_leases']} |",
             f"| vLLM unfinished requests once idle | {v['idle_unfinished']} |",
             f"| anonymous RSS/fds beyond 5% (last tenth vs first tenth after {result['warmup_s']:.0f} s warm-up) | "
             f"{', '.join(v['not_flat_within_5pct']) or 'none'} |", "",
             "| process | anonymous RSS first -> last (MiB) | change | RSS (not judged) first -> last (MiB) | change "
             "| fds first -> last | change |", "|---|---|---|---|---|---|---|"]
    for role, metrics in v["flat"].items():
        anon, rss, fds = metrics.get("anon"), metrics["rss"], metrics["fds"]
        if rss and fds:
            anon_cells = (f"{anon['first'] / 2**20:.0f} -> {anon['last'] / 2**20:.0f} | {anon['change']:+.1%}"
                          if anon else "- | -")
            lines.append(f"| {role} | {anon_cells} | {rss['first'] / 2**20:.0f} -> {rss['last'] / 2**20:.0f} "
                         f"| {rss['change']:+.1%} | {fds['first']:.0f} -> {fds['last']:.0f} | {fds['change']:+.1%} |")
    lines += ["", "![soak](soak.png)", "", "Errors seen: " + ("; ".join(v["errors_seen"]) or "none")]
    (out / "soak.md").write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.stress.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--sample-s", type=float, default=3.0)
    parser.add_argument("--deadline-s", type=float, default=120.0, help="a request unanswered this long is a hang")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--no-cancels", dest="cancels", action="store_false",
                        help="leave out the cancelled streams (to tell Triton 2.51's cancel leak from ours)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m tests.stress.soak " + " ".join(sys.argv[1:] if argv is None else argv)
    from tests.stress.crash import Paths, prepare_repository

    paths = Paths.under(REPO_ROOT / "build" / "bench-soak", f"soak-{os.getpid()}")
    paths.work.mkdir(parents=True, exist_ok=True)
    repo = prepare_repository(paths)
    server = TritonServer(ServerOptions(repo, Ports.free(), exit_timeout_s=60), paths.work / "server.log").start()
    try:
        server.wait_ready(timeout_s=900)
        assert server.process is not None
        load_before = os.getloadavg()
        result = run_soak(server.grpc_url, server.process.pid, str(paths.store), server.metrics_url,
                          args.duration, args.concurrency, args.sample_s, args.deadline_s,
                          cancels=args.cancels)
        load_note = f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f} (1 min)"
    finally:
        report = server.stop()
        import shutil

        shutil.rmtree(paths.store.parent, ignore_errors=True)
    result["server_stop"] = report.describe() if report is not None else "not started"
    write_report(result, args.out, command.strip(), load_note)
    print(json.dumps({k: v for k, v in result["verdict"].items() if k != "flat"}, indent=1))
    print(f"wrote {args.out / 'soak.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

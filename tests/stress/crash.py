"""The crash harness: SIGKILL one process of a serving tritonserver under load (not a test).

Per case, a fresh ``triton-epd-serve`` (its own repository copy, embedding store and KV folder)
run as a container's restart policy runs it: started again whenever it exits, on the same store.

1. closed-loop ``epd`` load (``--concurrency``, unique images so every request encodes), each
   request with a deadline (``--deadline-s``): past it, the request counts as a *hang*;
2. after ``--before-s``, SIGKILL the case's process: ``stub:<model>`` (a python-backend stub,
   e.g. ``stub:encoder_0``), ``engine:<model>`` (the vLLM engine core under that stub) or
   ``tritonserver``; the load goes on for ``--after-s``;
3. meanwhile ``/v2/health/ready`` and each model's ready endpoint are polled every 0.5 s;
4. recovery: the launcher stops a server that lost a stage (``builders/stage_watch.py``) and
   exits; it is started again; recovered = 4 good requests in a row succeed afterwards;
5. the store: leases and claims of dead processes reaped, 0 active leases once idle, and a
   request with an image stored before the crash is served (a hit) by the recovered server.

Writes ``crash.json`` and ``crash.md`` (the crash table of docs/benchmarks/crashes.md) under ``--out``.

    python -m tests.stress.crash [--cases stub:encoder_0 stub:prefill stub:decode engine:decode tritonserver]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from builders.machine import describe_machine, one_line
from builders.processes import ProcessGroup
from builders.stage_watch import find_role
from builders.tritonserver import REPO_ROOT, Ports
from client.epd_client import GrpcClient, chat_prompt
from tests.stress.fault_load import FaultLoad, error_messages, small_jpeg, tally

DEFAULT_OUT = REPO_ROOT / "results" / "latest" / "crash"
DEFAULT_CASES = ("stub:encoder_0", "stub:prefill", "stub:decode", "engine:decode", "tritonserver")
WATCHED_MODELS = ("epd", "encoder_0", "prefill", "decode", "llm")
# Lines of the server log that say what Triton did about a dead process.
RECOVERY_MARKERS = ("not healthy", "stage crashed", "stage hung", "EngineDead", "stopped:", "recreated", "released")


@dataclass
class Paths:
    """Where one harness server keeps its files (its own, so other servers are not disturbed)."""

    work: Path
    store: Path
    kv: Path

    @classmethod
    def under(cls, work: Path, tag: str) -> Paths:
        node = Path(f"/dev/shm/triton-epd-crash-{tag}")
        return cls(work, node / "embeddings", node / "kv")


def prepare_repository(paths: Paths) -> Path:
    """A private cpu repository (model code copied by the builders), generated with this harness's
    store and KV folder."""
    import dataclasses

    from builders.launcher import prepare
    from builders.repository import TARGETS

    repo = paths.work / "repository"
    cache = dataclasses.replace(TARGETS["cpu"].cache, path=str(paths.store))
    prepare("cpu", None, repo, cache, kv_store_path=str(paths.kv))
    return repo


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except Exception:
        return False


@dataclass
class ReadinessWatch:
    """Polls server and model readiness; keeps the changes (time since start, state)."""

    http_url: str
    began: float
    changes: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def state(self) -> dict[str, Any]:
        base = f"http://{self.http_url}/v2"
        not_ready = [m for m in WATCHED_MODELS if not _http_ok(f"{base}/models/{m}/ready")]
        return {"server_ready": _http_ok(f"{base}/health/ready"), "live": _http_ok(f"{base}/health/live"),
                "not_ready_models": not_ready}

    def _run(self) -> None:
        last: dict[str, Any] | None = None
        while not self._stop.wait(0.5):
            now = self.state()
            if now != last:
                self.changes.append({"t_s": round(time.monotonic() - self.began, 2), **now})
                last = now

    def start(self) -> ReadinessWatch:
        self._thread = threading.Thread(target=self._run, name="readiness-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        return self.changes


def probe(url: str, image: bytes, deadline_s: float) -> tuple[bool, str, int | None]:
    """One good request; (succeeded, error, cache hits)."""
    client = GrpcClient(url, "epd")
    try:
        result = client.generate(chat_prompt("Describe the picture.", 1), [image],
                                 {"max_tokens": 4, "temperature": 0.0}, timeout_s=deadline_s)
        return True, "", result.cache_hits
    except Exception as exc:
        return False, str(exc)[:300], None
    finally:
        try:
            client.close()
        except Exception:  # the server may be gone
            pass


def wait_recovered(url: str, deadline_s: float, timeout_s: float, began: float, in_a_row: int = 4) -> float | None:
    """Seconds since ``began`` when good requests succeeded ``in_a_row`` times running (unique
    images: they spread over every encoder, so one live encoder beside a dead one is not enough), or None."""
    seed = 7_000_000 + int(time.time()) % 100_000
    end = time.monotonic() + timeout_s
    streak = 0
    while time.monotonic() < end:
        seed += 1
        ok, _, _ = probe(url, small_jpeg(seed), deadline_s)
        streak = streak + 1 if ok else 0
        if streak >= in_a_row:
            return round(time.monotonic() - began, 2)
        if not ok:
            time.sleep(1.0)
    return None


def store_state(store_path: Path) -> dict[str, Any]:
    """Reap what dead processes left in the store (as the models do periodically) and report it."""
    from python_backends.store import EmbeddingStore, StoreConfig

    with EmbeddingStore(StoreConfig(path=str(store_path))) as store:
        reaped = store.reap_dead_processes()
        metrics = store.metrics()
    return {"reaped_now": {"leases": reaped.leases, "claims": reaped.claims, "readers": reaped.readers},
            **{k: metrics[k] for k in ("active_leases", "entries", "bytes_used", "leases_reaped", "claims_reaped")}}


class Orchestrator:
    """``triton-epd-serve`` as a container's restart policy runs it: started again whenever it
    exits (the launcher exits non-zero when a stage died, builders/stage_watch.py), on the same
    repository and the same embedding store."""

    def __init__(self, paths: Paths, repo: Path, ports: Ports) -> None:
        self.paths, self.repo, self.ports = paths, repo, ports
        self.starts = 0
        self.exits: list[dict[str, Any]] = []
        self.group: ProcessGroup | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    def _launch(self) -> None:
        self.starts += 1
        tag = f"start{self.starts}"
        command = [sys.executable, "-m", "builders.launcher", "--model-repository", str(self.repo),
                   "--http-port", str(self.ports.http), "--grpc-port", str(self.ports.grpc),
                   "--metrics-port", str(self.ports.metrics), "--cache-path", str(self.paths.store),
                   "--kv-store-path", str(self.paths.kv), "--exit-timeout-s", "30",
                   "--log-file", str(self.paths.work / f"server-{tag}.log")]  # fmt: skip
        self.group = ProcessGroup("triton-epd-serve", command, log_path=self.paths.work / f"launcher-{tag}.log",
                                  stop_signal=signal.SIGINT, signal_group=False)
        self.group.start()

    def _supervise(self) -> None:
        while not self._stop.wait(0.5):
            assert self.group is not None
            code = self.group.exited()
            if code is not None:
                self.exits.append({"at": time.monotonic(), "exit_code": code})
                self._launch()

    def start(self) -> Orchestrator:
        """Launch and supervise from the start: a first start that fails (e.g. no memory for a KV
        cache on a crowded machine) is retried like any other exit."""
        self._launch()
        self._thread = threading.Thread(target=self._supervise, name="orchestrator", daemon=True)
        self._thread.start()
        return self

    def exits_since(self, began: float) -> list[dict[str, Any]]:
        """The launcher's exits, in seconds since ``began`` (negative: before it)."""
        return [{"t_s": round(e["at"] - began, 2), "exit_code": e["exit_code"]} for e in self.exits]

    def wait_ready(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if _http_ok(f"http://{self.http_url}/v2/health/ready"):
                return
            time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout_s:.0f} s")

    def server_pid(self) -> int:
        assert self.group is not None and self.group.pid is not None
        for child in psutil.Process(self.group.pid).children():
            if child.name().startswith("tritonserver"):
                return int(child.pid)
        raise LookupError("no tritonserver under the launcher")

    def stop(self) -> str:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        report = self.group.stop(timeout_s=120) if self.group is not None else None
        return report.describe() if report is not None else "not started"

    def log_lines(self) -> list[str]:
        lines = []
        for log in sorted(self.paths.work.glob("launcher-start*.log")) + sorted(self.paths.work.glob("server-*.log")):
            text = log.read_text(errors="replace").splitlines()
            lines += [f"{log.name}: {line[:220]}" for line in text if any(m in line for m in RECOVERY_MARKERS)]
        return lines[:16]


def fresh_orchestrator(paths: Paths, repo: Path) -> Orchestrator:
    """A supervised launcher on an empty store, with the logs of earlier runs removed."""
    shutil.rmtree(paths.store.parent, ignore_errors=True)
    paths.store.parent.mkdir(parents=True)
    for old_log in list(paths.work.glob("launcher-start*.log")) + list(paths.work.glob("server-start*.log")):
        old_log.unlink()
    return Orchestrator(paths, repo, Ports.free()).start()


def run_case(
    role: str, args: argparse.Namespace, paths: Paths, repo: Path, orchestrator: Orchestrator | None = None
) -> dict[str, Any]:
    """One kill under load. With ``orchestrator`` (``--chain``), on that supervised server as the
    previous case's recovery left it (one server start per case instead of two); else on a fresh
    one, stopped afterwards."""
    own = orchestrator is None
    if orchestrator is None:
        orchestrator = fresh_orchestrator(paths, repo)
    case: dict[str, Any] = {"role": role, "chained": not own}
    try:
        orchestrator.wait_ready(900)
        known_image = small_jpeg(4_242_424)  # stored before the crash: a hit after recovery
        case["warm"] = probe(orchestrator.grpc_url, known_image, args.deadline_s)[0]
        load = FaultLoad(orchestrator.grpc_url, args.concurrency, args.deadline_s, {"unique": 1.0},
                         seed=sum(map(ord, role)) % 97)
        load.start()
        watch = ReadinessWatch(orchestrator.http_url, load.began).start()
        time.sleep(args.before_s)
        victim = find_role(orchestrator.server_pid(), role)
        killed_at = round(time.monotonic() - load.began, 2)
        os.kill(victim, signal.SIGKILL)
        case.update(victim_pid=victim, killed_at_s=killed_at)
        time.sleep(args.after_s)
        outcomes = load.stop()
        recovered_at = wait_recovered(orchestrator.grpc_url, args.deadline_s, args.recovery_timeout_s, load.began)
        case["readiness"] = watch.stop()
        case["launcher_exits"] = orchestrator.exits_since(load.began)
        case["recovered_at_s"] = recovered_at
        after = [o for o in outcomes if o.started + o.seconds >= killed_at]
        case["counts_all"] = tally(outcomes)
        case["counts_after_kill"] = tally(after)
        case["errors"] = error_messages(outcomes)
        case["max_request_s"] = round(max((o.seconds for o in outcomes), default=0.0), 2)
        hit_ok, hit_error, hits = probe(orchestrator.grpc_url, known_image, args.deadline_s)
        case["store_serves_again"] = {"succeeded": hit_ok, "cache_hits": hits, "error": hit_error}
        time.sleep(2.0)  # requests ended: their leases are released
        case["store_idle"] = store_state(paths.store)
        case["log_lines"] = orchestrator.log_lines()
    finally:
        case["stop"] = orchestrator.stop() if own else "chained: the next case runs on this server"
    return case


def summarize(case: dict[str, Any]) -> str:
    """How the server recovered, in one line."""
    if case.get("recovered_at_s") is None:
        return "did not recover within the timeout"
    down = [c for c in case.get("readiness", []) if not c["server_ready"] or c["not_ready_models"]]
    went = "readiness went not-ready" if down else "readiness stayed ready"
    took = round(case["recovered_at_s"] - case["killed_at_s"], 1)
    restarts = len([e for e in case.get("launcher_exits", []) if e["t_s"] >= case["killed_at_s"]])
    how = f"launcher exited {restarts}x and was restarted on the same store" if restarts else "kept serving"
    return f"{went}; {how}; good requests again {took} s after the kill"


def write_report(cases: list[dict[str, Any]], out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "crash.json").write_text(json.dumps({"command": command, "machine": describe_machine(), "cases": cases},
                                               indent=2))
    lines = ["# Crash table", "", f"Command: `{command}`", "", f"Machine: {one_line(describe_machine())}", "",
             "| process killed (SIGKILL) | requests: success / error / hang | after the kill: success / error / hang "
             "| recovery | store after | what clients saw |", "|---|---|---|---|---|---|"]
    for case in cases:
        if "counts_all" not in case:
            lines.append(f"| `{case['role']}` | failed: {case.get('failure', '?')} | | | | |")
            continue
        c, a = case["counts_all"], case["counts_after_kill"]
        store = case["store_idle"]
        served = case["store_serves_again"]
        store_text = (f"{store['active_leases']} active leases, {store['leases_reaped']} reaped; "
                      f"stored image {'served' if served['succeeded'] else 'NOT served'}"
                      f"{' (hit)' if served['cache_hits'] else ''}")
        seen = "; ".join(case["errors"][:2]).replace("|", "/") or "-"
        lines.append(f"| `{case['role']}` | {c['success']} / {c['error']} / {c['hang']} | "
                     f"{a['success']} / {a['error']} / {a['hang']} | {summarize(case)} | {store_text} | {seen} |")
    (out / "crash.md").write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.stress.crash", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--deadline-s", type=float, default=90.0, help="a request unanswered this long is a hang")
    parser.add_argument("--before-s", type=float, default=20.0, help="load before the kill")
    parser.add_argument("--after-s", type=float, default=60.0, help="load after the kill")
    parser.add_argument("--recovery-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--work", type=Path, default=REPO_ROOT / "build" / "bench-crash")
    parser.add_argument("--chain", action="store_true",
                        help="run every case on one supervised server, each on the previous case's recovered one")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m tests.stress.crash " + " ".join(argv if argv is not None else sys.argv[1:])
    paths = Paths.under(args.work, str(os.getpid()))
    args.work.mkdir(parents=True, exist_ok=True)
    repo = prepare_repository(paths)
    cases = []
    chained = fresh_orchestrator(paths, repo) if args.chain else None
    try:
        for role in args.cases:
            print(f"crash case {role} ...", flush=True)
            try:
                case = run_case(role, args, paths, repo, chained)
            except Exception as exc:  # one broken case must not lose the others
                case = {"role": role, "failure": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(json.dumps({k: case.get(k) for k in ("role", "counts_all", "counts_after_kill", "recovered_at_s")}),
                  flush=True)
            cases.append(case)
            write_report(cases, args.out, command.strip())
    finally:
        if chained is not None:
            print(f"server stop: {chained.stop()}", flush=True)
        shutil.rmtree(paths.store.parent, ignore_errors=True)
    print(f"wrote {args.out / 'crash.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Run the python-backend BLS deadlock reproduction: the old pattern hangs, the new one does not.

``python -m tests.repro.bls_deadlock.run --pattern both --runs 3 --bound-s 120 --concurrency 8 --out DIR``

For each run: start a tritonserver (the same way the project does, ``builders.tritonserver``) that
loads only the pattern's two models from ``models/`` (old: ``relay_stream`` + ``ticker``; new:
``relay_poll`` + ``poller``), keep ``--concurrency`` requests in flight on one gRPC stream
(loopback), and stop at ``--bound-s`` (no hang) or when requests are outstanding and no response
has come for ``--stall-s`` (a hang: the caller's stub gets its native stacks dumped by gdb, its
Python stacks by py-spy where installed, and the owner of every mutex a thread waits for, and of
the GIL, read by gdb: the lock cycle, into DIR). Then the server is killed and a table printed.
Exit status 0 when every old run hung and no new run did (each half alone for ``--pattern old`` /
``new``), else 1.

The models are plain ``triton_python_backend_utils`` models (docs/upstream/python-backend-bls-deadlock.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import psutil
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from builders.tritonserver import Ports, ServerOptions, TritonServer

MODELS = Path(__file__).resolve().parent / "models"
# pattern -> (the model the clients call, the model it calls by BLS)
PATTERNS = {"old": ("relay_stream", "ticker"), "new": ("relay_poll", "poller")}
MAX_ERRORS = 20  # error responses before a run is abandoned as broken (neither hung nor clean)

# Frames of the python backend stub that make up the lock cycles (see the report).
CYCLE_FRAMES = (
    "ResponseIterator::Next",
    "ResponseIterator::EnqueueResponse",
    "Stub::GetResponseIterator",
    "Stub::SendCleanupId",
    "Stub::EnqueueUtilsMessage",
    "Metric::SendSetValueRequest",
    "Stub::SendMessage",
    "take_gil",
)


@dataclass(frozen=True)
class Load:
    concurrency: int = 8  # requests in flight
    streams: int = 8  # BLS streams (old) / generations (new) per request, one after another
    tokens: int = 8  # responses per stream
    gap_us: int = 2000  # between two responses of a stream
    stall_s: float = 15.0  # no response for this long while requests are outstanding: hung


@dataclass
class RunResult:
    run: int
    pattern: str
    caller: str
    requests_completed: int = 0
    responses: int = 0
    hung: bool = False
    seconds_to_hang: float | None = None  # load start -> last response before the stall
    seconds: float = 0.0  # how long the load ran
    errors: list[str] = field(default_factory=list)
    server_exited: int | None = None  # tritonserver's exit code if it died during the load
    stacks: list[str] = field(default_factory=list)  # files written on a hang
    cycle_threads: list[str] = field(default_factory=list)  # one line per stub thread in a cycle frame
    server_cpu_s: float = 0.0  # CPU seconds of tritonserver and its stubs (whole run, startup included)
    stubs_alive: dict[str, bool] = field(default_factory=dict)  # on a hang: which stubs still run
    lock_graph: list[str] = field(default_factory=list)  # on a hang: who waits for what, held by whom
    cycle: str = ""  # which lock cycle the stacks show: "A", "B", "A+B" (see classify), "?" if neither
    stop: str = ""
    log: str = ""


def _int32(name: str, value: int) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "INT32")
    tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
    return tensor


class _Tally:
    """What the stream callback saw; read by the driving loop."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.last_response = time.monotonic()
        self.responses = 0
        self.completed = 0
        self.errors: list[str] = []
        self.slots: queue.Queue[None] = queue.Queue()  # one item per finished request
        self.closed = False  # the load is over: what the stream's end brings is not counted

    def callback(self, result: object, error: object) -> None:
        with self.lock:
            if self.closed:
                return
            self.last_response = time.monotonic()
            if error is not None:
                self.errors.append(str(error)[:300])
                self.slots.put(None)
                return
            self.responses += 1
            if result.get_response().parameters["triton_final_response"].bool_param:  # type: ignore[attr-defined]
                self.completed += 1
                self.slots.put(None)


def _submit(
    client: grpcclient.InferenceServerClient, caller: str, inputs: list, request_id: int, tally: _Tally
) -> bool:
    """Send one request on the stream; False (and an error counted) if the stream is broken."""
    try:
        client.async_stream_infer(caller, inputs, request_id=str(request_id), enable_empty_final_response=True)
    except InferenceServerException as error:
        with tally.lock:
            tally.errors.append(f"send: {error}"[:300])
        return False
    return True


def drive(
    url: str, caller: str, load: Load, bound_s: float, server: TritonServer
) -> tuple[_Tally, bool, float, float]:
    """Keep ``load.concurrency`` requests in flight until ``bound_s`` passes or the server stalls.
    Returns the tally, whether it hung, the seconds the load ran and when it started."""
    tally = _Tally()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=tally.callback)
    inputs = [_int32("STREAMS", load.streams), _int32("TOKENS", load.tokens), _int32("GAP_US", load.gap_us)]
    started = time.monotonic()
    in_flight, hung, sent = 0, False, 0
    try:
        for _ in range(load.concurrency):
            if not _submit(client, caller, inputs, sent, tally):
                break
            in_flight, sent = in_flight + 1, sent + 1
        while time.monotonic() - started < bound_s:
            with tally.lock:
                errors = len(tally.errors)
            if errors >= MAX_ERRORS or (server.process is not None and server.process.poll() is not None):
                break
            try:
                tally.slots.get(timeout=0.25)
                in_flight -= 1
            except queue.Empty:
                pass
            else:
                if not _submit(client, caller, inputs, sent, tally):
                    break
                in_flight, sent = in_flight + 1, sent + 1
                continue
            with tally.lock:
                stalled_s = time.monotonic() - tally.last_response
            if in_flight > 0 and stalled_s > load.stall_s:
                hung = True
                break
    finally:
        seconds = time.monotonic() - started
        with tally.lock:
            tally.closed = True
        # A hung server never ends the stream: stop it from a thread we do not wait on for long
        # (the caller kills the server next, which ends it for good).
        stopper = threading.Thread(target=_close, args=(client,), daemon=True)
        stopper.start()
        stopper.join(5)
    return tally, hung, seconds, started


def _close(client: grpcclient.InferenceServerClient) -> None:
    with contextlib.suppress(Exception):
        client.stop_stream(cancel_requests=True)
    with contextlib.suppress(Exception):
        client.close()


def stub_pid(server_pid: int, model: str) -> int | None:
    """The python backend stub serving ``model`` (its command line names the model's file)."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(server_pid).children():
            with contextlib.suppress(psutil.Error):
                if any(f"/{model}/" in arg for arg in child.cmdline()):
                    return int(child.pid)
    return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every process under it, so far."""
    total = 0.0
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for process in (root, *root.children(recursive=True)):
            with contextlib.suppress(psutil.Error):
                times = process.cpu_times()
                total += times.user + times.system
    return total


def _py_spy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.is_file() else shutil.which("py-spy")


def dump_stacks(pid: int, prefix: Path) -> list[Path]:
    """gdb's native stacks of every thread of ``pid`` (and py-spy's Python ones) into files."""
    written = []
    commands = []
    if shutil.which("gdb"):
        commands.append(("gdb", ["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"]))
    py_spy = _py_spy()
    if py_spy:
        commands.append(("py-spy", [py_spy, "dump", "--pid", str(pid)]))
    for name, command in commands:
        path = prefix.with_name(f"{prefix.name}-{name}.txt")
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
            path.write_text(f"$ {' '.join(command)}\n{done.stdout}\n{done.stderr}")
        except (OSError, subprocess.TimeoutExpired) as error:
            path.write_text(f"$ {' '.join(command)}\nfailed: {error}\n")
        written.append(path)
    if not commands:
        print("neither gdb nor py-spy found: no stacks saved", file=sys.stderr)
    return written


def cycle_threads(gdb_text: str) -> list[str]:
    """One line per thread whose stack has a frame of the lock cycles: 'Thread N: f1 <- f2 ...'."""
    lines = []
    for block in re.split(r"\n(?=Thread \d+ )", gdb_text):
        header = re.match(r"Thread (\d+) ", block)
        if header is None:
            continue
        hits = []
        for frame in re.findall(r"^#\d+\s+(?:0x[0-9a-f]+ in )?(.+?) \(", block, flags=re.MULTILINE):
            for name in CYCLE_FRAMES:
                if name in frame and name not in hits:
                    hits.append(name)
        if hits:
            lines.append(f"Thread {header.group(1)}: " + " <- ".join(hits))
    return lines


def classify(threads: list[str]) -> str:
    """Cycle A: a reader waits for the GIL in Next, the monitor in EnqueueResponse, and a BLS
    opener in GetResponseIterator. Cycle B: the same reader and monitor, the cleanup thread in
    SendCleanupId, and a GIL holder waiting for the stub-to-parent mutex (Metric.set's SendMessage,
    or EnqueueUtilsMessage from a stream's last next() or the Logger)."""
    def has(text: str, first: bool = False) -> bool:
        return any((line.split(": ", 1)[1].startswith(text) if first else text in line) for line in threads)

    core = has("take_gil <- ResponseIterator::Next") and has("ResponseIterator::EnqueueResponse")
    found = []
    if core and has("Stub::GetResponseIterator", first=True):
        found.append("A")
    if core and has("Stub::SendCleanupId") and (has("Stub::SendMessage", first=True) or
                                                has("Stub::EnqueueUtilsMessage", first=True)):
        found.append("B")
    return "+".join(found) or "?"


# Which mutex a thread waits for, named by the stub frame that takes it (python_backend r24.10).
MUTEX_BY_FRAME = (
    ("ResponseIterator::EnqueueResponse", "ResponseIterator::mu_"),
    ("Stub::GetResponseIterator", "response_iterator_map_mu_"),
    ("Stub::SendCleanupId", "response_iterator_map_mu_"),
    ("Stub::ProcessBLSResponseDecoupled", "response_iterator_map_mu_"),
    ("Stub::SendMessage", "stub_to_parent_message_mu_"),
    ("Stub::EnqueueUtilsMessage", "stub_to_parent_message_mu_"),
)


@dataclass
class _Waiter:
    lwp: int
    frames: str  # the cycle frames of its stack, innermost first
    waits_for: str  # "GIL" or a mutex address
    mutex_name: str = ""


def _waiters(gdb_text: str) -> list[_Waiter]:
    """Threads blocked on the GIL (take_gil) or on a pthread mutex (__lll_lock_wait), from gdb's bt."""
    waiters = []
    for block in re.split(r"\n(?=Thread \d+ )", gdb_text):
        header = re.match(r"Thread \d+ \(Thread 0x[0-9a-f]+ \(LWP (\d+)\)", block)
        if header is None:
            continue
        frames = re.findall(r"^#\d+\s+(?:0x[0-9a-f]+ in )?(.+?) \(", block, flags=re.MULTILINE)
        hits = " <- ".join(dict.fromkeys(n for f in frames for n in CYCLE_FRAMES if n in f))
        mutex = re.search(r"pthread_mutex_lock \(mutex=(0x[0-9a-f]+)", block)
        if "__lll_lock_wait" in block and mutex is not None:
            name = next((m for f, m in MUTEX_BY_FRAME if f in hits or any(f in x for x in frames[:8])), "")
            waiters.append(_Waiter(int(header.group(1)), hits, mutex.group(1), name))
        elif "take_gil" in hits:
            waiters.append(_Waiter(int(header.group(1)), hits, "GIL"))
    return waiters


def lock_graph(pid: int, gdb_text: str) -> tuple[list[str], list[int]]:
    """Who waits for what, held by whom (gdb reads each mutex's owner and the GIL's holder from
    the live process), and the cycle among them. Returns the lines and the cycle's LWPs."""
    waiters = _waiters(gdb_text)
    mutexes = sorted({w.waits_for for w in waiters if w.waits_for != "GIL"})
    commands = [arg for m in mutexes for arg in ("-ex", f"p/d ((pthread_mutex_t*){m})->__data.__owner")]
    commands += ["-ex", "p/d _PyRuntime.ceval.gil.locked._value",
                 "-ex", "p/d ((PyThreadState*)_PyRuntime.ceval.gil.last_holder._value)->native_thread_id"]
    try:
        done = subprocess.run(["gdb", "-p", str(pid), "-batch", *commands], capture_output=True, text=True,
                              timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return [f"gdb failed: {error}"], []
    values = [int(v) for v in re.findall(r"^\$\d+ = (-?\d+)$", done.stdout, flags=re.MULTILINE)]
    if len(values) != len(mutexes) + 2:
        return [f"gdb printed {values} for {mutexes} + the GIL: {done.stderr.strip()[-300:]}"], []
    owner = dict(zip(mutexes, values[: len(mutexes)], strict=True))
    gil_locked, gil_holder = values[-2], values[-1]
    holder_of = {m: owner[m] for m in mutexes}
    holder_of["GIL"] = gil_holder if gil_locked else 0
    edges, lines = {}, []
    for w in waiters:
        held_by = holder_of.get(w.waits_for, 0)
        what = "the GIL" if w.waits_for == "GIL" else f"{w.mutex_name or 'mutex'} ({w.waits_for})"
        lines.append(f"LWP {w.lwp} [{w.frames or '?'}] waits for {what}, held by LWP {held_by or 'none'}")
        if held_by:
            edges[w.lwp] = held_by
    cycle: list[int] = []
    for start in edges:
        path, node = [], start
        while node in edges and node not in path:
            path.append(node)
            node = edges[node]
        if node in path and not cycle:
            cycle = path[path.index(node):]
    if cycle:
        lines.append("cycle: " + " -> ".join(f"LWP {n}" for n in [*cycle, cycle[0]]))
    else:
        lines.append("no cycle among the blocked threads")
    return lines, cycle


def one_run(index: int, pattern: str, load: Load, bound_s: float, out: Path) -> RunResult:
    caller, callee = PATTERNS[pattern]
    folder = out / f"run{index}-{pattern}"
    folder.mkdir(parents=True, exist_ok=True)
    result = RunResult(index, pattern, caller, log=str(folder / "server.log"))
    options = ServerOptions(
        MODELS, Ports.free(), exit_timeout_s=5,
        extra_args=("--model-control-mode=explicit", f"--load-model={callee}", f"--load-model={caller}"),
    )
    server = TritonServer(options, folder / "server.log").start()
    try:
        server.wait_ready(timeout_s=180)
        tally, result.hung, result.seconds, started = drive(server.grpc_url, caller, load, bound_s, server)
        with tally.lock:
            result.responses, result.requests_completed = tally.responses, tally.completed
            result.errors = tally.errors[:5]
            last = tally.last_response
        result.seconds = round(result.seconds, 1)
        if server.process is not None and server.process.poll() is not None:
            result.server_exited = server.process.returncode
        elif server.process is not None:
            result.server_cpu_s = round(cpu_seconds(server.process.pid), 1)
        if result.hung:
            result.seconds_to_hang = round(last - started, 1)
            pid = server.process.pid if server.process is not None else None
            stub = stub_pid(pid, caller) if pid is not None else None
            result.stubs_alive = {m: stub_pid(pid, m) is not None for m in (caller, callee)} if pid else {}
            if stub is not None:
                files = dump_stacks(stub, folder / f"{caller}-stub")
                result.stacks = [str(p) for p in files]
                gdb = [p for p in files if p.name.endswith("-gdb.txt")]
                if gdb:
                    text = gdb[0].read_text(errors="replace")
                    result.cycle_threads = cycle_threads(text)
                    result.cycle = classify(result.cycle_threads)
                    result.lock_graph, _ = lock_graph(stub, text)
                    (folder / f"{caller}-stub-locks.txt").write_text("\n".join(result.lock_graph) + "\n")
    finally:
        # A deadlocked stub never unloads: Triton gives up after its exit timeout (5 s), and
        # anything still alive 15 s after the stop signal is SIGKILLed (its /dev/shm regions removed).
        report = server.stop(timeout_s=15)
        result.stop = report.describe().splitlines()[0] if report is not None else ""
    (folder / "result.json").write_text(json.dumps(asdict(result), indent=1))
    return result


def table(results: list[RunResult]) -> str:
    rows = [
        "| run | pattern | requests completed | responses | hung | seconds to hang | lock cycle | seconds run "
        "| server CPU s |",
        "|---:|---|---:|---:|---|---:|---|---:|---:|",
    ]
    for r in results:
        hang = f"{r.seconds_to_hang:.1f}" if r.seconds_to_hang is not None else "-"
        hung = "yes" if r.hung else ("no (server exited)" if r.server_exited is not None else
                                      ("no (errors)" if len(r.errors) else "no"))
        rows.append(f"| {r.run} | {r.pattern} | {r.requests_completed} | {r.responses} | {hung} | {hang} | "
                    f"{r.cycle or '-'} | {r.seconds:.1f} | {r.server_cpu_s:.0f} |")
    return "\n".join(rows)


def verdict(results: list[RunResult], patterns: list[str]) -> bool:
    """Every old run hung, no new run did (each for the patterns that ran); broken runs fail."""
    ok = True
    for r in results:
        if r.pattern == "old":
            ok &= r.hung
        else:
            ok &= not r.hung and r.server_exited is None and not r.errors
    return ok and bool(results) and all(any(r.pattern == p for r in results) for p in patterns)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pattern", choices=("old", "new", "both"), default="both")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--bound-s", type=float, default=120.0, help="a run that has not hung by then did not hang")
    parser.add_argument("--concurrency", type=int, default=Load.concurrency)
    parser.add_argument("--streams", type=int, default=Load.streams, help="BLS streams per request")
    parser.add_argument("--tokens", type=int, default=Load.tokens, help="responses per stream")
    parser.add_argument("--gap-us", type=int, default=Load.gap_us, help="ticker/poller pause between tokens")
    parser.add_argument("--stall-s", type=float, default=Load.stall_s, help="no response this long: hung")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    load = Load(args.concurrency, args.streams, args.tokens, args.gap_us, args.stall_s)
    patterns = ["old", "new"] if args.pattern == "both" else [args.pattern]
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"load: {load}, bound {args.bound_s:g} s, {args.runs} run(s) of {'/'.join(patterns)}", flush=True)
    results: list[RunResult] = []
    for index in range(1, args.runs + 1):
        for pattern in patterns:  # interleaved: both patterns see the same machine state
            result = one_run(index, pattern, load, args.bound_s, args.out)
            results.append(result)
            status = f"HUNG after {result.seconds_to_hang} s (cycle {result.cycle})" if result.hung else "no hang"
            print(f"run {index} {pattern}: {result.requests_completed} requests, {status}"
                  f"{'; errors: ' + result.errors[0] if result.errors else ''}; {result.stop}", flush=True)
            for line in result.lock_graph:
                print(f"    {line}", flush=True)
    text = table(results)
    (args.out / "runs.json").write_text(json.dumps({"load": asdict(load), "bound_s": args.bound_s,
                                                    "runs": [asdict(r) for r in results]}, indent=1))
    (args.out / "runs.md").write_text(text + "\n")
    print(text)
    ok = verdict(results, patterns)
    print("PASS: old hung in every run, new in none" if ok else "FAIL: not (old hung in every run, new in none)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

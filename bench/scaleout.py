"""Scale-out benchmark: ``all`` vs 1E+1PD vs 2E+1PD, unique and repeated images, concurrency
1/4/8, in one run (not a test; docs/benchmarks/scale-out.md).

Layouts (each started, measured and stopped in turn; one at a time fits the shared machine):

- ``all``: one server, every model; ``epd`` encodes on its own ``encoder_<i>`` (BLS);
- ``1E+1PD``: one ``encoder`` server on "another node" (its own store) + one ``pd`` server:
  each new image's embedding crosses gRPC once, by value, into the PD node's store;
- ``2E+1PD``: the same with two encoder servers, each its own node and store.

Every layout serves ``epd`` with the disaggregated path (the colocated engine would encode in
place and hide the layout). Per point (layout x workload x concurrency), fresh images so that
no point sees another's: ``unique`` (every request a new image: one encode each) and
``repeated`` (4 images over the point's requests: 4 encodes, the rest store hits). Reported per
point: TTFT and e2e (client), epd's stage times (``timing_<stage>_ms``: where the time goes),
encodes (``encode`` requests summed over the layout's servers), cross-node bytes and remote
encode latency (the PD server's ``epd_cross_node_bytes``, ``epd_remote_encoder_*``), and
whether every answer equals ``llm``'s greedy tokens for the same image.

    python -m bench.scaleout [--requests 16] [--out results/latest/scaleout]

Writes ``results.json`` and ``results.md`` under ``--out``. Starts up to three tritonservers (one with
vLLM engines): on a shared machine, run it when no other server is up.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import shutil
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from bench.cache import private_repository, ready_server
from bench.metrics import distribution
from bench.server_stats import counter_deltas, scrape, sum_counter
from bench.workload import synthetic_image
from builders.machine import describe_machine, one_line
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer
from client.epd_client import GrpcClient, chat_prompt

DEFAULT_OUT = REPO_ROOT / "results" / "latest" / "scaleout"
WORK_DIR = REPO_ROOT / "build" / "bench-scaleout"
STORE_ROOT = Path("/dev/shm/triton-epd-bench-scaleout")  # its own stores and KV folders
LAYOUTS = ("all", "1E+1PD", "2E+1PD")
WORKLOADS = ("unique", "repeated")
CONCURRENCY = (1, 4, 8)
REPEATED_IMAGES = 4
SAMPLING = {"max_tokens": 8, "temperature": 0.0}
PROMPT = chat_prompt("Describe the picture.", 1)
METRICS_EXPORT_S = 2.5  # epd exports the remote-encoder counters every 2 s


@dataclasses.dataclass
class Layout:
    name: str
    entry: TritonServer  # the server that serves epd and llm
    servers: list[TritonServer]  # every server of the layout (encodes are summed over them)


def _repository(name: str, role: str, node: str, remote: str = "") -> ServerOptions:
    from builders.default_model import build_default_model
    from builders.repository import TARGETS, write_repository
    from builders.roles import load_model_args
    from python_backends.contract import DISAGGREGATED_PATH

    repo = private_repository(WORK_DIR / f"repo-{name}")
    store = STORE_ROOT / node
    cache = dataclasses.replace(TARGETS["cpu"].cache, path=str(store), node_id=node)
    write_repository("cpu", build_default_model(), repo, cache=cache, kv_store_path=str(STORE_ROOT / f"kv-{name}"),
                     role=role, remote_encoders=remote, path_policy=DISAGGREGATED_PATH)  # type: ignore[arg-type]  # fmt: skip
    target = dataclasses.replace(TARGETS["cpu"], cache=cache)
    return ServerOptions(repo, Ports.free(), extra_args=load_model_args(target, role))  # type: ignore[arg-type]


@contextmanager
def _server(options: ServerOptions, name: str) -> Iterator[TritonServer]:
    with ready_server(options, WORK_DIR / f"server-{name}.log") as (server, _):
        yield server


@contextmanager
def layout(name: str) -> Iterator[Layout]:
    shutil.rmtree(STORE_ROOT, ignore_errors=True)  # every layout starts cold
    with ExitStack() as stack:
        if name == "all":
            entry = stack.enter_context(_server(_repository("all", "all", "node-pd"), "all"))
            yield Layout(name, entry, [entry])
            return
        encoders = [
            stack.enter_context(_server(_repository(f"enc-{i}", "encoder", f"node-e{i}"), f"{name}-enc-{i}"))
            for i in range(1 if name == "1E+1PD" else 2)
        ]
        remote = ",".join(f"127.0.0.1:{e.options.ports.grpc}" for e in encoders)
        pd = stack.enter_context(_server(_repository("pd", "pd", "node-pd", remote), f"{name}-pd"))
        _wait_admitted(pd, len(encoders))
        yield Layout(name, pd, [*encoders, pd])


def _wait_admitted(pd: TritonServer, count: int, timeout_s: float = 120.0) -> None:
    """Until the PD server exports a breaker state for each encoder (it has admitted them)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snapshot = scrape(pd.metrics_url, timeout_s=10.0)
        states = [k for k in (snapshot.gauges if snapshot else {}) if k[0] == "epd_remote_encoder_breaker_state"]
        if len(states) >= count:
            return
        time.sleep(1.0)
    raise RuntimeError(f"the PD server did not admit {count} encoder(s) within {timeout_s:g} s")


def images_for(layout_name: str, workload: str, concurrency: int, requests: int) -> list[bytes]:
    """The point's images (fresh seeds per point): unique, or REPEATED_IMAGES cycled."""
    base = 1_000_000 + 100_000 * LAYOUTS.index(layout_name) + 10_000 * WORKLOADS.index(workload) + 1000 * concurrency
    distinct = requests if workload == "unique" else REPEATED_IMAGES
    pictures = [synthetic_image(224 + 16 * (i % 4), 224, base + i) for i in range(distinct)]
    return [pictures[i % distinct] for i in range(requests)]


def _generate(url: str, model: str, image: bytes) -> dict[str, Any]:
    client = GrpcClient(url, model)
    try:
        result = client.generate(PROMPT, [image], SAMPLING)
    finally:
        client.close()
    return result.summary()


def _snapshots(servers: list[TritonServer]) -> list[Any]:
    snapshots = [scrape(s.metrics_url, timeout_s=30.0) for s in servers]
    if any(s is None for s in snapshots):
        raise RuntimeError("cannot read /metrics of every server")
    return snapshots


def run_point(current: Layout, workload: str, concurrency: int, requests: int) -> dict[str, Any]:
    batch = images_for(current.name, workload, concurrency, requests)
    url = current.entry.grpc_url
    expected = {image: _generate(url, "llm", image)["token_ids"] for image in set(batch)}
    time.sleep(METRICS_EXPORT_S)
    before = _snapshots(current.servers)
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        records = list(pool.map(lambda image: _generate(url, "epd", image), batch))
    wall_s = time.perf_counter() - started
    time.sleep(METRICS_EXPORT_S)
    deltas = [counter_deltas(b, a) for b, a in zip(before, _snapshots(current.servers), strict=True)]
    encodes = sum(
        sum_counter({k: v for k, v in d.items() if 'model="encode"' in k}, "nv_inference_request_success") or 0
        for d in deltas
    )
    pd = deltas[-1]
    remote_calls = sum_counter(pd, "epd_remote_encoder_requests") or 0
    remote_s = sum_counter(pd, "epd_remote_encoder_latency_seconds") or 0
    stages = sorted({stage for r in records for stage in r["timings_ms"]})
    return {
        "layout": current.name,
        "workload": workload,
        "concurrency": concurrency,
        "requests": len(records),
        "distinct_images": len(set(batch)),
        "wall_s": wall_s,
        "throughput_rps": len(records) / wall_s,
        "ttft_ms": distribution((r["ttft_s"] for r in records), 1000.0),
        "e2e_ms": distribution((r["e2e_s"] for r in records), 1000.0),
        "stage_ms_mean": {s: distribution(r["timings_ms"].get(s) for r in records)["mean"] for s in stages},
        "encodes": encodes,
        "cache_hits": sum(r["cache_hits"] or 0 for r in records),
        "cross_node_bytes": sum_counter(pd, "epd_cross_node_bytes") or 0,
        "remote_encode_calls": remote_calls,
        "remote_encode_ms_mean": 1000.0 * remote_s / remote_calls if remote_calls else None,
        "remote_failures": sum_counter(pd, "epd_remote_encoder_failures") or 0,
        "equal_to_llm": sum(r["token_ids"] == expected[image] for r, image in zip(records, batch, strict=True)),
    }


def report_head(title: str, machine: dict[str, Any], command: str) -> list[str]:
    """A results.md's first lines: the title, the machine and the command that made it."""
    return [f"# {title}", "", f"Machine: {one_line(machine)}", "", f"Command: `{command}`", ""]


def table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A Markdown table: a header row, its rule and one line per row (cells already formatted)."""
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def render(results: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    columns = ("layout", "images", "c", "req/s", "TTFT p50 / p90 ms", "e2e p50 / p90 ms",
               "hash / lookup / encode / prefill / decode ms (mean)", "encodes", "hits", "cross-node bytes",
               "remote encode ms", "= llm")  # fmt: skip
    rows = []
    for p in results["points"]:
        stage = " / ".join(ms(p["stage_ms_mean"].get(s)) for s in ("hash", "lookup", "encode", "prefill", "decode"))
        rows.append((
            p["layout"], f"{p['workload']} ({p['distinct_images']})", p["concurrency"],
            f"{p['throughput_rps']:.2f}", f"{ms(p['ttft_ms']['p50'])} / {ms(p['ttft_ms']['p90'])}",
            f"{ms(p['e2e_ms']['p50'])} / {ms(p['e2e_ms']['p90'])}", stage, f"{p['encodes']:.0f}", p["cache_hits"],
            f"{p['cross_node_bytes']:.0f}", ms(p["remote_encode_ms_mean"]), f"{p['equal_to_llm']}/{p['requests']}",
        ))  # fmt: skip
    lines = [
        *report_head("Scale-out benchmark: all vs 1E+1PD vs 2E+1PD", results["machine"], results["command"]),
        f"{results['requests']} requests per point, `max_tokens` {SAMPLING['max_tokens']}, greedy; ready times: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in results["ready_s"].items()),
        "",
        *table(columns, rows),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16, help="requests per point")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=list(CONCURRENCY))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "command": "python -m bench.scaleout " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "machine": describe_machine(),
        "requests": args.requests,
        "ready_s": {},
        "points": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        for name in args.layouts:
            started = time.monotonic()
            with layout(name) as current:
                results["ready_s"][name] = time.monotonic() - started
                for image in images_for(name, "unique", 99, 2):  # warm-up: first-request costs out of the points
                    _generate(current.entry.grpc_url, "epd", image)
                for workload in WORKLOADS:
                    for concurrency in args.concurrency:
                        point = run_point(current, workload, concurrency, args.requests)
                        keys = ("layout", "workload", "concurrency", "throughput_rps", "encodes", "cross_node_bytes")
                        print(json.dumps({k: point[k] for k in keys}), flush=True)
                        results["points"].append(point)
    finally:
        shutil.rmtree(STORE_ROOT, ignore_errors=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / "results.md").write_text(render(results))
    print(render(results))


if __name__ == "__main__":
    main()

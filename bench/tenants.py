"""Tenant isolation, timed (not a test): is tenant B's request for tenant A's image as slow as
for a new image, i.e. does timing tell B that A sent it? (tests/server/test_tenants.py shows the
same structurally: encode counters and byte-identical errors.)

Per round, with images no one sent before (``isolated`` policy, the default):

- ``a_first``: tenant A sends image X (a miss: encodes);
- ``a_hit``: tenant A sends X again (a hit: no encode);
- ``b_same``: tenant B sends X (isolated: a miss, encodes);
- ``b_new``: tenant B sends image Y no one sent (a miss, encodes).

TTFT per request on the client, encodes per request from /metrics. If B could learn anything from
timing, ``b_same`` would look like ``a_hit``; isolated, it looks like ``b_new``.

    python -m bench.tenants [--url localhost:8001] [--rounds 12] [--out results/latest/tenants]

Without ``--url`` it starts its own tritonserver on a private repository copy and store.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.machine import describe_machine, one_line
from bench.server_stats import parse_metrics
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer
from client.epd_client import GrpcClient, chat_prompt

DEFAULT_OUT = REPO_ROOT / "results" / "latest" / "tenants"
WORK_DIR = REPO_ROOT / "build" / "bench-tenants"
STORE_PATH = "/dev/shm/triton-epd-bench-tenants"
SAMPLING = {"max_tokens": 2, "temperature": 0.0}  # TTFT is the point
KINDS = ("a_first", "a_hit", "b_same", "b_new")
MODELS = ("preprocess", "vit_encoder", "encode", "encoder_0", "encoder_1", "prefill", "decode", "epd")


def _encodes(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    snapshot = parse_metrics(text)
    values = {**snapshot.counters, **snapshot.gauges}
    return sum(v for (name, _labels), v in values.items() if name == "epd_cache_encodes")


def _image(seed: int, stamp: bytes) -> bytes:
    from bench.encode import photo_like_jpeg

    return photo_like_jpeg(448, 336, seed=seed) + stamp  # bytes after the JPEG end: a new key


def measure(grpc_url: str, metrics_url: str, rounds: int) -> list[dict[str, Any]]:
    client = GrpcClient(grpc_url, "epd")
    stamp = f"bench.tenants {time.time_ns()}".encode()
    rows: list[dict[str, Any]] = []
    try:
        client.generate(chat_prompt("warm", 1), [_image(1, stamp)], SAMPLING)  # first-request costs out
        for index in range(rounds):
            seen, new = _image(100 + 2 * index, stamp), _image(101 + 2 * index, stamp)
            for kind, image, tenant in (("a_first", seen, "a"), ("a_hit", seen, "a"), ("b_same", seen, "b"),
                                        ("b_new", new, "b")):
                before = _encodes(metrics_url)
                result = client.generate(chat_prompt("Whose?", 1), [image], SAMPLING, parameters={"tenant": tenant})
                rows.append({
                    "round": index, "kind": kind, "ttft_ms": result.ttft_s * 1000,
                    "encodes": _encodes(metrics_url) - before, "cache_hits": result.cache_hits,
                })
    finally:
        client.close()
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_kind = {kind: [r for r in rows if r["kind"] == kind] for kind in KINDS}
    medians = {kind: statistics.median(r["ttft_ms"] for r in items) for kind, items in by_kind.items()}
    return {
        "ttft_ms_median": medians,
        "encodes_per_request": {k: statistics.mean(r["encodes"] for r in v) for k, v in by_kind.items()},
        "cache_hits_per_request": {k: statistics.mean(r["cache_hits"] for r in v) for k, v in by_kind.items()},
        "ratio_b_same_to_b_new": medians["b_same"] / medians["b_new"],
        "ratio_b_same_to_a_hit": medians["b_same"] / medians["a_hit"],
    }


def _markdown(summary: dict[str, Any], rows: int, command: str, machine: str) -> str:
    lines = [
        "# Tenant isolation, timed", "", f"Command: `{command}`", "", f"Machine: {machine}", "",
        f"{rows // len(KINDS)} rounds; medians of TTFT per request kind (max_tokens 2).", "",
        "| request | TTFT p50 ms | encodes / request | cache hits / request |", "|---|---|---|---|",
    ]
    for kind in KINDS:
        lines.append(
            f"| {kind} | {summary['ttft_ms_median'][kind]:.1f} | {summary['encodes_per_request'][kind]:.2f} | "
            f"{summary['cache_hits_per_request'][kind]:.2f} |"
        )
    lines += [
        "", f"b_same / b_new TTFT: {summary['ratio_b_same_to_b_new']:.2f} (1 = no timing signal to B); "
        f"b_same / a_hit: {summary['ratio_b_same_to_a_hit']:.2f} (what B would see if entries were shared).", "",
    ]
    return "\n".join(lines)


def _own_server(rounds: int) -> list[dict[str, Any]]:
    from builders.launcher import prepare
    from builders.repository import TARGETS

    repo = WORK_DIR / "repo"
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(REPO_ROOT / "model_repository", repo, ignore=shutil.ignore_patterns("__pycache__", "encoder_*"))
    prepare("cpu", None, repo, dataclasses.replace(TARGETS["cpu"].cache, path=STORE_PATH))
    shutil.rmtree(STORE_PATH, ignore_errors=True)
    args = ("--model-control-mode=explicit", *(f"--load-model={m}" for m in MODELS))  # no llm, no ensemble
    options = ServerOptions(repo, Ports.free(), extra_args=args, exit_timeout_s=120)
    with TritonServer(options, WORK_DIR / "server.log") as server:
        server.wait_ready(timeout_s=1200)
        return measure(server.grpc_url, server.metrics_url, rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="gRPC url of a running server (default: start one)")
    parser.add_argument("--metrics-url", help="its /metrics url (default: port 8002 of --url's host)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.url:
        metrics = args.metrics_url or f"http://{args.url.rsplit(':', 1)[0]}:8002/metrics"
        rows = measure(args.url, metrics, args.rounds)
    else:
        rows = _own_server(args.rounds)
    summary = summarize(rows)
    command = " ".join(["python -m bench.tenants", *(argv if argv is not None else sys.argv[1:])])
    machine = one_line(describe_machine())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"command": command, "summary": summary, "rows": rows}, indent=1))
    (args.out / "results.md").write_text(_markdown(summary, len(rows), command.strip(), machine))
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

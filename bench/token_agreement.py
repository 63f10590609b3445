"""Do ``epd``'s paths answer ``llm``'s greedy tokens on the EPD benchmark's workloads?

Against a running server: the requests of docs/benchmarks/epd-pays.md's workloads (a) ``article``
(4 new images of 0.26-1.0 MP), (b) ``long-answer`` (one image, 256 tokens) and (c) ``reuse`` (80%
of images from a pool), built by ``bench.workload`` as ``bench run`` builds them, sent one at a
time (greedy decoding is then deterministic) to ``llm`` and to ``epd`` on each forced path. Per
workload and path: the share of requests whose tokens equal ``llm``'s, and where the first
differing token was. With the fp32 encoder every request agrees (tests/server/test_epd_acceptance.py);
this measures what a lower-precision encoder (``--vit-precision bf16``) costs in answers.

    python -m bench.token_agreement --vit-precision bf16 --requests 16 --out results/latest/token-agreement-bf16
    python -m bench.token_agreement --url 127.0.0.1:8001     (a server already running)

Without ``--url`` it writes ``build/repo-agreement`` with the given ``--vit-precision`` and serves
it on free ports for the run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.workload import WORKLOADS, BenchRequest

PATHS = ("colocated", "disaggregated")


def workload_requests(workload: str, count: int, seed: int = 3, salt: str | None = None) -> list[BenchRequest]:
    """``count`` requests of a named workload, as ``bench run --workload`` builds them; images
    new to every store (a fresh media salt unless one is given)."""
    from bench.cli_args import workload_spec
    from bench.workload import WorkloadBuilder

    args = argparse.Namespace(
        workload=workload, seed=seed, prompt_tokens=None, output_tokens=None, images_per_request=None,
        image_size=None, image_format="JPEG", image_dir=None, reuse_ratio=None, repeated_reuse_ratio=1.0,
        media_pool=None, no_ignore_eos=False, temperature=0.0, tokenizer=None,
        media_salt=salt if salt is not None else secrets.token_hex(4),
    )  # fmt: skip
    spec = workload_spec(args)
    return WorkloadBuilder(spec).build(count, spec.reuse_ratio)


def first_difference(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first token that differs (the shorter length if one is a prefix); None if equal."""
    if list(tokens) == list(reference):
        return None
    pairs = enumerate(zip(tokens, reference, strict=False))
    return next((i for i, (a, b) in pairs if a != b), min(len(tokens), len(reference)))


def agreement(url: str, workloads: Sequence[str], count: int) -> dict[str, Any]:
    """Per workload and path: requests, equal answers, first differing token per request."""
    from client.epd_client import GrpcClient

    llm, epd = GrpcClient(url, model="llm"), GrpcClient(url, model="epd")
    report: dict[str, Any] = {}
    for workload in workloads:
        rows: dict[str, list[int | None]] = {path: [] for path in PATHS}
        for request in workload_requests(workload, count):
            reference = llm.generate(request.prompt, request.images, request.sampling).token_ids
            for path in PATHS:
                answer = epd.generate(request.prompt, request.images, request.sampling, parameters={"path": path})
                rows[path].append(first_difference(answer.token_ids, reference))
        report[workload] = {
            path: {"requests": len(diffs), "equal": sum(d is None for d in diffs), "first_difference": diffs}
            for path, diffs in rows.items()
        }
    return report


@contextlib.contextmanager
def served(vit_precision: str, log: Path) -> Iterator[str]:
    """A server of the default model with the vision encoder in ``vit_precision``; its gRPC URL."""
    from builders.launcher import prepare
    from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer

    repository = REPO_ROOT / "build" / "repo-agreement"
    prepare("cpu", None, repository, vit_precision=vit_precision)
    with TritonServer(ServerOptions(repository, Ports.free()), log) as server:
        server.wait_ready(timeout_s=900)
        yield server.grpc_url


def table(report: dict[str, Any]) -> str:
    lines = ["| workload | path | equal to llm | first differing token (those that differ) |", "|---|---|---:|---|"]
    for workload, paths in report.items():
        for path, row in paths.items():
            differ = [d for d in row["first_difference"] if d is not None]
            lines.append(
                f"| {workload} | {path} | {row['equal']} / {row['requests']} | {', '.join(map(str, differ)) or '-'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="gRPC HOST:PORT of a running server (default: serve one for the run)")
    parser.add_argument("--vit-precision", default="fp32", help="the served encoder's, without --url (fp32, bf16)")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=sorted(WORKLOADS))
    parser.add_argument("--requests", type=int, default=16, help="requests per workload")
    parser.add_argument("--out", type=Path, default=Path("results/latest/token-agreement"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.url:
        report = agreement(args.url, args.workloads, args.requests)
    else:
        with served(args.vit_precision, args.out / "server.log") as url:
            report = agreement(url, args.workloads, args.requests)
    (args.out / "agreement.json").write_text(json.dumps(report, indent=2) + "\n")
    text = table(report)
    (args.out / "README.md").write_text(f"# Greedy tokens of epd's paths against llm's\n\n{text}\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

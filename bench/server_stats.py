"""What the server says about itself: /metrics counters, model layout, CPU time.

* /metrics is scraped before and after each load point; counters become per-point
  deltas. Kept: our own ``epd_*`` families and Triton's per-model ``nv_inference_*``.
  Cache hits and encodes are read from two counter names (``--cache-hit-metric``,
  ``--encode-metric``; ``_total`` suffix optional) and reported as absent until a
  model exports them.
* Model layout: a mode's model plus, recursively, an ensemble's steps and a BLS
  model's downstream models (config.pbtxt parameters whose value names a model in
  the repository). Their instance counts give per-instance ("per GPU") throughput that
  counts encoder instances too.
* CPU: this process's CPU time (the load generator) against the server's process tree
  (tritonserver + python stubs + vLLM engine processes), from psutil.
"""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

KEPT_PREFIXES = ("epd_", "nv_inference_")
DEFAULT_CACHE_HIT_METRIC = "epd_cache_hits"
DEFAULT_ENCODE_METRIC = "epd_encodes"
# Triton's per-model counters that give server-side time per request.
TRITON_TIME_COUNTERS = (
    "nv_inference_queue_duration_us",
    "nv_inference_compute_input_duration_us",
    "nv_inference_compute_infer_duration_us",
    "nv_inference_compute_output_duration_us",
)

SampleKey = tuple[str, tuple[tuple[str, str], ...]]


@dataclass
class MetricsSnapshot:
    counters: dict[SampleKey, float] = field(default_factory=dict)
    gauges: dict[SampleKey, float] = field(default_factory=dict)


def parse_metrics(text: str) -> MetricsSnapshot:
    snapshot = MetricsSnapshot()
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(KEPT_PREFIXES):
            continue
        is_counter = family.type == "counter"
        target = snapshot.counters if is_counter else snapshot.gauges
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            # The parser names counter samples `<family>_total`; keep the name the server
            # exported (Triton's counters have no suffix).
            name = family.name if is_counter and sample.name == f"{family.name}_total" else sample.name
            target[(name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return snapshot


def scrape(url: str | None, timeout_s: float = 5.0) -> MetricsSnapshot | None:
    """None when there is no metrics endpoint to read (not an error: stats are optional)."""
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return parse_metrics(response.read().decode("utf-8", errors="replace"))
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return None


def scrape_required(url: str, tries: int = 5) -> MetricsSnapshot:
    """/metrics now, where the caller's numbers depend on it: a busy 2-core machine can be slow
    to answer, but a missing snapshot would silently read as zero encodes, so it is an error."""
    for _ in range(tries):
        snapshot = scrape(url, timeout_s=30.0)
        if snapshot is not None:
            return snapshot
        time.sleep(1.0)
    raise RuntimeError(f"cannot read {url}")


def _label_text(labels: tuple[tuple[str, str], ...]) -> str:
    return ",".join(f'{k}="{v}"' for k, v in labels)


def counter_deltas(before: MetricsSnapshot | None, after: MetricsSnapshot | None) -> dict[str, float]:
    """``name{labels}`` -> increase over the point, for counters that moved."""
    if before is None or after is None:
        return {}
    deltas = {}
    for key, value in after.counters.items():
        change = value - before.counters.get(key, 0.0)
        if change:
            name, labels = key
            deltas[f"{name}{{{_label_text(labels)}}}" if labels else name] = change
    return deltas


def sum_counter(deltas: dict[str, float], metric: str) -> float | None:
    """Sum of a counter's deltas over all label sets; None when the server never exported it."""
    names = {metric, f"{metric}_total"}
    matched = [v for k, v in deltas.items() if k.split("{", 1)[0] in names]
    return sum(matched) if matched else None


def metric_exported(snapshot: MetricsSnapshot | None, metric: str) -> bool:
    if snapshot is None:
        return False
    names = {metric, f"{metric}_total"}
    return any(name in names for name, _ in snapshot.counters)


def per_model_server_ms(deltas: dict[str, float], models: Iterable[str]) -> dict[str, dict[str, float]]:
    """Triton's own time per request for each model (ms): queue and compute phases."""
    result = {}
    for model in models:
        label = f'model="{model}"'

        def total(metric: str, model_label: str = label) -> float:
            return sum(v for k, v in deltas.items() if k.startswith(metric + "{") and model_label in k)

        count = total("nv_inference_request_success")
        if count <= 0:
            continue
        result[model] = {
            "requests": count,
            **{
                m.removeprefix("nv_inference_").removesuffix("_duration_us"): total(m) / count / 1000.0
                for m in TRITON_TIME_COUNTERS
            },
        }
    return result


@dataclass
class ModelInfo:
    name: str
    kind: str  # backend or platform
    decoupled: bool
    instances: int
    composing: list[str] = field(default_factory=list)


@dataclass
class ModeLayout:
    """The models a mode runs on and how many instances they have in all."""

    models: dict[str, ModelInfo]

    @property
    def total_instances(self) -> int:
        return sum(info.instances for info in self.models.values())

    def to_json(self) -> dict[str, Any]:
        return {"total_instances": self.total_instances, "models": {k: asdict(v) for k, v in self.models.items()}}


def model_info(name: str, config: dict[str, Any], repository_models: set[str]) -> ModelInfo:
    kind = config.get("platform") or config.get("backend") or "unknown"
    decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
    composing: list[str] = []
    if kind == "ensemble":
        steps = config.get("ensemble_scheduling", {}).get("step", [])
        composing = [step["model_name"] for step in steps]
        instances = 0  # an ensemble is a schedule, it runs no instance of its own
    else:
        groups = config.get("instance_group") or [{"count": 1}]
        instances = sum(int(g.get("count", 1)) * max(1, len(g.get("gpus", []))) for g in groups)
        # A BLS model names its downstream models in its parameters (one home per setting).
        for param in (config.get("parameters") or {}).values():
            value = param.get("string_value", "") if isinstance(param, dict) else ""
            if value in repository_models and value != name:
                composing.append(value)
    return ModelInfo(name, kind, decoupled, instances, composing)


async def discover_layout(client: Any, model: str) -> ModeLayout:
    """Walk from ``model`` through ensemble steps and BLS downstream models."""
    index = (await client.get_model_repository_index(as_json=True)).get("models", [])
    repository_models = {m["name"] for m in index}
    # Entries without a state (older servers, fakes) count as loaded.
    not_loaded = {m["name"] for m in index if m.get("state", "READY") != "READY"}
    models: dict[str, ModelInfo] = {}
    todo = [model]
    while todo:
        name = todo.pop()
        if name in models or name in not_loaded:
            continue
        config = (await client.get_model_config(name, as_json=True))["config"]
        models[name] = model_info(name, config, repository_models)
        todo.extend(models[name].composing)
    return ModeLayout(models)


def find_listening_pid(port: int) -> int | None:
    """The local process listening on ``port`` (to measure a server we did not start)."""
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return conn.pid
    except (psutil.AccessDenied, PermissionError):
        return None
    return None


def process_tree_cpu_s(pid: int) -> float | None:
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            continue  # a process that ended mid-scan: its time is lost, a rounding error here
    return total


def model_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per python model of the tritonserver at ``pid``: each stub's process tree (its
    vLLM engine core included), by the model folder in the stub's command line."""
    per_model: dict[str, float] = {}
    try:
        stubs = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return per_model
    for stub in stubs:
        try:
            match = next(filter(None, map(_STUB_MODEL.search, stub.cmdline())), None)
        except psutil.NoSuchProcess:
            continue
        spent = process_tree_cpu_s(stub.pid)
        if match and spent is not None:
            per_model[match.group(1)] = per_model.get(match.group(1), 0.0) + spent
    return per_model


_STUB_MODEL = re.compile(r"/([^/]+)/\d+/model\.py$")


@dataclass(frozen=True)
class CpuSample:
    wall_s: float
    client_s: float
    server_s: float | None
    machine_busy_s: float = 0.0  # all processes, all cores
    core_busy_s: tuple[float, ...] = ()  # all processes, per core
    model_s: dict[str, float] = field(default_factory=dict)  # per python model (model_cpu_s)


def busy_s(times: Any) -> float:
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def machine_busy_s() -> float:
    return busy_s(psutil.cpu_times())


class CpuMeter:
    """CPU seconds of this process (all its threads), of the server's process tree(s) and of
    the whole machine (what is left is other work: noise on a shared machine).

    ``server_pids``: the roots of the server's process trees; one for tritonserver, several
    for a server made of separate processes (the vLLM peers: engines + router)."""

    def __init__(self, server_pid: int | None) -> None:
        self.server_pids: list[int] = [server_pid] if server_pid else []

    def sample(self) -> CpuSample:
        server = None
        if self.server_pids:
            trees = [process_tree_cpu_s(pid) for pid in self.server_pids]
            server = None if any(t is None for t in trees) else sum(t for t in trees if t is not None)
        cores = tuple(busy_s(times) for times in psutil.cpu_times(percpu=True))
        models = model_cpu_s(self.server_pids[0]) if len(self.server_pids) == 1 else {}
        return CpuSample(time.perf_counter(), time.process_time(), server, machine_busy_s(), cores, models)


def cpu_usage(before: CpuSample, after: CpuSample, requests: int, cores: int | None = None) -> dict[str, Any]:
    wall = after.wall_s - before.wall_s
    client = after.client_s - before.client_s
    server = None if before.server_s is None or after.server_s is None else after.server_s - before.server_s
    cores = cores or psutil.cpu_count() or 1
    other = None
    if server is not None and wall > 0 and after.machine_busy_s:
        other = max(0.0, after.machine_busy_s - before.machine_busy_s - client - server) / (wall * cores)
    per = max(requests, 1)
    return {
        "wall_s": wall,
        "client_cpu_s": client,
        "server_cpu_s": server,
        "client_cpu_ms_per_request": 1000.0 * client / per,
        "server_cpu_ms_per_request": None if server is None else 1000.0 * server / per,
        "client_to_server_cpu": None if not server else client / server,
        "other_processes_cpu_share": other,
        # Where each core idled: its busy share of the window (every process), and each model's CPU
        # per request (its stub and engine core): the per-stage cost of a split.
        "core_busy_share": [
            (b - a) / wall if wall > 0 else None for a, b in zip(before.core_busy_s, after.core_busy_s, strict=False)
        ],
        "model_cpu_ms_per_request": {
            model: 1000.0 * (spent - before.model_s.get(model, 0.0)) / per for model, spent in after.model_s.items()
        },
    }

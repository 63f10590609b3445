"""The thin edge between Triton's python backend and our plain modules.

The only module under ``python_backends`` that imports ``triton_python_backend_utils``
(it exists only inside the stub process; unit tests use the stub in tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Sequence

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.errors import EpdError, ErrorCode
from python_backends.llm_engine import GenerationChunk

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def read_inputs(request: "pb_utils.InferenceRequest", names: Iterable[str]) -> dict[str, np.ndarray]:
    inputs: dict[str, np.ndarray] = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            inputs[name] = tensor.as_numpy()
    return inputs


def bytes_tensor(name: str, values: Sequence[bytes | str]) -> "pb_utils.Tensor":
    """A BYTES tensor of ``values`` (text is sent as UTF-8)."""
    items = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in values]
    return pb_utils.Tensor(name, np.array(items, dtype=np.object_))


def triton_error(exc: BaseException) -> "pb_utils.TritonError":
    """Our errors keep their code and message; anything else is INTERNAL, no traceback."""
    if isinstance(exc, EpdError):
        return pb_utils.TritonError(exc.message, getattr(pb_utils.TritonError, exc.code.value))
    return pb_utils.TritonError(
        f"internal error: {type(exc).__name__}", getattr(pb_utils.TritonError, ErrorCode.INTERNAL.value)
    )


def error_response(exc: BaseException) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(output_tensors=[], error=triton_error(exc))


# Stage models called by ``epd`` over BLS (encoder_<i>, prefill, decode) put errors in an
# ``error`` output when the caller sets ``errors_as_outputs``: Triton 2.51's python backend
# sometimes drops a decoupled model's error response (sent with the final flag) on its way
# to a BLS caller, which then sees the stream end with no answer. Clients calling a stage
# directly still get ordinary Triton errors.
ERROR_OUTPUT = "error"
ERRORS_AS_OUTPUTS = "errors_as_outputs"


def wants_error_outputs(request: "pb_utils.InferenceRequest") -> bool:
    tensor = pb_utils.get_input_tensor_by_name(request, ERRORS_AS_OUTPUTS)
    return tensor is not None and bool(tensor.as_numpy().reshape(-1)[0])


def stage_error_response(exc: BaseException, as_output: bool) -> "pb_utils.InferenceResponse":
    if not as_output:
        return error_response(exc)
    if isinstance(exc, EpdError):
        payload = {"code": exc.code.value, "message": exc.message}
    else:
        payload = {"code": ErrorCode.INTERNAL.value, "message": f"internal error: {type(exc).__name__}"}
    return pb_utils.InferenceResponse(output_tensors=[bytes_tensor(ERROR_OUTPUT, [json.dumps(payload)])])


def chunk_response(chunk: GenerationChunk) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(
        output_tensors=[
            bytes_tensor("text_output", [chunk.text]),
            pb_utils.Tensor("output_token_ids", np.array(chunk.token_ids, dtype=np.int64)),
            pb_utils.Tensor("num_input_tokens", np.array([chunk.num_input_tokens], dtype=np.uint32)),
            pb_utils.Tensor("num_output_tokens", np.array([chunk.num_output_tokens], dtype=np.uint32)),
            bytes_tensor("finish_reason", [chunk.finish_reason or ""]),
        ]
    )


class CancelWatch:
    """Whether the client cancelled a streaming request, asked at most every ``interval_s``.

    ``sender.is_cancelled()`` is a round trip from the stub to Triton's core; asked for every
    streamed token it costs a noticeable share of a small model's time per token (and ``epd``
    streams through ``decode``, which would ask too). A cancel is noticed within ``interval_s``.
    """

    def __init__(self, sender: "pb_utils.InferenceResponseSender", interval_s: float = 0.05) -> None:
        self._sender = sender
        self._interval_s = interval_s
        self._asked_at = float("-inf")
        self._cancelled = False

    def cancelled(self) -> bool:
        now = time.monotonic()
        if not self._cancelled and now - self._asked_at >= self._interval_s:
            self._asked_at = now
            self._cancelled = bool(self._sender.is_cancelled())
        return self._cancelled


class ModelMetrics:
    """A model's custom metrics on Triton's /metrics.

    Holds every MetricFamily for the model's lifetime: Triton requires a family to outlive
    its metrics, so a family that is only a temporary breaks ``set``/``increment`` later.
    """

    def __init__(self, model_name: str) -> None:
        self._labels = {"model": model_name}
        self._families: dict[str, "pb_utils.MetricFamily"] = {}

    def _metric(self, kind: int, name: str, description: str, labels: dict[str, str]) -> "pb_utils.Metric":
        family = self._families.get(name)
        if family is None:
            family = pb_utils.MetricFamily(name=name, description=description, kind=kind)
            self._families[name] = family
        return family.Metric(labels={**self._labels, **labels})

    def gauge(self, name: str, description: str, **labels: str) -> "pb_utils.Metric":
        return self._metric(pb_utils.MetricFamily.GAUGE, name, description, labels)

    def counter(self, name: str, description: str, **labels: str) -> "pb_utils.Metric":
        return self._metric(pb_utils.MetricFamily.COUNTER, name, description, labels)


class CacheMetrics:
    """The embedding cache on /metrics, for one model.

    Counters are what this model saw (``epd_cache_lookups{result=hit|miss|join}``,
    ``epd_cache_encodes``). With ``node_gauges`` (one model per node: ``epd``) it also exports
    the node store's state as ``epd_store_*`` gauges, refreshed by :meth:`refresh`.
    """

    STORE_GAUGES = {
        "bytes_used": "Embedding bytes held by the node's store",
        "capacity_bytes": "Capacity of the node's store in bytes",
        "entries": "Embeddings held by the node's store",
        "evictions": "Entries evicted (LRU) from the node's store since it was created",
        "expirations": "Entries dropped by TTL from the node's store since it was created",
        "active_leases": "Embedding store leases held by running requests (all processes)",
    }

    def __init__(self, metrics: ModelMetrics, store: "object", node_gauges: bool = False) -> None:
        self._metrics = metrics  # keeps the families alive as long as their metrics
        self._store = store
        lookups = "Embedding cache lookups of this model's images, by result"
        self._lookups = {
            result: metrics.counter("epd_cache_lookups", lookups, result=result) for result in ("hit", "miss", "join")
        }
        self._encodes = metrics.counter("epd_cache_encodes", "Images this model encoded and wrote to the store")
        self._gauges = {
            name: metrics.gauge(f"epd_store_{name}", description)
            for name, description in (self.STORE_GAUGES.items() if node_gauges else ())
        }

    def count(self, result: str, n: int = 1) -> None:
        if n:
            self._lookups[result].increment(n)
            if result == "miss":
                self._encodes.increment(n)

    def refresh(self) -> None:
        if not self._gauges:
            return
        snapshot = self._store.metrics()  # type: ignore[attr-defined]
        for name, gauge in self._gauges.items():
            gauge.set(snapshot[name])

    async def refresh_every(self, period_s: float) -> None:
        """Keep the gauges current between requests (other processes change the store too)."""
        while True:
            self.refresh()
            await asyncio.sleep(period_s)

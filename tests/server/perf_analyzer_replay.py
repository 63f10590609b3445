"""perf_analyzer's request pattern against a decoupled model, replayed with tritonclient (no perf_analyzer).

What perf_analyzer 2.41 (``-i grpc --streaming``, concurrency mode) does, and this module does too
(perf_analyzer's ``infer_context.cc``, ``load_manager.cc``; tritonclient's ``grpc_client.cc``):

* one gRPC **stream per concurrency slot** ("context"), each started before the first request; a
  slot has one request in flight and sends the next when the previous one's final response came;
* each slot numbers its requests itself from 0 (``request_id`` "0", "1", ...): with two slots the
  server sees the same request id twice at once, on different streams;
* every request asks for ``triton_enable_empty_final_response`` (the final flag arrives as a
  response of its own when the model sent it without one) and for every output the model declares;
* the data entries of its ``--input-data`` file are played round robin, slot ``i`` starting at
  entry ``i`` and stepping by the number of slots;
* a response is matched to its request by the response's ``id``; one with an unknown id is
  dropped; an error on the stream (``error_message``) ends the run with "Failed to retrieve
  results from inference request."; a request whose final response never comes leaves its slot
  waiting ("No valid requests recorded within time interval").

``replay`` records exactly those events (errors, responses with another request's id, requests
without a final response) instead of stopping at the first, so a test can say which one happened.
"""

from __future__ import annotations

import base64
import json
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from client.grpc_streams import end_sync_stream


@dataclass
class RequestTrace:
    """One request of one slot, as perf_analyzer would record it."""

    slot: int
    request_id: str
    entry: int
    sent_at: float
    response_times: list[float] = field(default_factory=list)
    data_responses: int = 0  # responses with outputs (not the empty final one)
    final: bool = False
    error: str = ""


@dataclass
class ReplayResult:
    traces: list[RequestTrace]
    # Responses whose id is not the id of the request in flight on that stream (perf_analyzer drops
    # them, and counts the slot's request as done when one carries the final flag).
    stray_responses: list[str]
    stream_errors: list[str]  # slots that never came back

    @property
    def unfinished(self) -> list[RequestTrace]:
        return [t for t in self.traces if not t.final and not t.error]

    @property
    def errors(self) -> list[str]:
        return [f"slot {t.slot} request {t.request_id}: {t.error}" for t in self.traces if t.error] + self.stream_errors

    def problems(self) -> list[str]:
        """Everything that would have made perf_analyzer fail or hang, one line each."""
        out = list(self.errors)
        out += [f"response for unknown request id: {s}" for s in self.stray_responses]
        out += [f"slot {t.slot} request {t.request_id}: no final response" for t in self.unfinished]
        out += [
            f"slot {t.slot} request {t.request_id}: final response without any output"
            for t in self.traces
            if t.final and not t.data_responses
        ]
        return out


def _datatypes(metadata: Any) -> dict[str, str]:
    return {tensor.name: tensor.datatype for tensor in metadata.inputs}


def _array(value: Any, datatype: str) -> np.ndarray:
    """One input of a perf_analyzer data entry: a list, or ``{"content": ..., "shape": [...]}`` where
    content is a list or ``{"b64": ...}`` (for BYTES: the serialized tensor, 4-byte lengths)."""
    from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype

    shape = None
    if isinstance(value, Mapping):
        shape = value.get("shape")
        value = value["content"]
    if isinstance(value, Mapping) and "b64" in value:
        raw = base64.b64decode(value["b64"])
        if datatype == "BYTES":
            array = deserialize_bytes_tensor(raw)
        else:
            array = np.frombuffer(raw, dtype=triton_to_np_dtype(datatype))
    elif datatype == "BYTES":
        array = np.array([v.encode() if isinstance(v, str) else v for v in value], dtype=np.object_)
    else:
        array = np.array(value, dtype=triton_to_np_dtype(datatype))
    return array.reshape(shape if shape is not None else [len(array)])


def load_entries(path: Path, datatypes: Mapping[str, str]) -> list[dict[str, np.ndarray]]:
    """The ``data`` entries of a perf_analyzer ``--input-data`` file as arrays per input."""
    data = json.loads(Path(path).read_text())["data"]
    return [{name: _array(value, datatypes[name]) for name, value in entry.items()} for entry in data]


def _infer_inputs(entry: Mapping[str, np.ndarray], datatypes: Mapping[str, str]) -> list[Any]:
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, array in entry.items():
        tensor = grpcclient.InferInput(name, list(array.shape), datatypes[name])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _final_flag(response: Any) -> bool:
    parameter = response.parameters.get("triton_final_response")
    return True if parameter is None else bool(parameter.bool_param)  # tritonclient's default


class _Slot(threading.Thread):
    """One concurrency slot: its own client and stream, one request in flight."""

    def __init__(
        self, slot: int, url: str, model: str, entries: Sequence[Mapping[str, np.ndarray]],
        datatypes: Mapping[str, str], outputs: Sequence[str], slots: int, requests: int,
        parameters: Mapping[str, Any] | None, timeout_s: float,
    ) -> None:  # fmt: skip
        super().__init__(name=f"pa-slot-{slot}", daemon=True)
        self.slot, self.url, self.model = slot, url, model
        self.entries, self.datatypes, self.outputs = entries, datatypes, outputs
        self.slots, self.requests, self.parameters, self.timeout_s = slots, requests, parameters, timeout_s
        self.traces: list[RequestTrace] = []
        self.stray: list[str] = []

    def run(self) -> None:
        import tritonclient.grpc as grpcclient

        events: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client = grpcclient.InferenceServerClient(self.url)
        finished = False
        try:
            client.start_stream(callback=lambda result, error: events.put((result, error)))
            requested = [grpcclient.InferRequestedOutput(name) for name in self.outputs]
            for number in range(self.requests):
                entry = (self.slot + number * self.slots) % len(self.entries)
                trace = RequestTrace(self.slot, str(number), entry, time.monotonic())
                self.traces.append(trace)
                client.async_stream_infer(
                    self.model, _infer_inputs(self.entries[entry], self.datatypes), request_id=trace.request_id,
                    outputs=requested, enable_empty_final_response=True, parameters=dict(self.parameters or {}),
                )  # fmt: skip
                if not self._await_final(events, trace):
                    return  # perf_analyzer's slot would wait for ever (or stop): nothing more to send
            finished = True
        finally:
            end_sync_stream(client, finished)  # never a cancel after the final (Triton 2.51's leak)
            client.close()

    def _await_final(self, events: queue.Queue[tuple[Any, Any]], trace: RequestTrace) -> bool:
        deadline = trace.sent_at + self.timeout_s
        while not trace.final:
            try:
                result, error = events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return False
            if error is not None:
                trace.error = str(error)
                return False
            response = result.get_response()
            if response.id != trace.request_id:
                self.stray.append(f"slot {self.slot}: got id {response.id!r} while {trace.request_id!r} ran")
                continue
            trace.response_times.append(time.monotonic())
            trace.data_responses += 1 if len(response.outputs) else 0
            trace.final = _final_flag(response)
        return True


def replay(
    url: str, model: str, input_data: Path, concurrency: int, requests_per_slot: int,
    parameters: Mapping[str, Any] | None = None, timeout_s: float = 300.0,
) -> ReplayResult:  # fmt: skip
    """Play ``input_data`` against ``model`` the way perf_analyzer does at ``concurrency``."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(url) as client:
        metadata = client.get_model_metadata(model)
        outputs = [tensor.name for tensor in metadata.outputs]
    datatypes = _datatypes(metadata)
    entries = load_entries(input_data, datatypes)
    slots = [
        _Slot(i, url, model, entries, datatypes, outputs, concurrency, requests_per_slot, parameters, timeout_s)
        for i in range(concurrency)
    ]
    for slot in slots:
        slot.start()
    for slot in slots:
        slot.join(timeout_s * requests_per_slot + 30)
    return ReplayResult(
        traces=[t for s in slots for t in s.traces],
        stray_responses=[x for s in slots for x in s.stray],
        stream_errors=[f"slot {s.slot} still waiting after the deadline" for s in slots if s.is_alive()],
    )

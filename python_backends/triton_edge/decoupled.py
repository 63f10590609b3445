"""The base of every decoupled (streaming) python model, with its one error and cancel policy.

A ``model.py`` subclasses :class:`DecoupledModel` and writes only what differs:

- ``INPUTS``: the input names it reads;
- ``setup(args)``: build what it serves with (``self.engine``, ``self.store``, its metrics);
- ``parse(inputs)``: check a request's inputs on the ``execute`` thread (an ``EpdError`` is the
  client's fault); return None for a control request that is answered by an empty final;
- ``serve(parsed, request_id)``: an async iterator of :class:`GenerationChunk` (or, with its own
  ``respond``, of anything else), run on the model's event loop.

The policy, the same for every model:

- a parse error -> one coded error response, nothing started;
- a cancel (the client's, seen by :class:`CancelWatch`; or ``cancel_running``, or ``finalize``)
  -> the iterator is closed (which releases what the request holds, e.g. ``epd``'s leases), the
  engine request is aborted, and the stream ends with one empty FINAL and no error (under
  ``finalize`` nothing is sent: Triton ends the streams of a model it unloads);
- any failure -> exactly one coded error (its message if an ``EpdError``, else
  ``internal error: <type>``), never a traceback; in the ``error`` output for a BLS caller;
- ``finalize``: stop accepting, cancel running requests, shut the vLLM engine down on the event
  loop, stop the loop, close the store, release the metrics (every ``Metric``, then every family),
  then freeze the garbage collector (the stub exits next).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
import json
import threading
import time
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import triton_python_backend_utils as pb_utils

from python_backends import contract
from python_backends.engines.generation import GenerationChunk, text_of
from python_backends.engines.process import start_hosted_engine
from python_backends.errors import EpdError, ErrorCode
from python_backends.runtime.cpus import pin_to_model_cpus
from python_backends.runtime.event_loop import EventLoopThread
from python_backends.runtime.heartbeat import Heartbeat, start_heartbeat
from python_backends.runtime.model_params import ModelParameters
from python_backends.runtime.stage_pauses import START, StagePauses, pause_line
from python_backends.triton_edge.bls import BlsCaller
from python_backends.triton_edge.logs import route_to_triton_log
from python_backends.triton_edge.metrics import MetricHandle, ModelMetrics
from python_backends.triton_edge.responses import (
    FINAL,
    chunk_response,
    read_inputs,
    stage_error_response,
    wants_error_output,
)


class CancelWatch:
    """Whether the client cancelled a streaming request, asked at most every ``interval_s``.

    ``sender.is_cancelled()`` is a round trip from the stub to Triton's core; asked for every
    streamed token it costs a noticeable share of a small model's time per token (and ``epd``
    polls ``decode`` once per token, which would ask too). A cancel is noticed within
    ``interval_s`` of ``received_at`` or of the last ask: a request is taken as not cancelled when
    it arrives, so one answered within ``interval_s`` (a ``decode`` poll) never asks.
    """

    def __init__(
        self, sender: pb_utils.InferenceResponseSender, interval_s: float = 0.05, received_at: float | None = None
    ) -> None:
        self._sender = sender
        self._interval_s = interval_s
        self._asked_at = float("-inf") if received_at is None else received_at
        self._cancelled = False

    def cancelled(self) -> bool:
        now = time.monotonic()
        if not self._cancelled and now - self._asked_at >= self._interval_s:
            self._asked_at = now
            self._cancelled = bool(self._sender.is_cancelled())
        return self._cancelled


class DecoupledModel:
    INPUTS: tuple[str, ...] = ()
    CLIENT_ABORT = False  # the client's request_id names its request; abort = true stops it
    STATE_PERIOD_S = 1.0  # how often ``refresh_state`` runs

    engine: Any = None  # what serves requests: shut down (``shutdown()``) in finalize
    store: Any = None  # the node's embedding store, if the model opens it: closed in finalize
    heartbeat: Heartbeat | None = None  # python_backends/runtime/heartbeat.py: stopped in finalize
    loop: EventLoopThread
    model_name: str
    params: ModelParameters
    metrics: ModelMetrics
    _vllm_engine: Any = None  # the engine start_engine started
    _unfinished: MetricHandle | None = None  # epd_<model>_unfinished_requests, with a vLLM engine
    _bls: BlsCaller | None = None  # ``engine`` when it reaches other models over BLS

    # --- hooks ------------------------------------------------------------------------------

    def setup(self, args: dict[str, str]) -> None:
        raise NotImplementedError

    def parse(self, inputs: dict[str, Any], request: pb_utils.InferenceRequest) -> Any:
        raise NotImplementedError

    def serve(self, parsed: Any, request_id: str) -> AsyncGenerator[Any, None]:
        raise NotImplementedError

    def request_id(self, parsed: Any) -> str:
        return uuid.uuid4().hex

    def respond(self, item: Any) -> tuple[pb_utils.InferenceResponse, bool]:
        """The response for one item ``serve`` yielded, and whether it is the last."""
        chunk: GenerationChunk = item
        return chunk_response(chunk, self.declared_outputs), chunk.finished

    def refresh_state(self) -> None:
        """Every ``STATE_PERIOD_S`` on the event loop: the gauges that follow the model's state
        (running requests, the engine's unfinished ones; a model adds its own). Never per request:
        each gauge that moved is a round trip to the server (``metrics.py``'s cost rule), and a
        ``decode`` polled once per token would pay them per token."""
        with self._lock:
            running = len(self._running)
        self._running_gauge.set(running)
        if self._unfinished is not None and self._vllm_engine is not None:
            self._unfinished.set(self._vllm_engine.unfinished_requests())

    # --- helpers for setup and parse ----------------------------------------------------------

    def start_engine(self, args: dict[str, str], engine_type: Any) -> Any:
        """Start the vLLM engine this model hosts (``engines/process.py``); shut down in finalize."""
        engine_args = Path(args["model_repository"]) / args["model_version"] / "engine_args.json"
        engine = start_hosted_engine(engine_type, self.params.vllm_environment(), engine_args, self.loop.run)
        self._vllm_engine = engine  # may differ from ``self.engine`` (epd: its colocated engine)
        # Scraped by tests and operators: returns to 0 once cancelled streams are aborted.
        self._unfinished = self.metrics.gauge(
            f"epd_{self.model_name}_unfinished_requests",
            f"Requests the {self.model_name} model's vLLM engine is still tracking",
        )
        return engine

    def cancel_running(self, request_id: str) -> None:
        """Cancel the running request of ``request_id`` (handled like a client's cancel)."""
        with self._lock:
            future = self._running.get(request_id)
        if future is not None:
            future.cancel()

    # --- Triton's entry points ------------------------------------------------------------------

    def initialize(self, args: dict[str, str]) -> None:
        self.model_name = args["model_name"]
        route_to_triton_log(self.model_name)
        self.heartbeat = start_heartbeat()  # for the launcher's stage watch: a stub that runs no Python
        config = json.loads(args["model_config"])
        self.params = ModelParameters.from_model_config(config)
        pin_to_model_cpus(self.model_name, self.params.string(contract.CPUS, ""))  # before anything starts
        self.declared_outputs = frozenset(output["name"] for output in config.get("output", []))
        # Test servers only (python_backends/runtime/stage_pauses.py); empty in every served target.
        self.pauses = StagePauses.parse(self.params.string(contract.TEST_PAUSES, ""))
        self.metrics = ModelMetrics(self.model_name)
        self._running: dict[str, concurrent.futures.Future[Any]] = {}
        self._lock = threading.Lock()
        self._accepting = True
        self.loop = EventLoopThread()
        # Scraped by tests and operators: 0 once every request (cancelled ones too) has ended.
        self._running_gauge = self.metrics.gauge(
            f"epd_{self.model_name}_running_requests", f"Requests the {self.model_name} model is still serving"
        )
        self.setup(args)
        self.loop.submit(self._refresh_state_every())
        self._bls = self.engine if isinstance(self.engine, BlsCaller) else None  # epd, encoder_<i>
        if self._bls is not None:
            self.loop.submit(self._report_open_streams(self._bls))

    async def _refresh_state_every(self) -> None:
        while True:
            self.refresh_state()
            await asyncio.sleep(self.STATE_PERIOD_S)

    async def _report_open_streams(self, caller: BlsCaller, period_s: float = 1.0) -> None:
        # Scraped by the tests before every stop: a stream left open holds up the unload.
        gauge = self.metrics.gauge(
            f"epd_{self.model_name}_bls_open_streams",
            f"BLS response streams the {self.model_name} model opened that have not reached their final response",
        )
        while True:
            gauge.set(caller.open_streams)
            await asyncio.sleep(period_s)

    def execute(self, requests: list[pb_utils.InferenceRequest]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            as_output = wants_error_output(request)
            try:
                if not self._accepting:
                    raise EpdError(f"{self.model_name} is shutting down", ErrorCode.UNAVAILABLE)
                inputs = read_inputs(request, self.INPUTS)
                client_id = self._client_request(inputs)
                parsed = None if client_id is None else self.parse(inputs, request)
            except Exception as exc:  # the request's fault (or ours): one coded error, nothing started
                sender.send(stage_error_response(exc, as_output), flags=FINAL)
                continue
            if parsed is None:  # a control request, done in parse (or an in-band abort)
                sender.send(flags=FINAL)
                continue
            request_id = self.request_id(parsed)
            future = self.loop.submit(self._serve(parsed, request_id, sender, as_output, time.monotonic()))
            with self._lock:
                self._running[client_id or request_id] = future
            future.add_done_callback(functools.partial(self._forget, client_id or request_id))

    def _client_request(self, inputs: dict[str, Any]) -> str | None:
        """The client's name for its request ("": none), or None for an in-band abort, which
        stops the running request of that name (``CLIENT_ABORT`` models: ``llm``, ``epd``)."""
        if not self.CLIENT_ABORT:
            return ""
        client_id = text_of(inputs.get(contract.REQUEST_ID))
        if contract.ABORT in inputs and bool(inputs[contract.ABORT].reshape(-1)[0]):
            if not client_id:
                raise EpdError(f"'{contract.ABORT}' needs the '{contract.REQUEST_ID}' to stop", ErrorCode.INVALID_ARG)
            self.cancel_running(client_id)  # handled like the client's cancel of that stream
            return None
        with self._lock:
            if client_id in self._running:
                raise EpdError(f"request_id '{client_id}' is already running", ErrorCode.INVALID_ARG)
        return client_id

    def _forget(self, request_id: str, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            if self._running.get(request_id) is future:
                del self._running[request_id]

    async def _serve(self, parsed: Any, request_id: str, sender: Any, as_output: bool, received_at: float) -> None:
        cancel = CancelWatch(sender, received_at=received_at)
        stream = self.serve(parsed, request_id)
        ended = False  # a FINAL went out
        sent = 0
        try:
            await self._pause(START, self.pauses.start_s, request_id)
            if cancel.cancelled():  # while it waited (queued, or a test pause): never started
                return
            async for item in stream:
                if cancel.cancelled():
                    break
                reply, last = self.respond(item)
                sender.send(reply, flags=FINAL if last else 0)
                ended = ended or last
                sent += 1
                if not last and self.pauses.after(sent):
                    await self._pause(f"after_{sent}", self.pauses.after(sent), request_id)
                    if cancel.cancelled():  # left during the pause: do not start the next step
                        break
        except asyncio.CancelledError:
            pass  # finalize or cancel_running: handled like the client's cancel, below
        except Exception as exc:  # every failure reaches the caller as one coded error
            pb_utils.Logger.log_warn(f"{self.model_name} request {request_id} failed: {exc!r}")
            if self._accepting:
                self._send_final(sender, request_id, stage_error_response(exc, as_output))
            ended = True
        finally:
            await self._end(stream, request_id, sender, ended)

    async def _pause(self, point: str, seconds: float, request_id: str) -> None:
        """A test pause (``test_pauses``), announced in the log; nothing when not configured."""
        if seconds > 0:
            pb_utils.Logger.log_info(pause_line(self.model_name, point, request_id, seconds))
            await asyncio.sleep(seconds)

    async def _end(self, stream: AsyncGenerator[Any, None], request_id: str, sender: Any, ended: bool) -> None:
        try:
            await stream.aclose()
            if not ended and callable(getattr(self.engine, "abort", None)):
                await self.engine.abort(request_id)
        except Exception as exc:
            pb_utils.Logger.log_warn(f"{self.model_name} request {request_id}: cleanup failed: {exc!r}")
        finally:
            # Not while finalize runs: Triton tears the streams down itself then, and a send to a
            # model that is unloading can block this stub for good.
            if not ended and self._accepting:
                self._send_final(sender, request_id)

    def _send_final(self, sender: Any, request_id: str, response: Any = None) -> None:
        """The request's last response; a failure is logged, never raised: an error escaping the
        request's task would keep its frames, and with them the response sender, alive."""
        try:
            sender.send(response, flags=FINAL)
        except Exception as exc:
            pb_utils.Logger.log_warn(f"{self.model_name} request {request_id}: final response failed: {exc!r}")

    def finalize(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self._accepting = False
        if self._bls is not None:
            # No new BLS calls: a cancelled request's cleanup (epd's abort_decode) would call models
            # that are unloading too, and a call blocked there keeps this stub from exiting.
            self._bls.shutdown()
        # Cancels what still runs (each ends as a cancel and aborts its engine request), shuts the
        # vLLM engine down *on the loop* (AsyncLLM closes its sockets and cancels its output
        # handler there: after the loop stopped they never were, and the zmq objects were left to
        # the garbage collector), then stops the loop.
        engine = self._vllm_engine
        self.loop.stop(last=engine.shutdown if engine is not None else None)
        if self.engine is not None and self.engine is not engine:
            self.engine.shutdown()
        if self.store is not None:
            self.store.close()
        self.metrics.release()
        # The stub exits next. Python's exit runs a full garbage collection over every object of
        # torch, vLLM and transformers: ~2.5 s of a vLLM stub's unload on these 2 cores (py-spy:
        # gc_collect_main after finalize; docs/benchmarks/cancellation.md). Nothing is left to release
        # by then; frozen objects are skipped by that collection (and memory goes back with the
        # process).
        gc.freeze()

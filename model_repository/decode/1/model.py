"""`decode`: a vLLM KV consumer, decoupled. Image references + KV transfer parameters in
(from `prefill`, through `epd`); streams tokens 2..N.

A request with `abort` = true is a control request, answered with one empty final response:
with a `request_id` it stops the running request of that id (the `epd` BLS sends it when its
client cancels, because a BLS request cannot be cancelled in Triton 2.51); with
`transfer_params` it deletes that prefilled KV transfer (client gone before decode).

Thin by design: inputs parsed by python_backends.pd_stage, served by
python_backends.pd.engines.DecodeEngine.
"""

import asyncio
import threading
import uuid

import triton_python_backend_utils as pb_utils

from python_backends.errors import EpdError
from python_backends.llm_engine import GenerationChunk
from python_backends.pd.engines import DecodeEngine
from python_backends.pd_stage import StageRuntime, parse_stage_inputs, resolve_images
from python_backends.triton_edge import (
    FINAL,
    CancelWatch,
    ModelMetrics,
    chunk_response,
    read_inputs,
    stage_error_response,
    wants_error_outputs,
)

INPUT_NAMES = ("references", "transfer_params", "sampling_parameters", "stream", "request_id", "abort")


class TritonPythonModel:
    def initialize(self, args):
        self.stage = StageRuntime.start(args, DecodeEngine)
        self.running = {}  # request_id -> future of its task (execute thread and loop thread)
        self.lock = threading.Lock()
        self.metrics = ModelMetrics(args["model_name"])
        self.unfinished = self.metrics.gauge(
            "epd_decode_unfinished_requests", "Requests the decode model's vLLM engine is still tracking"
        )

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            as_output = wants_error_outputs(request)
            try:
                parsed = parse_stage_inputs(read_inputs(request, INPUT_NAMES), self.stage.max_tokens_limit)
                if parsed.abort:
                    if parsed.request_id:
                        self._abort(parsed.request_id)
                    if parsed.transfer_params:  # prefilled KV no decode will take
                        self.stage.engine.discard(parsed.transfer_params)
                    sender.send(flags=FINAL)
                    continue
                images, _ = resolve_images(self.stage.store, parsed.references)
            except EpdError as exc:
                sender.send(stage_error_response(exc, as_output), flags=FINAL)
                continue
            request_id = parsed.request_id or uuid.uuid4().hex
            with self.lock:
                self.running[request_id] = self.stage.loop.submit(self._serve(parsed, images, sender, request_id, as_output))

    def _abort(self, request_id):
        with self.lock:
            future = self.running.get(request_id)
        if future is not None:
            future.cancel()

    async def _serve(self, parsed, images, sender, request_id, as_output):
        finished = False
        cancel = CancelWatch(sender)
        try:
            async for chunk in self.stage.engine.decode(
                parsed.transfer_params, images, parsed.sampling, request_id=request_id, stream=parsed.stream
            ):
                if cancel.cancelled():
                    break
                generation = GenerationChunk(
                    text=chunk.text,
                    token_ids=chunk.token_ids,
                    num_input_tokens=0,
                    num_output_tokens=chunk.num_output_tokens,
                    finish_reason=chunk.finish_reason,
                    finished=chunk.finished,
                )
                finished = chunk.finished
                sender.send(chunk_response(generation), flags=FINAL if chunk.finished else 0)
            if not finished:
                await self.stage.engine.abort(request_id)
                sender.send(flags=FINAL)
                finished = True
        except asyncio.CancelledError:
            await self.stage.engine.abort(request_id)
            sender.send(flags=FINAL)
            finished = True
        except Exception as exc:  # every failure reaches the caller as one coded error
            pb_utils.Logger.log_warn(f"decode {request_id} failed: {exc}")
            if not finished:
                sender.send(stage_error_response(exc, as_output), flags=FINAL)
        finally:
            with self.lock:
                self.running.pop(request_id, None)
            self.unfinished.set(int(self.stage.engine.engine.output_processor.get_num_unfinished_requests()))

    def finalize(self):
        self.stage.close()

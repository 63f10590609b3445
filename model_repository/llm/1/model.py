"""`llm`: one colocated vLLM engine that takes raw encoded images (the baseline).

Thin by design: settings are read in initialize, requests are parsed by
python_backends.generate_request and served by python_backends.llm_engine.
"""

import uuid

import triton_python_backend_utils as pb_utils

from python_backends.errors import EpdError
from python_backends.event_loop import EventLoopThread
from python_backends.generate_request import parse_generate_request, request_limits
from python_backends.image_embeds import EmbedsSpec
from python_backends.llm_engine import LlmEngine, engine_args_for
from python_backends.media import decode_images
from python_backends.model_params import ModelParameters
from python_backends.triton_edge import (
    FINAL,
    CancelWatch,
    ModelMetrics,
    chunk_response,
    error_response,
    read_inputs,
)

INPUT_NAMES = (
    "text_input",
    "image",
    "image_embeds",
    "image_grid_thw",
    "stream",
    "sampling_parameters",
    "exclude_input_in_output",
)


class TritonPythonModel:
    def initialize(self, args):
        params = ModelParameters.from_model_config(args["model_config"])
        hidden = params.integer("image_embeds_hidden_size", 0, minimum=1)
        self.limits = request_limits(
            params,
            # Embeddings by value (the ensemble, or a client that ran encode itself);
            # refused when the repository was generated without the encoder's facts.
            EmbedsSpec(hidden, params.integer("spatial_merge_size", 2, minimum=1)) if hidden else None,
        )
        engine_args = engine_args_for(args, params.vllm_environment())
        self.loop = EventLoopThread()
        self.engine = self.loop.run(LlmEngine.start(engine_args))
        # Scraped by tests and operators: must return to 0 after cancelled streams.
        self.metrics = ModelMetrics(args["model_name"])
        self.unfinished = self.metrics.gauge(
            "epd_llm_unfinished_requests", "Requests the llm model's vLLM engine is still tracking"
        )

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                parsed = parse_generate_request(read_inputs(request, INPUT_NAMES), self.limits)
                images = decode_images(parsed.images, self.limits.images)
            except EpdError as exc:
                sender.send(error_response(exc), flags=FINAL)
                continue
            self.loop.submit(self._serve(parsed, images, sender))
        return None

    async def _serve(self, parsed, images, sender):
        request_id = uuid.uuid4().hex
        stream = self.engine.generate(parsed, images, request_id)
        cancel = CancelWatch(sender)
        try:
            async for chunk in stream:
                if cancel.cancelled():
                    await self.engine.abort(request_id)
                    sender.send(flags=FINAL)
                    return
                sender.send(chunk_response(chunk), flags=FINAL if chunk.finished else 0)
        except Exception as exc:  # every failure reaches the client as one coded error
            pb_utils.Logger.log_warn(f"llm request {request_id} failed: {exc}")
            sender.send(error_response(exc), flags=FINAL)
        finally:
            await stream.aclose()
            self.unfinished.set(self.engine.unfinished_requests())

    def finalize(self):
        self.loop.stop()
        self.engine.shutdown()

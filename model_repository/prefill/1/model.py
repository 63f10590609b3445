"""`prefill`: a vLLM KV producer. Prompt + image references in; first token + KV transfer
parameters out (max_tokens=1). Never receives media: its config has no image input.

Thin by design: settings are read in initialize, inputs parsed by python_backends.pd_stage,
served by python_backends.pd.engines.PrefillEngine. Decoupled (one response per request) so
that requests run concurrently on the engine's event loop, like `llm`.
"""

import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.errors import EpdError
from python_backends.pd.engines import PrefillEngine
from python_backends.pd_stage import StageRuntime, parse_stage_inputs, resolve_images
from python_backends.triton_edge import (
    FINAL,
    ModelMetrics,
    bytes_tensor,
    read_inputs,
    stage_error_response,
    wants_error_outputs,
)

INPUT_NAMES = ("text_input", "references", "sampling_parameters")


class TritonPythonModel:
    def initialize(self, args):
        self.stage = StageRuntime.start(args, PrefillEngine)
        # Scraped by tests: what crossed Triton into prefill per image (references only).
        self.metrics = ModelMetrics(args["model_name"])
        input_bytes = "Bytes of image inputs prefill received, by kind (reference; media is always 0)"
        self.reference_bytes = self.metrics.counter("epd_prefill_input_bytes", input_bytes, kind="reference")
        self.media_bytes = self.metrics.counter("epd_prefill_input_bytes", input_bytes, kind="media")
        self.references = self.metrics.counter(
            "epd_prefill_references", "Image references prefill received"
        )

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            as_output = wants_error_outputs(request)
            try:
                parsed = parse_stage_inputs(read_inputs(request, INPUT_NAMES), self.stage.max_tokens_limit)
                self.reference_bytes.increment(sum(len(r) for r in parsed.references))
                self.references.increment(len(parsed.references))
                images, _ = resolve_images(self.stage.store, parsed.references)
            except EpdError as exc:
                sender.send(stage_error_response(exc, as_output), flags=FINAL)
                continue
            self.stage.loop.submit(self._serve(parsed, images, sender, as_output))

    async def _serve(self, parsed, images, sender, as_output):
        try:
            result = await self.stage.engine.prefill(parsed.text, images, parsed.sampling, request_id=uuid.uuid4().hex)
            transfer = result.transfer.to_json() if result.transfer is not None else ""
            outputs = [
                pb_utils.Tensor("output_token_ids", np.array([result.first_token_id], dtype=np.int64)),
                bytes_tensor("text_output", [result.first_text]),
                pb_utils.Tensor("num_input_tokens", np.array([result.num_prompt_tokens], dtype=np.uint32)),
                bytes_tensor("finish_reason", [result.finish_reason or ""]),
                bytes_tensor("transfer_params", [transfer]),
            ]
            sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=FINAL)
        except Exception as exc:  # every failure reaches the caller as one coded error
            pb_utils.Logger.log_warn(f"prefill failed: {exc}")
            sender.send(stage_error_response(exc, as_output), flags=FINAL)

    def finalize(self):
        self.stage.close()

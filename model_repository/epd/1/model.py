"""`epd`: the main entry point (BLS, decoupled), same interface as `llm`.

hash media -> embedding store lookup -> encode misses -> prefill -> first token at once ->
stream decode. The steps live in python_backends.epd_pipeline (Triton-free, unit-tested with
a fake); the BLS calls in python_backends.epd_triton. This file only wires them.
"""

import uuid
from pathlib import Path

import triton_python_backend_utils as pb_utils

from python_backends.epd_pipeline import EpdPipeline, pinned_encoder
from python_backends.epd_triton import BlsStages, epd_response
from python_backends.errors import EpdError
from python_backends.event_loop import EventLoopThread
from python_backends.generate_request import check_image_headers, parse_generate_request, request_limits
from python_backends.model_params import ModelParameters
from python_backends.store import EmbeddingStore, KeyConfig
from python_backends.triton_edge import FINAL, CacheMetrics, CancelWatch, ModelMetrics, error_response, read_inputs

INPUT_NAMES = ("text_input", "image", "stream", "sampling_parameters", "exclude_input_in_output")


class TritonPythonModel:
    def initialize(self, args):
        params = ModelParameters.from_model_config(args["model_config"])
        self.limits = request_limits(params, accept_mm_hash=True)
        self.store = EmbeddingStore(params.store_config())
        self.stages = BlsStages(params.string("prefill_model", "prefill"), params.string("decode_model", "decode"))
        repository = Path(args["model_repository"]).parent
        keys = KeyConfig.from_files(Path(params.string("preprocessor_config")), repository / params.string("encoder_file"))
        self.pipeline = EpdPipeline(
            self.store,
            self.stages,
            keys,
            params.string("encoder_models").split(","),
            node_cache=params.string("cache_scope", "node") == "node",
        )
        self.loop = EventLoopThread()
        self.metrics = ModelMetrics(args["model_name"])
        self.cache_hits = self.metrics.counter(
            "epd_cache_hits", "Images served from the embedding store without encoding"
        )
        self.cache_metrics = CacheMetrics(self.metrics, self.store, node_gauges=True)
        self.loop.submit(self.cache_metrics.refresh_every(1.0))

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                parsed = parse_generate_request(read_inputs(request, INPUT_NAMES), self.limits)
                check_image_headers(parsed, self.limits)
                encoder = pinned_encoder(request.parameters())
            except EpdError as exc:
                sender.send(error_response(exc), flags=FINAL)
                continue
            self.loop.submit(self._serve(parsed, encoder, sender))

    async def _serve(self, parsed, encoder, sender):
        request_id = uuid.uuid4().hex
        stream = self.pipeline.run(parsed, request_id, encoder)
        cancel = CancelWatch(sender)
        try:
            async for item in stream:
                if cancel.cancelled():
                    sender.send(flags=FINAL)
                    return
                if item.timings_ms:
                    self.cache_hits.increment(item.cache_hits)
                    self.cache_metrics.count("hit", item.fast_hits)
                sender.send(epd_response(item), flags=FINAL if item.chunk.finished else 0)
        except Exception as exc:  # every failure reaches the client as one coded error
            pb_utils.Logger.log_warn(f"epd request {request_id} failed: {exc}")
            sender.send(error_response(exc), flags=FINAL)
        finally:
            await stream.aclose()
            self.cache_metrics.refresh()

    def finalize(self):
        self.loop.stop()
        self.stages.close()
        self.store.close()

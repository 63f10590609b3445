"""`epd`: the main entry point (BLS, decoupled), same interface as `llm`.

hash media -> embedding store lookup -> encode misses -> prefill -> first token at once ->
stream decode. The steps live in python_backends.epd_pipeline (Triton-free, unit-tested with
a fake); the BLS calls in python_backends.epd_triton. This file only wires them.
"""

import hashlib
import json
import uuid
from pathlib import Path

import triton_python_backend_utils as pb_utils

from python_backends.epd_pipeline import EpdPipeline, KeyConfig
from python_backends.epd_triton import BlsStages, epd_response
from python_backends.errors import EpdError
from python_backends.event_loop import EventLoopThread
from python_backends.generate_request import parse_generate_request, request_limits
from python_backends.model_params import ModelParameters
from python_backends.store import EmbeddingStore
from python_backends.triton_edge import FINAL, ModelMetrics, error_response, read_inputs

INPUT_NAMES = ("text_input", "image", "stream", "sampling_parameters", "exclude_input_in_output")


def key_config(params: ModelParameters, repository: Path) -> KeyConfig:
    """The content key covers the preprocessing config and the served encoder file."""
    preprocess = json.loads(Path(params.string("preprocessor_config")).read_text())
    encoder = repository / params.string("encoder_file")
    if not encoder.is_file():
        raise ValueError(f"model '{params.model_name}': encoder_file {encoder} does not exist; regenerate the repository")
    return KeyConfig(preprocess, hashlib.sha256(encoder.read_bytes()).hexdigest())


class TritonPythonModel:
    def initialize(self, args):
        params = ModelParameters.from_model_config(args["model_config"])
        self.limits = request_limits(params)
        self.store = EmbeddingStore(params.store_config())
        self.stages = BlsStages(
            params.string("encode_model", "encode"),
            params.string("prefill_model", "prefill"),
            params.string("decode_model", "decode"),
        )
        self.pipeline = EpdPipeline(self.store, self.stages, key_config(params, Path(args["model_repository"]).parent))
        self.loop = EventLoopThread()
        self.metrics = ModelMetrics(args["model_name"])
        self.cache_hits = self.metrics.counter(
            "epd_cache_hits", "Images served from the embedding store without encoding"
        )
        self.active_leases = self.metrics.gauge(
            "epd_store_active_leases", "Embedding store leases held by running requests (all processes)"
        )

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                parsed = parse_generate_request(read_inputs(request, INPUT_NAMES), self.limits)
            except EpdError as exc:
                sender.send(error_response(exc), flags=FINAL)
                continue
            self.loop.submit(self._serve(parsed, sender))

    async def _serve(self, parsed, sender):
        request_id = uuid.uuid4().hex
        stream = self.pipeline.run(parsed, request_id)
        try:
            async for item in stream:
                if sender.is_cancelled():
                    sender.send(flags=FINAL)
                    return
                if item.timings_ms:
                    self.cache_hits.increment(item.cache_hits)
                sender.send(epd_response(item), flags=FINAL if item.chunk.finished else 0)
        except Exception as exc:  # every failure reaches the client as one coded error
            pb_utils.Logger.log_warn(f"epd request {request_id} failed: {exc}")
            sender.send(error_response(exc), flags=FINAL)
        finally:
            await stream.aclose()
            self.active_leases.set(self.store.metrics()["active_leases"])

    def finalize(self):
        self.loop.stop()
        self.stages.close()
        self.store.close()

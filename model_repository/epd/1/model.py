"""`epd`: the main entry point (decoupled), same interface as `llm`.

hash media -> embedding store lookup -> choose a path -> disaggregated (encoders -> prefill ->
decode, over BLS) or colocated (epd's own vLLM engine). The steps: python_backends/epd/ (the
way one request goes, file by file: docs/architecture.md). This file only wires them.
"""

import functools
from contextlib import aclosing
from pathlib import Path

from python_backends import contract
from python_backends.engines.llm import LlmEngine, load_engine_args
from python_backends.epd.server import EpdServer
from python_backends.request.generation_defaults import defaults_for_model
from python_backends.triton_edge.bls import BlsStages
from python_backends.triton_edge.decoupled import DecoupledModel
from python_backends.triton_edge.metrics import CacheMetrics, PathMetrics


class TritonPythonModel(DecoupledModel):
    INPUTS = contract.EPD.input_names
    CLIENT_ABORT = True  # request_id + abort: stop a request in-band (docs/operations.md)

    def setup(self, args):
        params = self.params
        # The checkpoint's sampling defaults (generation_config parameter, as `vllm serve`): the
        # checkpoint is the one of the colocated engine's args, written whatever the path policy.
        engine_args = load_engine_args(Path(args["model_repository"]) / args["model_version"] / "engine_args.json")
        defaults = defaults_for_model(params, Path(engine_args["model"]))
        self.engine = BlsStages(params.string(contract.PREFILL_MODEL_KEY), params.string(contract.DECODE_MODEL_KEY))
        start_colocated = functools.partial(self.start_engine, args, LlmEngine)
        repository = Path(args["model_repository"]).parent
        self.epd = EpdServer.build(params, repository, self.engine, start_colocated, sampling_defaults=defaults)
        self.store, self.pipeline = self.epd.store, self.epd.pipeline
        hits = "Images served from the embedding store without encoding"
        self.cache_hits = self.metrics.counter("epd_cache_hits", hits)
        self.cache_metrics = CacheMetrics(self.metrics, self.store, node_gauges=True)
        self.path_metrics = PathMetrics(self.metrics, self.pipeline.paths)
        # The state gauges go out every second, not per request (metrics.py's cost rule).
        refresh_paths = functools.partial(self.path_metrics.refresh, self.pipeline.cost)
        self.loop.submit(self.cache_metrics.refresh_every(1.0, also=refresh_paths))
        if self.epd.remote is not None:
            self.loop.submit(self.epd.remote.run(self.metrics))

    def parse(self, inputs, request):
        return self.epd.parse(inputs, request.parameters())

    async def serve(self, parsed, request_id):
        request, parameters = parsed
        if parameters.streamed_decode:  # measurement only (EpdServer.parse allowed it)
            self.engine.stream_decode_in_this_request()
        if parameters.raw_forwarding:  # measurement only (EpdServer.parse allowed it)
            self.engine.forward_audio_in_this_request(request.audios)
        run = self.pipeline.run(
            request, request_id, parameters.encoder, parameters.tenant, parameters.path, self.path_metrics.record
        )
        async with aclosing(run) as chunks:
            async for chunk in chunks:
                if chunk.timings_ms:  # the last chunk
                    self.cache_hits.increment(chunk.cache_hits)
                    self.cache_metrics.count("hit", chunk.fast_hits)
                yield chunk

"""`epd`: the main entry point (decoupled), same interface as `llm`.

hash media (images and videos) -> embedding store lookup -> choose a path (request parameter `path`, else the
deployment's `path_policy`, adaptive by default) -> disaggregated (encode misses -> prefill ->
first token at once -> stream decode, over BLS) or colocated (epd's own vLLM engine, store hits
as embeddings). The steps live in python_backends.epd.pipeline and its path modules
(Triton-free, unit-tested with fakes), the BLS calls in python_backends.triton_edge.bls, the
request/error/cancel policy in python_backends.triton_edge.decoupled. This file only wires them.
"""

import functools
from contextlib import aclosing
from pathlib import Path

from python_backends import contract
from python_backends.engines.llm import LlmEngine
from python_backends.engines.videos import VideoInputLimits
from python_backends.epd.pipeline import EpdPipeline, pinned_encoder, requested_path
from python_backends.request.generate import check_image_headers, parse_generate_request, raw_videos, request_limits
from python_backends.request.tenants import request_parameters, request_tenant
from python_backends.scaleout.remote import with_remote_encoders
from python_backends.store import EmbeddingStore, KeyConfig
from python_backends.triton_edge.bls import BlsStages
from python_backends.triton_edge.decoupled import DecoupledModel
from python_backends.triton_edge.metrics import CacheMetrics, PathMetrics


class TritonPythonModel(DecoupledModel):
    INPUTS = contract.EPD.input_names
    colocated = None

    def setup(self, args):
        params = self.params
        self.videos = VideoInputLimits.from_params(params)  # None: no video (max_videos 0)
        max_videos = self.videos.limits.max_videos if self.videos else 0
        self.limits = request_limits(params, accept_mm_hash=True, max_videos=max_videos)
        self.store = EmbeddingStore(params.store_config())
        self.engine = BlsStages(params.string(contract.PREFILL_MODEL_KEY), params.string(contract.DECODE_MODEL_KEY))
        repository = Path(args["model_repository"]).parent
        keys = KeyConfig.from_files(
            Path(params.string(contract.PREPROCESSOR_CONFIG)),
            repository / params.string(contract.ENCODER_FILE),
            self.videos.sampling.loader_kwargs() if self.videos else None,
        )
        encoders = params.string(contract.ENCODER_MODELS_KEY).split(",")
        cache = params.cache_policy()
        policy = params.string(contract.PATH_POLICY)
        if policy != contract.DISAGGREGATED_PATH:  # the colocated path's engine, in this process
            self.colocated = self.start_engine(args, LlmEngine)
        # --role pd --remote-encoders: encodes go to encoder servers over gRPC.
        stages, self.remote = with_remote_encoders(params, self.store, keys, self.engine)
        self.pipeline = EpdPipeline(
            self.store, stages, keys, encoders, node_cache=cache.scope == "node", tenant_policy=cache.tenants,
            colocated=self.colocated, image_limits=self.limits.images, policy=policy,
        )
        hits = "Images served from the embedding store without encoding"
        self.cache_hits = self.metrics.counter("epd_cache_hits", hits)
        self.cache_metrics = CacheMetrics(self.metrics, self.store, node_gauges=True)
        self.path_metrics = PathMetrics(self.metrics, self.pipeline.paths)
        # The state gauges go out every second, not per request (metrics.py's cost rule).
        refresh_paths = functools.partial(self.path_metrics.refresh, self.pipeline.cost)
        self.loop.submit(self.cache_metrics.refresh_every(1.0, also=refresh_paths))
        if self.remote is not None:
            self.loop.submit(self.remote.run(self.metrics))

    def parse(self, inputs, request):
        parsed = parse_generate_request(inputs, self.limits)
        check_image_headers(parsed, self.limits)
        if self.videos is not None:  # raw bytes, as the encoders key them; their containers are checked there
            parsed = raw_videos(parsed, self.videos.limits)
        raw = request.parameters()
        return parsed, pinned_encoder(raw), request_tenant(request_parameters(raw)), requested_path(raw)

    async def serve(self, parsed, request_id):
        request, encoder, tenant, path = parsed
        run = self.pipeline.run(request, request_id, encoder, tenant, path, self.path_metrics.record)
        async with aclosing(run) as chunks:
            async for chunk in chunks:
                if chunk.timings_ms:  # the last chunk
                    self.cache_hits.increment(chunk.cache_hits)
                    self.cache_metrics.count("hit", chunk.fast_hits)
                yield chunk

"""What the ``epd`` model serves with, built once from its config parameters (Triton-free).

``model_repository/epd/1/model.py`` hands over the Triton-bound parts (the BLS stage client,
a way to start its colocated vLLM engine) and gets back an :class:`EpdServer`: it parses each
request (inputs and request parameters, once) and runs it through :class:`EpdPipeline`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from python_backends import contract
from python_backends.engines.videos import VideoInputLimits
from python_backends.epd.colocated import ColocatedEngine
from python_backends.epd.disaggregated import StageClient
from python_backends.epd.path_cost import PathCostModel
from python_backends.epd.pipeline import EpdPipeline
from python_backends.errors import invalid_arg
from python_backends.request.audios import AudioInput
from python_backends.request.generate import (
    GenerateRequest,
    RequestLimits,
    check_image_headers,
    parse_generate_request,
    raw_videos,
    request_limits,
)
from python_backends.request.parameters import RequestParameters
from python_backends.runtime.model_params import ModelParameters
from python_backends.scaleout.remote import RemoteEncoders, with_remote_encoders
from python_backends.store import EmbeddingStore


@dataclass
class EpdServer:
    pipeline: EpdPipeline
    store: EmbeddingStore
    limits: RequestLimits
    videos: VideoInputLimits | None  # None: no video (max_videos 0)
    audio: AudioInput | None  # None: no audio (an image checkpoint's epd)
    remote: RemoteEncoders | None  # a ``pd`` server's remote encoder servers
    colocated: ColocatedEngine | None  # the colocated path's engine, unless the policy is disaggregated
    # Requests may ask for the old streamed decode read (measurement only: contract.DECODE_READS).
    allow_streamed_decode: bool = False
    # Requests may send their clips on to prefill (measurement only: contract.FORWARD_MEDIA).
    allow_raw_forwarding: bool = False

    @classmethod
    def build(
        cls,
        params: ModelParameters,
        repository: Path,
        stages: StageClient,
        start_colocated: Callable[[], ColocatedEngine],
        sampling_defaults: Mapping[str, Any] | None = None,
    ) -> EpdServer:
        """``sampling_defaults``: the checkpoint's (request/generation_defaults.py)."""
        videos = VideoInputLimits.from_params(params)
        audio = AudioInput.from_params(params)  # an audio checkpoint's epd
        limits = request_limits(
            params, accept_mm_hash=True, max_videos=videos.limits.max_videos if videos else 0,
            max_audios=audio.max_audios if audio else 0, sampling_defaults=sampling_defaults,
        )  # fmt: skip
        store = EmbeddingStore(params.store_config())
        keys = params.key_config(repository, videos.sampling.loader_kwargs() if videos else None)
        cache = params.cache_policy()
        policy = params.string(contract.PATH_POLICY)
        colocated_encodes = params.string(contract.COLOCATED_ENCODES)
        if colocated_encodes not in contract.COLOCATED_ENCODERS:
            raise ValueError(f"{contract.COLOCATED_ENCODES} must be one of {contract.COLOCATED_ENCODERS}")
        colocated = start_colocated() if policy != contract.DISAGGREGATED_PATH else None
        stages, remote = with_remote_encoders(params, store, keys, stages)  # --remote-encoders: over gRPC
        pipeline = EpdPipeline(
            store, stages, keys, params.string(contract.ENCODER_MODELS_KEY).split(","),
            node_cache=cache.scope == "node", tenant_policy=cache.tenants, colocated=colocated,
            image_limits=limits.images, policy=policy, colocated_encodes=colocated_encodes,
            cost_model=PathCostModel(shared_compute=params.boolean(contract.SHARED_COMPUTE)),
        )  # fmt: skip
        allow_streamed_decode = os.environ.get(contract.ALLOW_STREAMED_DECODE_ENV) == "1"
        allow_raw_forwarding = os.environ.get(contract.ALLOW_RAW_FORWARDING_ENV) == "1"
        return cls(
            pipeline, store, limits, videos, audio, remote, colocated, allow_streamed_decode, allow_raw_forwarding
        )

    def parse(self, inputs: Mapping[str, Any], raw_parameters: str | None) -> tuple[GenerateRequest, RequestParameters]:
        """A request's inputs and Triton parameters, checked (an ``EpdError`` is the client's)."""
        request = parse_generate_request(inputs, self.limits)
        check_image_headers(request, self.limits)
        if self.videos is not None:  # raw bytes, as the encoders key them; their containers are checked there
            request = raw_videos(request, self.videos.limits)
        if self.audio is not None:  # raw bytes too; the encoders decode and check them
            request = replace(request, audios=self.audio.raw(request.audios))
        parameters = RequestParameters.parse(raw_parameters)
        if parameters.streamed_decode and not self.allow_streamed_decode:
            raise invalid_arg(
                f"request parameter '{contract.DECODE_READS_REQUEST_PARAMETER}' = 'stream' reads decode as a "
                "stream, which deadlocks Triton 2.51's python backend under load; a server allows it only "
                f"to measure what the polls cost, started with {contract.ALLOW_STREAMED_DECODE_ENV}=1"
            )
        if parameters.raw_forwarding and not (self.allow_raw_forwarding and self.audio is not None):
            raise invalid_arg(
                f"request parameter '{contract.FORWARD_MEDIA_REQUEST_PARAMETER}' = 'raw' sends audio clips on to "
                "prefill, the baseline of an experiment: an audio checkpoint's server allows it only when started "
                f"with {contract.ALLOW_RAW_FORWARDING_ENV}=1"
            )
        if parameters.raw_forwarding and parameters.path != contract.DISAGGREGATED_PATH:
            raise invalid_arg(
                f"request parameter '{contract.FORWARD_MEDIA_REQUEST_PARAMETER}' = 'raw' forwards to prefill: "
                f"send it with '{contract.PATH_REQUEST_PARAMETER}' = '{contract.DISAGGREGATED_PATH}'"
            )
        return request, parameters

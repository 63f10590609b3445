"""What an ``encoder_<i>`` model serves with, built once from its config parameters (Triton-free).

``model_repository/encoder_0/1/model.py`` (copied by builders/ to every ``encoder_<i>``) hands
over the BLS client of the ``encode`` ensemble and gets back an :class:`EncoderServer`: it
parses each request (media, ``lease_owner``, request parameters, once) and answers references,
plus the stored embedding and its digest when the request asks ``by_value`` (a PD server on
another node: it verifies what crossed the network, ``encode/digest.py``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from python_backends import contract
from python_backends.encode.audios import AudioEncode
from python_backends.encode.cached import (
    CachedEncoder,
    EncoderAnswer,
    cache_namespace,
    parse_encoder_audios,
    parse_encoder_inputs,
    parse_encoder_videos,
    parse_lease_owner,
)
from python_backends.encode.digest import by_value_answer
from python_backends.encode.videos import VideoEncode
from python_backends.engines.videos import VideoInputLimits
from python_backends.errors import invalid_arg
from python_backends.preprocess.audio import DaliAudioFeatures
from python_backends.preprocess.audio_pipeline import AudioFeatureConfig
from python_backends.preprocess.video_pipeline import VideoTransformConfig
from python_backends.preprocess.videos import DaliVideoPreprocessor
from python_backends.request.audios import AudioInput
from python_backends.request.parameters import RequestParameters
from python_backends.runtime.model_params import ModelParameters
from python_backends.store import EmbeddingStore


@dataclass(frozen=True)
class EncoderRequest:
    items: list[bytes]  # encoded images, videos or audio files
    modality: str  # contract.IMAGE, VIDEO or AUDIO (modalities are named as their inputs)
    lease_owner: int | None
    parameters: RequestParameters


@dataclass
class EncoderServer:
    encoder: CachedEncoder
    store: EmbeddingStore
    max_images: int
    max_image_bytes: int
    videos: VideoInputLimits | None  # None: no video (max_videos 0)
    audio: AudioInput | None = None  # an audio checkpoint's encoder: audio only

    @classmethod
    def build(cls, params: ModelParameters, repository: Path, model_name: str, stages: Any) -> EncoderServer:
        """``stages``: the BLS client of the ``encode`` ensemble (``triton_edge.bls.BlsEncode``): a
        call encodes one image, ``encode_many`` (None where ``encode`` takes one image) several
        in one request; ``encode_pixels`` runs a video's pixels through ``vit_encoder``,
        ``encode_audio_features`` a clip's features through ``audio_encoder``."""
        store = EmbeddingStore(params.store_config())
        audio = AudioInput.from_params(params)  # an audio checkpoint's encoder takes audio only
        videos = None if audio else VideoInputLimits.from_params(params)
        keys = params.key_config(repository, videos.sampling.loader_kwargs() if videos else None)
        policy = params.cache_policy()
        encoder = CachedEncoder(
            store, keys, _no_images if audio else stages, namespace=cache_namespace(policy.scope, model_name),
            tenant_policy=policy.tenants, encode_video=_video_encode(params, repository, videos, stages),
            encode_audio=_audio_encode(params, repository, audio, stages),
            encode_many=None if audio else getattr(stages, "encode_many", None),
        )  # fmt: skip
        if audio is not None:
            return cls(encoder, store, 0, 0, None, audio)
        limits = params.integer(contract.MAX_IMAGES_PER_REQUEST), params.integer(contract.MAX_IMAGE_BYTES)
        return cls(encoder, store, *limits, videos)

    def parse(self, inputs: Mapping[str, np.ndarray], raw_parameters: str | None) -> EncoderRequest:
        """A request's media and parameters, checked (an ``EpdError`` is the client's)."""
        parameters = RequestParameters.parse(raw_parameters)
        if self.audio is not None:
            items = parse_encoder_audios(inputs, self.audio.max_audios)
            if parameters.by_value:
                raise invalid_arg(f"'{contract.BY_VALUE}' takes one image; this encoder takes audio")
            return EncoderRequest(items, contract.AUDIO, parse_lease_owner(inputs), parameters)
        videos = parse_encoder_videos(inputs, self.videos.limits if self.videos else None)
        if videos is None:
            items, lease_owner = parse_encoder_inputs(inputs, self.max_images, self.max_image_bytes)
        else:
            items, lease_owner = videos, parse_lease_owner(inputs)
        if parameters.by_value and (len(items) != 1 or lease_owner is not None or videos is not None):
            raise invalid_arg(f"'{contract.BY_VALUE}' takes one image and no lease_owner")
        return EncoderRequest(items, contract.IMAGE if videos is None else contract.VIDEO, lease_owner, parameters)

    async def serve(self, request: EncoderRequest) -> tuple[list[EncoderAnswer], Any]:
        """The references of every item, and (``by_value``) the stored embedding, grid and digest."""
        by_value = request.parameters.by_value
        owner = os.getpid() if by_value else request.lease_owner  # by value: released once read here
        answers = await self.encoder.references(request.items, owner, request.parameters.tenant, request.modality)
        return answers, by_value_answer(self.store, answers[0].reference) if by_value else None


def _video_encode(
    params: ModelParameters, repository: Path, videos: VideoInputLimits | None, stages: Any
) -> VideoEncode | None:
    """The video preprocessing (the repository's ``video.dali``) + ``vit_encoder``, if the model takes video."""
    if videos is None:
        return None
    pipeline = DaliVideoPreprocessor.from_file(
        repository / contract.PREPROCESS_MODEL / "1" / contract.VIDEO_DALI_FILE,
        VideoTransformConfig.from_file(Path(params.string(contract.PREPROCESSOR_CONFIG)).parent),
        sampling=videos.sampling,
        limits=videos.limits,
        max_batch_size=1,
        num_threads=params.integer(contract.DALI_NUM_THREADS),
    )
    return VideoEncode(pipeline, stages.encode_pixels)


def _audio_encode(
    params: ModelParameters, repository: Path, audio: AudioInput | None, stages: Any
) -> AudioEncode | None:
    """FFmpeg + the DALI features pipeline (``audio.dali``) + ``audio_encoder``, if the model takes audio."""
    if audio is None:
        return None
    config_file = Path(params.string(contract.PREPROCESSOR_CONFIG))
    features = DaliAudioFeatures.from_file(
        repository / contract.AUDIO_ENCODER_MODEL / "1" / contract.AUDIO_DALI_FILE,
        AudioFeatureConfig.from_dict(json.loads(config_file.read_text())),
        max_batch_size=1,
        num_threads=params.integer(contract.DALI_NUM_THREADS),
    )
    return AudioEncode(audio, features, stages.encode_audio_features)


async def _no_images(image: bytes) -> Any:
    """An audio checkpoint's encoder has no vision tower (its ``image`` input is not declared)."""
    raise invalid_arg("this encoder takes audio, not images")

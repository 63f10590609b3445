"""Audio features in DALI (issue 34): Whisper's log-mel of the samples that
:func:`python_backends.request.audios.decode_audio` decoded with FFmpeg.

Why FFmpeg (PyAV) decodes and not DALI's decoder (docs/benchmarks/audio-parity.md): DALI 2.4's
libsndfile refuses MP3 and returns 7,296 of 56,064 samples of an Ogg Vorbis file FFmpeg wrote,
while FFmpeg reads every container and codec it bundles.

Plain Python: no Triton import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from python_backends.preprocess.audio_pipeline import (
    DEFAULT_AUDIO_BATCH_SIZE,
    SAMPLES_INPUT,
    AudioFeatureConfig,
    feature_length,
    serialize_audio_pipeline,
)
from python_backends.preprocess.image_pipeline import DEFAULT_NUM_THREADS
from python_backends.preprocess.runner import DaliCpuRunner


@dataclass(frozen=True)
class AudioFeatures:
    """One clip's Whisper features (``[mel bins, frames]``, padded to the window) and the frames
    its audio fills (the length the encoder masks by)."""

    features: np.ndarray
    length: int


class DaliAudioFeatures(DaliCpuRunner):
    """The features pipeline (from samples) on the CPU, in batches of at most ``max_batch_size``:
    a serialized one (``audio.dali``, :meth:`from_file`) or one serialized for ``config``
    (:meth:`of_config`)."""

    def __init__(
        self,
        serialized_pipeline: bytes,
        config: AudioFeatureConfig,
        max_batch_size: int = DEFAULT_AUDIO_BATCH_SIZE,
        num_threads: int = DEFAULT_NUM_THREADS,
    ) -> None:
        self.config = config
        super().__init__(serialized_pipeline, max_batch_size, num_threads)

    @classmethod
    def of_config(
        cls, config: AudioFeatureConfig, max_batch_size: int = DEFAULT_AUDIO_BATCH_SIZE,
        num_threads: int = DEFAULT_NUM_THREADS,
    ) -> DaliAudioFeatures:
        pipeline = serialize_audio_pipeline(config, max_batch_size, num_threads, decode=False)
        return cls(pipeline, config, max_batch_size, num_threads)

    def features(self, clips: Sequence[np.ndarray]) -> list[AudioFeatures]:
        out: list[AudioFeatures] = []
        for _, chunk in self._chunks(clips):
            features, samples = self._run_feeds({SAMPLES_INPUT: [np.ascontiguousarray(c, np.float32) for c in chunk]})
            out += [
                AudioFeatures(np.array(features[i]), feature_length(int(np.array(samples[i])[0]), self.config))
                for i in range(len(chunk))
            ]
        return out

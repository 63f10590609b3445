"""What the ``cpu`` target's DALI runners share: a serialized pipeline deserialized with
``device_id=None`` and run one batch at a time (:class:`DaliCpuRunner`).

Used by :class:`python_backends.preprocess.images.DaliImagePreprocessor` (images) and
:class:`python_backends.preprocess.videos.DaliVideoPreprocessor` (videos). Plain Python: no
Triton import. Not thread-safe (a DALI pipeline runs one batch at a time).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from nvidia.dali.pipeline import Pipeline

Runner = TypeVar("Runner", bound="DaliCpuRunner")


class DaliCpuRunner:
    """One deserialized pipeline, at most ``max_batch_size`` samples a run."""

    def __init__(self, serialized_pipeline: bytes, max_batch_size: int, num_threads: int) -> None:
        if max_batch_size <= 0 or num_threads <= 0:
            raise ValueError("max_batch_size and num_threads must be positive")
        self._serialized = serialized_pipeline
        self._max_batch_size = max_batch_size
        self._num_threads = num_threads
        self._pipeline = self._build()

    @classmethod
    def from_file(cls: type[Runner], path: str | Path, *args: Any, **kwargs: Any) -> Runner:
        """The runner of a serialized pipeline file (``model.dali``, ``video.dali``); the other
        arguments are the subclass's constructor's."""
        return cls(Path(path).read_bytes(), *args, **kwargs)

    def _build(self) -> Pipeline:
        # Depth 1: feed_input then run, one batch at a time (deeper prefetch fails, docs/facts.md).
        pipeline = Pipeline.deserialize(
            serialized_pipeline=self._serialized,
            batch_size=self._max_batch_size,
            num_threads=self._num_threads,
            device_id=None,
            prefetch_queue_depth=1,
        )
        pipeline.build()
        return pipeline

    def _rebuild(self) -> None:
        """A fresh pipeline after a failed run (DALI's state after an error is not reused)."""
        self._pipeline = self._build()

    def _chunks(self, items: Sequence[Any]) -> list[tuple[int, Sequence[Any]]]:
        """``items`` in runs of at most ``max_batch_size``, with each run's first index."""
        step = self._max_batch_size
        return [(start, items[start : start + step]) for start in range(0, len(items), step)]

    def _run_feeds(self, feeds: Mapping[str, list[np.ndarray]]) -> tuple[Any, ...]:
        """Feed every external source, run once; the pipeline's outputs (DALI TensorLists,
        valid until the next run)."""
        for name, samples in feeds.items():
            self._pipeline.feed_input(name, samples)
        return tuple(self._pipeline.run())

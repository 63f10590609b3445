"""Request-level logic of the ``vit_encoder`` python model (the ``cpu`` target).

``vit_encoder`` is not batched: each request carries one request's images (or one video) as
``pixel_values`` float32 ``[rows, width]`` (every image's rows concatenated in grid order;
``C*P*P`` folded image rows, as ``preprocess`` sends them, or a video's ``C*T*P*P``) and
``image_grid_thw`` int64 ``[n, 3]``; :class:`EncoderStage` runs every image through the
encoder (one call each, side by side) and answers ``image_embeds`` float32
``[1, sum(tokens), hidden]``, every image's tokens concatenated in order (``[1, 0, hidden]`` for
no image), the shape ``llm`` takes. Given several requests (one ``execute``), all their images run
together and a bad request fails alone. Plain Python: no Triton import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from python_backends import contract
from python_backends.encode.vit_onnx import EncoderCall, VisionShape, encoder_calls
from python_backends.errors import EpdError, invalid_arg
from python_backends.preprocess.stage import Result, filled
from python_backends.runtime.model_params import ModelParameters


class VisionEncoder(Protocol):
    """What :class:`EncoderStage` needs (``python_backends.encode.vit_onnx.OnnxVisionEncoder``)."""

    @property
    def shape(self) -> VisionShape: ...
    @property
    def merge_size(self) -> int: ...
    @property
    def patch_dim(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...

    def run_all(self, calls: Sequence[EncoderCall]) -> list[np.ndarray]: ...


def open_vision_encoder(onnx_path: Path, precision: str, threads: int) -> VisionEncoder:
    """The runner of ``precision`` (``contract.VIT_PRECISIONS``) on the exported graph: fp32 on
    ONNX Runtime, the reference; bf16 on OpenVINO, where the CPU has bfloat16 dot products."""
    if precision == "fp32":
        from python_backends.encode.vit_onnx import OnnxVisionEncoder

        return OnnxVisionEncoder(onnx_path, threads=threads)
    if precision == "bf16":
        from python_backends.encode.vit_openvino import OpenVinoVisionEncoder

        return OpenVinoVisionEncoder(onnx_path, threads=threads, precision="bf16")
    raise ValueError(f"vit precision {precision!r}: use one of {', '.join(contract.VIT_PRECISIONS)}")


class EncoderStage:
    """All images of a list of requests through the vision encoder; embeddings per request."""

    def __init__(self, encoder: VisionEncoder) -> None:
        self._encoder = encoder

    def run(self, requests: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[Result[np.ndarray]]:
        """``requests``: (pixel_values ``[rows, width]``, image_grid_thw ``[n, 3]``) each;
        returns ``image_embeds`` ``[1, sum(tokens), hidden]`` or the request's error."""
        results: list[Result[np.ndarray] | None] = [None] * len(requests)
        checked: list[tuple[int, list[EncoderCall]]] = []
        for slot, (pixels, grid) in enumerate(requests):
            try:
                checked.append((slot, self._calls(pixels, grid)))
            except EpdError as exc:
                results[slot] = exc
        calls = [call for _, request_calls in checked for call in request_calls]
        per_image = iter(self._encoder.run_all(calls) if calls else [])
        for slot, request_calls in checked:
            embeds = [next(per_image) for _ in request_calls]
            joined = np.concatenate(embeds) if embeds else np.zeros((0, self._encoder.hidden_size), np.float32)
            results[slot] = joined[None]
        return filled(results)

    def _calls(self, pixel_values: np.ndarray, image_grid_thw: np.ndarray) -> list[EncoderCall]:
        """One encoder call per image of a request, after checking pixels and grid agree."""
        grid = np.asarray(image_grid_thw, dtype=np.int64)
        if pixel_values.ndim != 2 or grid.ndim != 2 or grid.shape[1] != 3:
            raise invalid_arg(
                f"pixel_values {list(pixel_values.shape)} and image_grid_thw {list(grid.shape)} must be "
                "[rows, width] and [images, 3]"
            )
        if len(grid) == 0:  # no image
            if len(pixel_values):
                raise invalid_arg(f"pixel_values has {len(pixel_values)} rows, image_grid_thw has no image")
            return []
        return encoder_calls(pixel_values, grid, self._encoder.shape)


@dataclass(frozen=True)
class EncoderProvenance:
    """Where the served encoder's weights came from, as ``builders/repository.py`` recorded it
    in the ``vit_encoder`` config (read at load; shown in the log and as metrics)."""

    vision_shards: int
    checkpoint_shards: int
    vision_weight_bytes: int
    checkpoint_weight_bytes: int

    @classmethod
    def from_parameters(cls, params: ModelParameters) -> EncoderProvenance:
        values = {name: params.integer(name, -1, minimum=0) for name in cls.__dataclass_fields__}
        missing = [name for name, value in values.items() if value < 0]
        if missing:
            raise ValueError(
                f"model '{params.model_name}': parameters {missing} are missing; regenerate the "
                "repository with `python -m builders.repository`"
            )
        return cls(**values)

    def check(self, encoder: VisionEncoder, params: ModelParameters) -> None:
        """The ONNX file must be the one the config was generated for."""
        for name in ("patch_dim", "hidden_size", "merge_size"):
            expected = params.integer(name, -1)
            actual = getattr(encoder, name)
            if expected != actual:
                raise ValueError(
                    f"model '{params.model_name}': the ONNX file has {name}={actual}, the config says "
                    f"{expected}; regenerate the repository with `python -m builders.repository`"
                )

    def describe(self, model_file: str, megabytes: float, seconds: float) -> str:
        return (
            f"vit_encoder: loaded {model_file} ({megabytes:.1f} MB) in {seconds:.2f} s; its weights are the "
            f"vision tower + merger only ({self.vision_weight_bytes} of {self.checkpoint_weight_bytes} "
            f"checkpoint weight bytes), exported from {self.vision_shards} of {self.checkpoint_shards} "
            "checkpoint shard files; the language-model shards were never read"
        )

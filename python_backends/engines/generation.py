"""The one chunk type of generated text, shared by ``llm``, ``prefill``, ``decode`` and ``epd``.

Triton-free. An engine yields :class:`GenerationChunk`s; the Triton edge turns one into
response tensors (``python_backends.triton.responses.chunk_response``) and reads one back
from a BLS response's outputs (:func:`chunk_from_outputs`). ``prefill`` adds the KV
``transfer_params``; ``epd`` adds what it measured on its last chunk.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from python_backends import contract


@dataclass
class GenerationChunk:
    text: str  # new text since the previous chunk (all of it when not streaming)
    token_ids: list[int]  # new token ids since the previous chunk
    num_input_tokens: int = 0
    num_output_tokens: int = 0  # total so far
    finish_reason: str | None = None
    finished: bool = False
    transfer_params: str = ""  # prefill -> decode: the KV hand-off; "" when nothing is left to decode
    num_cached_tokens: int = 0  # decode: prompt tokens loaded from the KV transfer, not computed (not sent)
    timings_ms: dict[str, float] = field(default_factory=dict)  # epd: per-stage times, on its last chunk
    cache_hits: int = 0  # epd: images served from the store, by epd itself or by an encoder
    fast_hits: int = 0  # epd: of those, found by its own lookup (no encoder call; metrics only, not sent)
    serving_path: str = ""  # epd: the path that served the request, on its last chunk


def text_of(array: np.ndarray | None) -> str:
    """The UTF-8 text of a BYTES output ("" when absent or empty)."""
    if array is None or array.size == 0:
        return ""
    return "".join(x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in array.reshape(-1))


def int_of(array: np.ndarray | None, default: int = 0) -> int:
    return default if array is None or array.size == 0 else int(array.reshape(-1)[0])


def chunk_from_outputs(outputs: Mapping[str, Any]) -> GenerationChunk:
    """A chunk read back from a stage's response outputs (name -> numpy array), as ``epd`` gets
    them over BLS: the inverse of ``chunk_response`` for the outputs the stage declares."""
    reason = text_of(outputs.get(contract.FINISH_REASON)) or None
    token_ids = outputs.get(contract.OUTPUT_TOKEN_IDS)
    return GenerationChunk(
        text=text_of(outputs.get(contract.TEXT_OUTPUT)),
        token_ids=[] if token_ids is None else [int(t) for t in token_ids.reshape(-1)],
        num_input_tokens=int_of(outputs.get(contract.NUM_INPUT_TOKENS)),
        num_output_tokens=int_of(outputs.get(contract.NUM_OUTPUT_TOKENS)),
        finish_reason=reason,
        finished=reason is not None,
        transfer_params=text_of(outputs.get(contract.TRANSFER_PARAMS)),
    )


def ms_since(start: float) -> float:
    """Milliseconds since ``start`` (``time.perf_counter()``), as the stage timings count them."""
    return (time.perf_counter() - start) * 1000.0

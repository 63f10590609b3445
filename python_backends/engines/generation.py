"""The one chunk type of generated text, shared by ``llm``, ``prefill``, ``decode`` and ``epd``.

Triton-free. An engine yields :class:`GenerationChunk`s; the Triton edge turns one into
response tensors (``python_backends.triton.responses.chunk_response``) and reads one back
from a BLS response's outputs (:func:`chunk_from_outputs`). ``prefill`` adds the KV
``transfer_params``; ``epd`` adds what it measured on its last chunk.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from python_backends import contract

# One position's logprobs on the wire (vllm_backend's layout): token id (text) -> logprob, rank, text.
PositionLogprobs = dict[str, dict[str, Any]]
# vLLM's OpenAI server clamps a logprob of -inf (a token the grammar or a bias forbids) to this.
MIN_LOGPROB = -9999.0


@dataclass
class GenerationChunk:
    """New output of one of a request's ``n`` sequences (``index``). ``finished`` marks the request's
    last chunk (every sequence done); ``finish_reason`` is set on the chunk that ends its sequence."""

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
    index: int = 0  # which of the request's n sequences
    logprobs: list[PositionLogprobs] | None = None  # one per token of token_ids, when asked
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # on a request's first chunk, when asked


def wire_logprobs(positions: Iterable[Mapping[int, Any] | None] | None) -> list[Any] | None:
    """vLLM's logprobs (per position: token id -> ``Logprob``; None for a prompt's first) as the
    ``logprobs`` / ``prompt_logprobs`` outputs carry them; None when the request asked none."""
    if positions is None:
        return None
    return [
        None
        if position is None
        else {
            str(token_id): {
                "logprob": max(float(entry.logprob), MIN_LOGPROB),
                "rank": entry.rank,
                "decoded_token": entry.decoded_token,
            }
            for token_id, entry in position.items()
        }
        for position in positions
    ]


def json_of(array: np.ndarray | None) -> Any:
    """A BYTES output holding JSON, parsed (None when absent)."""
    text = text_of(array)
    return json.loads(text) if text else None


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
        index=int_of(outputs.get(contract.OUTPUT_INDEX)),
        logprobs=json_of(outputs.get(contract.LOGPROBS)),
        prompt_logprobs=json_of(outputs.get(contract.PROMPT_LOGPROBS)),
    )


def ms_since(start: float) -> float:
    """Milliseconds since ``start`` (``time.perf_counter()``), as the stage timings count them."""
    return (time.perf_counter() - start) * 1000.0

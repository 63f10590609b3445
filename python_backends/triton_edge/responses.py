"""Request inputs, response tensors and errors on Triton's wire.

A stage that ``epd`` calls over BLS answers an error in its ``error`` output (JSON code +
message) instead of as a Triton error: Triton 2.51's python backend sometimes drops a
decoupled model's error response (sent with the final flag) on its way to a BLS caller, which
then sees the stream end with no answer. The BLS caller asks for that by sending
``errors_as_outputs``; a client calling a stage directly gets an ordinary coded Triton error.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends import contract
from python_backends.engines.generation import GenerationChunk
from python_backends.errors import EpdError, ErrorCode

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def read_inputs(request: pb_utils.InferenceRequest, names: Iterable[str]) -> dict[str, np.ndarray]:
    inputs: dict[str, np.ndarray] = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            inputs[name] = tensor.as_numpy()
    return inputs


def bytes_tensor(name: str, values: Sequence[bytes | str]) -> pb_utils.Tensor:
    """A BYTES tensor of ``values`` (text is sent as UTF-8)."""
    items = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in values]
    return pb_utils.Tensor(name, np.array(items, dtype=np.object_))


def tensor(name: str, values: Sequence[object] | np.ndarray, dtype: type | np.dtype) -> pb_utils.Tensor:
    return pb_utils.Tensor(name, np.ascontiguousarray(np.asarray(values, dtype=dtype)))


def response(tensors: Sequence[pb_utils.Tensor]) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(output_tensors=list(tensors))


def _error_fields(exc: BaseException) -> tuple[ErrorCode, str]:
    """Our errors keep their code and message; anything else is INTERNAL, no details."""
    if isinstance(exc, EpdError):
        return exc.code, exc.message
    return ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}"


def triton_error(exc: BaseException) -> pb_utils.TritonError:
    code, message = _error_fields(exc)
    return pb_utils.TritonError(message, getattr(pb_utils.TritonError, code.value))


def error_response(exc: BaseException) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(output_tensors=[], error=triton_error(exc))


def wants_error_output(request: pb_utils.InferenceRequest) -> bool:
    """Whether the caller is ``epd`` (or an encoder) over BLS: errors go in the ``error`` output."""
    flag = pb_utils.get_input_tensor_by_name(request, contract.ERRORS_AS_OUTPUTS)
    return flag is not None and bool(flag.as_numpy().reshape(-1)[0])


def stage_error_response(exc: BaseException, as_output: bool) -> pb_utils.InferenceResponse:
    """One coded error: in the ``error`` output for a BLS caller, a Triton error for a client."""
    if not as_output:
        return error_response(exc)
    code, message = _error_fields(exc)
    payload = json.dumps({"code": code.value, "message": message})
    return pb_utils.InferenceResponse(output_tensors=[bytes_tensor(contract.ERROR, [payload])])


def error_from_output(payload: str) -> EpdError:
    """The inverse of :func:`stage_error_response` with ``as_output``, on the BLS caller's side."""
    fields = json.loads(payload)
    return EpdError(str(fields["message"]), ErrorCode(fields["code"]))


def chunk_tensors(chunk: GenerationChunk, declared: Collection[str] | None = None) -> list[pb_utils.Tensor]:
    """A chunk's outputs, limited to those the model ``declared`` in its config (all when None):
    prefill declares ``transfer_params``, ``epd`` its ``timing_<stage>_ms`` and ``cache_hits``."""
    tensors = [
        bytes_tensor(contract.TEXT_OUTPUT, [chunk.text]),
        tensor(contract.OUTPUT_TOKEN_IDS, chunk.token_ids, np.int64),
        tensor(contract.NUM_INPUT_TOKENS, [chunk.num_input_tokens], np.uint32),
        tensor(contract.NUM_OUTPUT_TOKENS, [chunk.num_output_tokens], np.uint32),
        bytes_tensor(contract.FINISH_REASON, [chunk.finish_reason or ""]),
        tensor(contract.OUTPUT_INDEX, [chunk.index], np.uint32),
        # JSON null when not asked (or, for the prompt's, after the first response): every response
        # carries every output, or an ensemble that maps them holds its responses back for good.
        bytes_tensor(contract.LOGPROBS, [json.dumps(chunk.logprobs)]),
        bytes_tensor(contract.PROMPT_LOGPROBS, [json.dumps(chunk.prompt_logprobs)]),
    ]
    if chunk.transfer_params or declared is not None:
        tensors.append(bytes_tensor(contract.TRANSFER_PARAMS, [chunk.transfer_params]))
    if chunk.timings_ms:
        tensors += [tensor(contract.timing_output(stage), [ms], np.float32) for stage, ms in chunk.timings_ms.items()]
        tensors.append(tensor(contract.CACHE_HITS, [chunk.cache_hits], np.uint32))
    if chunk.serving_path:
        tensors.append(bytes_tensor(contract.SERVING_PATH, [chunk.serving_path]))
    return [t for t in tensors if declared is None or t.name() in declared]


def chunk_response(chunk: GenerationChunk, declared: Collection[str] | None = None) -> pb_utils.InferenceResponse:
    return response(chunk_tensors(chunk, declared))


def polled_response(chunk: GenerationChunk, offset: int, declared: Collection[str]) -> pb_utils.InferenceResponse:
    """One poll's answer from ``decode`` (``pd/polling.py``): the merged chunk and the next offset."""
    return response([*chunk_tensors(chunk, declared), tensor(contract.POLL_OFFSET, [offset], np.int64)])


def encoder_response(answers: Sequence[Any], by_value: tuple[np.ndarray, np.ndarray, str] | None) -> Any:
    """An ``encoder_<i>`` model's one response: references, mm_hashes, hits (and, ``by_value``,
    the embedding, its grid and digest). ``answers``: ``encode.cached.EncoderAnswer``."""
    tensors = [
        bytes_tensor(contract.REFERENCES, [a.reference.to_bytes() for a in answers]),
        bytes_tensor(contract.MM_HASH, [a.client_mm_hash for a in answers]),
        tensor(contract.CACHE_HIT, [a.cache_hit for a in answers], bool),
    ]
    if by_value is not None:
        embeds, grid, digest = by_value
        tensors += [
            tensor(contract.IMAGE_EMBEDS, embeds, np.float32),
            tensor(contract.IMAGE_GRID_THW, grid, np.int64),
            bytes_tensor(contract.EMBEDDING_DIGEST, [digest]),
        ]
    return response(tensors)

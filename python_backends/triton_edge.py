"""The thin edge between Triton's python backend and our plain modules.

The only module under ``python_backends`` that imports ``triton_python_backend_utils``
(it exists only inside the stub process; unit tests use the stub in tests/conftest.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.errors import EpdError, ErrorCode
from python_backends.llm_engine import GenerationChunk

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def read_inputs(request: "pb_utils.InferenceRequest", names: Iterable[str]) -> dict[str, np.ndarray]:
    inputs: dict[str, np.ndarray] = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            inputs[name] = tensor.as_numpy()
    return inputs


def triton_error(exc: BaseException) -> "pb_utils.TritonError":
    """Our errors keep their code and message; anything else is INTERNAL, no traceback."""
    if isinstance(exc, EpdError):
        return pb_utils.TritonError(exc.message, getattr(pb_utils.TritonError, exc.code.value))
    return pb_utils.TritonError(
        f"internal error: {type(exc).__name__}", getattr(pb_utils.TritonError, ErrorCode.INTERNAL.value)
    )


def error_response(exc: BaseException) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(output_tensors=[], error=triton_error(exc))


def chunk_response(chunk: GenerationChunk) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor("text_output", np.array([chunk.text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("output_token_ids", np.array(chunk.token_ids, dtype=np.int64)),
            pb_utils.Tensor("num_input_tokens", np.array([chunk.num_input_tokens], dtype=np.uint32)),
            pb_utils.Tensor("num_output_tokens", np.array([chunk.num_output_tokens], dtype=np.uint32)),
            pb_utils.Tensor(
                "finish_reason",
                np.array([(chunk.finish_reason or "").encode("utf-8")], dtype=np.object_),
            ),
        ]
    )

"""The one shared stub of ``triton_python_backend_utils`` for unit tests.

Only ``python_backends/triton_edge.py`` imports it; the stub records what the edge
builds so tests can check names, dtypes and error codes without a server.
"""

from __future__ import annotations

import sys
import types

import numpy as np


class _TritonError(Exception):
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class _Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name = name
        self._array = array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class _InferenceResponse:
    def __init__(self, output_tensors: list[_Tensor], error: _TritonError | None = None) -> None:
        self.output_tensors = output_tensors
        self.error = error

    def outputs(self) -> dict[str, np.ndarray]:
        return {t.name(): t.as_numpy() for t in self.output_tensors}


class FakeRequest:
    def __init__(self, **inputs: np.ndarray) -> None:
        self.inputs = {name: _Tensor(name, array) for name, array in inputs.items()}


class _MetricFamily:
    GAUGE, COUNTER = 0, 1
    created: list[str] = []

    def __init__(self, name: str, description: str, kind: int) -> None:
        _MetricFamily.created.append(name)
        self.name, self.kind = name, kind

    def Metric(self, labels: dict[str, str]) -> tuple["_MetricFamily", dict[str, str]]:  # noqa: N802 - Triton's name
        return (self, labels)


def _get_input_tensor_by_name(request: FakeRequest, name: str) -> _Tensor | None:
    return request.inputs.get(name)


stub = types.ModuleType("triton_python_backend_utils")
stub.TritonError = _TritonError
stub.Tensor = _Tensor
stub.InferenceResponse = _InferenceResponse
stub.get_input_tensor_by_name = _get_input_tensor_by_name
stub.MetricFamily = _MetricFamily
stub.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
sys.modules.setdefault("triton_python_backend_utils", stub)

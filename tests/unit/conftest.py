"""The one shared stub of ``triton_python_backend_utils`` for unit tests, and the fixtures
several unit test modules share.

Only the modules of ``python_backends/triton_edge/`` import the stub; it records what the
edge builds so tests can check names, dtypes, error codes and metric lifetimes without a server.
"""

from __future__ import annotations

import gc
import sys
import types
from pathlib import Path

import numpy as np
import pytest


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


class _Metric:
    alive = 0  # metrics not yet destroyed, over all families

    def __init__(self, family: _MetricFamily, labels: dict[str, str]) -> None:
        self.family, self.labels, self.value = family, labels, 0.0
        _Metric.alive += 1

    def set(self, value: float) -> None:
        self.value = value

    def increment(self, value: float) -> None:
        self.value += value

    def __del__(self) -> None:
        _Metric.alive -= 1


class _MetricFamily:
    GAUGE, COUNTER = 0, 1
    created: list[str] = []
    alive = 0  # families not yet destroyed

    def __init__(self, name: str, description: str, kind: int) -> None:
        _MetricFamily.created.append(name)
        self.name, self.kind = name, kind
        _MetricFamily.alive += 1

    def __del__(self) -> None:
        _MetricFamily.alive -= 1

    def Metric(self, labels: dict[str, str]) -> _Metric:  # Triton's name
        return _Metric(self, labels)


class _Logger:
    messages: list[str] = []

    @staticmethod
    def log_warn(message: str) -> None:
        _Logger.messages.append(message)

    log_error = log_info = log_verbose = log_warn


def _get_input_tensor_by_name(request: FakeRequest, name: str) -> _Tensor | None:
    return request.inputs.get(name)


stub = types.ModuleType("triton_python_backend_utils")
stub.TritonError = _TritonError
stub.Tensor = _Tensor
stub.InferenceResponse = _InferenceResponse
stub.get_input_tensor_by_name = _get_input_tensor_by_name
stub.MetricFamily = _MetricFamily
stub.Logger = _Logger
stub.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
sys.modules.setdefault("triton_python_backend_utils", stub)


# Fixtures of the tests that build: imports inside, so that a run of other tests does not pay them.


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """The tiny default checkpoint (built once, then reused)."""
    from builders.default_model import build_default_model

    return build_default_model()


@pytest.fixture
def fast_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """``write_repository`` without the ONNX export and the TensorRT build (placeholders instead,
    ``tests/unit/repository_helpers.py``); the rest is the real build."""
    from tests.unit.repository_helpers import fake_artifact_builds

    fake_artifact_builds(monkeypatch)


@pytest.fixture(autouse=True)
def _gc_unfrozen_after_each_test():
    """A model's finalize ends with gc.freeze() (its stub exits next); in this one pytest process
    the next tests must still have their garbage collected."""
    yield
    gc.unfreeze()

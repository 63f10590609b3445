"""The base of the request/response (not decoupled) python models: ``preprocess``,
``vit_encoder`` and ``vit_positions``, batched or not (``max_batch_size`` 0: Triton still hands
``execute`` a list of requests, each one item of ``batch``).

A ``model.py`` subclasses :class:`BatchedModel` and writes ``INPUTS``, ``setup(args)`` and
``run(batch)``: per request of the batch, its output tensors (name -> array) or the
``EpdError`` that request gets. A failure of the batch itself gives every request one coded
error, never a traceback. ``finalize`` releases the model's metrics (see ``metrics.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends import contract
from python_backends.runtime.cpus import pin_to_model_cpus
from python_backends.runtime.heartbeat import Heartbeat, start_heartbeat
from python_backends.runtime.model_params import ModelParameters
from python_backends.triton_edge.logs import route_to_triton_log
from python_backends.triton_edge.metrics import ModelMetrics
from python_backends.triton_edge.responses import error_response, read_inputs, response

Outputs = Mapping[str, np.ndarray]


class BatchedModel:
    INPUTS: tuple[str, ...] = ()
    heartbeat: Heartbeat | None = None  # python_backends/runtime/heartbeat.py: stopped in finalize

    def setup(self, args: dict[str, str]) -> None:
        raise NotImplementedError

    def run(self, batch: list[dict[str, np.ndarray]]) -> Sequence[Outputs | BaseException]:
        raise NotImplementedError

    def initialize(self, args: dict[str, str]) -> None:
        self.model_name = args["model_name"]
        route_to_triton_log(self.model_name)
        self.heartbeat = start_heartbeat()  # for the launcher's stage watch: a stub that runs no Python
        self.config: dict[str, Any] = json.loads(args["model_config"])
        self.params = ModelParameters.from_model_config(self.config)
        pin_to_model_cpus(self.model_name, self.params.string(contract.CPUS, ""))  # before anything starts
        self.metrics = ModelMetrics(self.model_name)
        self.setup(args)

    def execute(self, requests: list[pb_utils.InferenceRequest]) -> list[pb_utils.InferenceResponse]:
        batch = [read_inputs(request, self.INPUTS) for request in requests]
        try:
            results = self.run(batch)
        except Exception as exc:  # a failure of the batch itself: every request gets one coded error
            pb_utils.Logger.log_error(f"{self.model_name} failed on a batch of {len(requests)}: {exc!r}")
            return [error_response(exc) for _ in requests]
        return [
            error_response(result)
            if isinstance(result, BaseException)
            else response([pb_utils.Tensor(name, np.ascontiguousarray(array)) for name, array in result.items()])
            for result in results
        ]

    def log_info(self, message: str) -> None:
        pb_utils.Logger.log_info(message)

    def finalize(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.metrics.release()

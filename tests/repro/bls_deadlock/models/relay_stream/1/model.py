"""relay_stream (old pattern): each request's thread reads decoupled BLS streams from `ticker`.

Per request a thread opens STREAMS streams one after another with
``pb_utils.InferenceRequest(...).exec(decoupled=True)`` and iterates each one's responses,
while the threads of the other requests open streams of their own. A gauge is ``set()`` per
response, and each token is sent on to the client.
"""

import collections
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

# Why finished iterators are kept a while: python_backend r24.10's stub also holds each BLS
# response iterator in a map, and its stub-to-parent thread erases it after the final response
# without the GIL. Were Python's reference gone first, that erase destroys the iterator and its
# responses' numpy arrays without the GIL, and the stub dies in pymalloc (see the report). Kept
# here, the last reference is dropped by Python, later, with the GIL held.
RETIRE_S = 10.0


class _Retired:
    def __init__(self):
        self._lock = threading.Lock()
        self._kept = collections.deque()  # (finished at, iterator), oldest first

    def keep(self, iterator):
        now = time.monotonic()
        expired = []
        with self._lock:
            self._kept.append((now, iterator))
            while self._kept and now - self._kept[0][0] > RETIRE_S:
                expired.append(self._kept.popleft())
        del expired  # destroyed here, by a thread that holds the GIL


_RETIRED = _Retired()


def _scalar(request, name):
    return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy()[0])


class TritonPythonModel:
    def initialize(self, args):
        self.family = pb_utils.MetricFamily(  # must outlive its metrics
            name="repro_relay_tokens_in_request",
            description="tokens relayed so far by the latest request",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self.gauge = self.family.Metric(labels={"model": "relay_stream"})

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._relay, args=(request,), daemon=True).start()
        return None

    def _relay(self, request):
        sender = request.get_response_sender()
        try:
            streams, tokens, gap_us = (_scalar(request, n) for n in ("STREAMS", "TOKENS", "GAP_US"))
            relayed = 0
            for _ in range(streams):
                bls = pb_utils.InferenceRequest(
                    model_name="ticker",
                    requested_output_names=["TOKEN"],
                    inputs=[
                        pb_utils.Tensor("COUNT", np.array([tokens], dtype=np.int32)),
                        pb_utils.Tensor("GAP_US", np.array([gap_us], dtype=np.int32)),
                    ],
                )
                responses = bls.exec(decoupled=True)
                for response in responses:  # next() waits on an empty buffer
                    if response.has_error():
                        raise pb_utils.TritonModelException(response.error().message())
                    token = pb_utils.get_output_tensor_by_name(response, "TOKEN")
                    if token is None:  # an empty final response
                        continue
                    relayed += 1
                    self.gauge.set(relayed)  # Metric.set keeps the GIL while it waits
                    out = pb_utils.Tensor("TOKEN", token.as_numpy().copy())
                    sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
                _RETIRED.keep(responses)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as error:  # the client gets any failure as an error response
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )

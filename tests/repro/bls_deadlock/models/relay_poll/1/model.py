"""relay_poll (new pattern): the same work as relay_stream, read from `poller` by polling.

Per request a thread runs STREAMS generations one after another: one BLS call starts each,
then calls from the last offset until DONE. Every BLS call gets exactly one response, sent with
the FINAL flag, so the iterator already holds it when ``exec`` returns and ``next()`` never
waits for one. The per-response counter is ``increment()``ed (it releases the GIL while it
waits; one call at a time per Metric object), never ``set()``.
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


def _poll(gen_id, offset, tokens, gap_us):
    bls = pb_utils.InferenceRequest(
        model_name="poller",
        requested_output_names=["GEN_ID", "TOKENS", "DONE"],
        inputs=[
            pb_utils.Tensor("GEN_ID", np.array([gen_id], dtype=np.int64)),
            pb_utils.Tensor("OFFSET", np.array([offset], dtype=np.int32)),
            pb_utils.Tensor("COUNT", np.array([tokens], dtype=np.int32)),
            pb_utils.Tensor("GAP_US", np.array([gap_us], dtype=np.int32)),
        ],
    )
    iterator = bls.exec(decoupled=True)
    responses = list(iterator)  # one response, already there when exec returns: next() never waits
    _RETIRED.keep(iterator)
    if len(responses) != 1:
        raise pb_utils.TritonModelException(f"poller sent {len(responses)} responses, expected 1")
    response = responses[0]
    if response.has_error():
        raise pb_utils.TritonModelException(response.error().message())

    def output(name):
        return pb_utils.get_output_tensor_by_name(response, name).as_numpy()

    return int(output("GEN_ID")[0]), output("TOKENS").copy(), bool(output("DONE")[0])


class TritonPythonModel:
    def initialize(self, args):
        self.family = pb_utils.MetricFamily(  # must outlive its metrics
            name="repro_relay_tokens",
            description="tokens relayed",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self.counter = self.family.Metric(labels={"model": "relay_poll"})
        self.counter_lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._relay, args=(request,), daemon=True).start()
        return None

    def _relay(self, request):
        sender = request.get_response_sender()
        try:
            streams, tokens, gap_us = (_scalar(request, n) for n in ("STREAMS", "TOKENS", "GAP_US"))
            for _ in range(streams):
                gen_id, _, _ = _poll(0, 0, tokens, gap_us)  # starts a generation
                offset, done = 0, False
                while not done:
                    gen_id, new, done = _poll(gen_id, offset, tokens, gap_us)
                    offset += len(new)
                    for token in new:
                        # increment() releases the GIL while it waits; one thread at a time per
                        # Metric object (concurrent calls on one Metric crash tritonserver, see the report).
                        with self.counter_lock:
                            self.counter.increment(1)
                        out = pb_utils.Tensor("TOKEN", np.array([token], dtype=np.int32))
                        sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as error:  # the client gets any failure as an error response
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )

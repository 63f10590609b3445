"""poller: the generation of `ticker`, read by polling; one FINAL response per call (decoupled).

GEN_ID 0 starts a generation (a thread makes COUNT tokens, GAP_US microseconds apart, as
`ticker` does) and returns its id. A call with (GEN_ID, OFFSET) returns every token from OFFSET
on, after waiting up to WAIT_MS for at least one, and DONE when the generation has ended and
nothing is left to read. Each call is answered by exactly one ``send(response, FINAL)``.
"""

import itertools
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
ABANDONED_S = 60.0  # a generation nobody read for this long is dropped


class _Generation:
    def __init__(self, count, gap_s):
        self.count, self.gap_s = count, gap_s
        self.tokens = []
        self.done = False
        self.changed = threading.Condition()
        self.read_at = time.monotonic()

    def run(self):
        for i in range(self.count):
            with self.changed:
                self.tokens.append(i)
                self.done = i == self.count - 1
                self.changed.notify_all()
            if self.gap_s > 0 and not self.done:
                time.sleep(self.gap_s)


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.wait_s = float(parameters.get("WAIT_MS", {}).get("string_value", "20")) / 1e3
        self.generations = {}
        self.lock = threading.Lock()
        self.ids = itertools.count(1)

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._answer, args=(request,), daemon=True).start()
        return None

    def _answer(self, request):
        sender = request.get_response_sender()
        try:
            sender.send(self._poll(request), flags=FINAL)
        except Exception as error:  # the caller gets any failure as an error response
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))), flags=FINAL)

    def _poll(self, request):
        def scalar(name):
            return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy()[0])

        gen_id = scalar("GEN_ID")
        if gen_id == 0:  # start a generation
            generation = _Generation(scalar("COUNT"), scalar("GAP_US") / 1e6)
            with self.lock:
                gen_id = next(self.ids)
                self.generations[gen_id] = generation
                self._drop_abandoned()
            threading.Thread(target=generation.run, daemon=True).start()
            return self._response(gen_id, [], False)
        with self.lock:
            generation = self.generations.get(gen_id)
        if generation is None:
            raise ValueError(f"no generation {gen_id}")
        offset = scalar("OFFSET")
        with generation.changed:
            generation.changed.wait_for(lambda: len(generation.tokens) > offset or generation.done, self.wait_s)
            tokens, done = generation.tokens[offset:], generation.done
        generation.read_at = time.monotonic()
        if done:
            with self.lock:
                self.generations.pop(gen_id, None)
        return self._response(gen_id, tokens, done)

    def _drop_abandoned(self):
        now = time.monotonic()
        for key in [k for k, g in self.generations.items() if now - g.read_at > ABANDONED_S]:
            del self.generations[key]

    @staticmethod
    def _response(gen_id, tokens, done):
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("GEN_ID", np.array([gen_id], dtype=np.int64)),
                pb_utils.Tensor("TOKENS", np.array(tokens, dtype=np.int32)),
                pb_utils.Tensor("DONE", np.array([done], dtype=np.bool_)),
            ]
        )

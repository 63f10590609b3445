"""ticker: streams COUNT small responses, GAP_US microseconds apart (decoupled)."""

import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._stream, args=(request,), daemon=True).start()
        return None

    def _stream(self, request):
        sender = request.get_response_sender()
        count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
        gap_s = int(pb_utils.get_input_tensor_by_name(request, "GAP_US").as_numpy()[0]) / 1e6
        for i in range(count):
            token = pb_utils.Tensor("TOKEN", np.array([i], dtype=np.int32))
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if i == count - 1 else 0
            sender.send(pb_utils.InferenceResponse(output_tensors=[token]), flags=flags)
            if gap_s > 0 and i < count - 1:
                time.sleep(gap_s)

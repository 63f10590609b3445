"""Tiny decoupled python models (no vLLM, seconds to start) for the stop tests and the cancel
storm (``tests/stress/cancel_storm.py``): ``ticker`` streams tokens with the real DecoupledModel,
``relay`` streams them over BLS with the real BlsCaller, and ``canonical`` is Triton's own
decoupled pattern (python_backend's repeat example: a thread per request, no code of ours).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

# Issue 19's root cause, in miniature: ``relay`` streams ``ticker``'s tokens over BLS with the real
# DecoupledModel and BlsCaller, as ``epd`` streams ``decode``'s, and stops listening when its client
# cancels (then aborts ``ticker``, as ``epd`` aborts ``decode``).
TICKER = textwrap.dedent("""
    import asyncio

    from python_backends.engines.generation import GenerationChunk, text_of
    from python_backends.triton_edge.decoupled import DecoupledModel

    TICK_S = 0.05


    class TritonPythonModel(DecoupledModel):
        INPUTS = ("text_input", "request_id", "abort")

        def setup(self, args):
            pass

        def parse(self, inputs, request):
            request_id = text_of(inputs.get("request_id"))
            if "abort" in inputs and bool(inputs["abort"].reshape(-1)[0]):
                self.cancel_running(request_id)
                return None
            return request_id, int(text_of(inputs.get("text_input")))

        def request_id(self, parsed):
            return parsed[0] or super().request_id(parsed)

        async def serve(self, parsed, request_id):
            count = parsed[1]
            for i in range(count):
                await asyncio.sleep(TICK_S)
                yield GenerationChunk(text="t", token_ids=[i], finished=i == count - 1)
""")

# ``ticker`` whose FINAL after a client's cancel goes out 200 ms after the cancel was noticed (the
# cancel storm's question: does the final response racing Triton's cancel handling leak the request?).
TICKER_LATE_FINAL = TICKER + textwrap.dedent("""

    class TritonPythonModel(TritonPythonModel):
        async def _end(self, stream, request_id, sender, ended):
            if not ended:
                await asyncio.sleep(0.2)
            await super()._end(stream, request_id, sender, ended)
""")

RELAY = textwrap.dedent("""
    from python_backends.engines.generation import chunk_from_outputs, text_of
    from python_backends.triton_edge.bls import BlsCaller
    from python_backends.triton_edge.decoupled import DecoupledModel
    from python_backends.triton_edge.responses import bytes_tensor, tensor


    class Ticker(BlsCaller):
        async def ticks(self, request_id, count):
            inputs = [bytes_tensor("text_input", [str(count)]), bytes_tensor("request_id", [request_id])]
            async for out in self._stream("ticker", inputs):
                yield chunk_from_outputs(out)

        async def abort(self, request_id):
            inputs = [bytes_tensor("request_id", [request_id]), tensor("abort", [True], bool)]
            async for _ in self._stream("ticker", inputs):
                pass


    class TritonPythonModel(DecoupledModel):
        INPUTS = ("text_input",)

        def setup(self, args):
            self.engine = Ticker()

        def parse(self, inputs, request):
            return int(text_of(inputs.get("text_input")))

        async def serve(self, parsed, request_id):
            try:
                async for chunk in self.engine.ticks(request_id, parsed):
                    yield chunk
            finally:
                await self.engine.abort(request_id)
""")

# ``relay`` with a thread that keeps allocating Python objects (as epd's other threads do: vLLM,
# the store, JPEG decode), so that an object freed without the GIL corrupts the allocator at once.
RELAY_ALLOCATING = RELAY + textwrap.dedent("""

    import threading

    import numpy as np
    import tvm_ffi  # its SIGSEGV handler prints "Segfault encountered" and a backtrace into the log

    from python_backends.triton_edge import bls

    bls.RETIRE_S = RETIRE_S_VALUE


    def allocate_forever():
        while True:
            arrays = [np.zeros(3) for _ in range(200)]
            del arrays


    threading.Thread(target=allocate_forever, daemon=True).start()
""")

STREAMING_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [
  {{ name: "text_input", data_type: TYPE_STRING, dims: [ 1 ], optional: true }},
  {{ name: "request_id", data_type: TYPE_STRING, dims: [ 1 ], optional: true }},
  {{ name: "abort", data_type: TYPE_BOOL, dims: [ 1 ], optional: true }},
  {{ name: "errors_as_outputs", data_type: TYPE_BOOL, dims: [ 1 ], optional: true }}
]
output [
  {{ name: "text_output", data_type: TYPE_STRING, dims: [ -1 ] }},
  {{ name: "output_token_ids", data_type: TYPE_INT64, dims: [ -1 ] }},
  {{ name: "error", data_type: TYPE_STRING, dims: [ -1 ] }}
]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
"""


CANONICAL = textwrap.dedent("""
    import threading
    import time

    import numpy as np
    import triton_python_backend_utils as pb_utils

    TICK_S = 0.05


    class TritonPythonModel:
        def execute(self, requests):
            for request in requests:
                count = int(pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0])
                threading.Thread(target=self.run, args=(request.get_response_sender(), count), daemon=True).start()
            return None

        def run(self, sender, count):
            for i in range(count):
                time.sleep(TICK_S)
                if sender.is_cancelled():
                    break
                out = pb_utils.Tensor("output_token_ids", np.array([i], dtype=np.int64))
                sender.send(pb_utils.InferenceResponse([out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
""")


def streaming_repository(root: Path, models: dict[str, str]) -> Path:
    """A repository of decoupled models, ``{name: model.py source}``, all with STREAMING_CONFIG."""
    for name, code in models.items():
        (root / name / "1").mkdir(parents=True, exist_ok=True)
        (root / name / "config.pbtxt").write_text(STREAMING_CONFIG.format(name=name))
        (root / name / "1" / "model.py").write_text(code)
    return root


def relay_allocating(retire_s: float | None) -> str:
    """``RELAY_ALLOCATING`` with BlsCaller's RETIRE_S set (0: no retirement, the stub's thread may
    free a finished iterator; None: BlsCaller's own)."""
    return RELAY_ALLOCATING.replace("RETIRE_S_VALUE", "bls.RETIRE_S" if retire_s is None else repr(float(retire_s)))


def relay_repository(root: Path) -> Path:
    return streaming_repository(root, {"ticker": TICKER, "relay": RELAY})


def with_tick(code: str, seconds: float) -> str:
    """``ticker``'s or ``canonical``'s source with another time per token."""
    assert "TICK_S = 0.05" in code
    return code.replace("TICK_S = 0.05", f"TICK_S = {seconds}")

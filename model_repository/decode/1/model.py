"""`decode`: a vLLM KV consumer, decoupled: references + KV transfer parameters in, tokens 2..N out.

With `poll_offset` (as `epd` calls it) every call gets one response: the first starts the
generation, later ones (`request_id` + `poll_offset`) answer the tokens made since that offset
(python_backends/pd/polling.py says why); without, it streams. `abort` = true is a control
request (one empty final): it stops `request_id`'s decode or deletes a prefilled transfer.
"""

from python_backends import contract
from python_backends.pd.engines import DecodeEngine
from python_backends.pd.manifest import list_transfers
from python_backends.pd.polling import PolledGenerations, decode_answers
from python_backends.pd.stage import parse_stage_inputs, resolve_images
from python_backends.request.sampling import SamplingLimits
from python_backends.store import EmbeddingStore
from python_backends.triton_edge.decoupled import DecoupledModel
from python_backends.triton_edge.metrics import KvTransferMetrics
from python_backends.triton_edge.responses import polled_response


class TritonPythonModel(DecoupledModel):
    INPUTS = contract.DECODE.input_names

    def setup(self, args):
        self.sampling_limits = SamplingLimits.from_params(self.params)
        self.store = EmbeddingStore(self.params.store_config())
        self.engine = self.start_engine(args, DecodeEngine)
        self.polls = PolledGenerations(self.engine.abort, stream_interval=self.params.integer(contract.STREAM_INTERVAL))
        self.loop.submit(self.polls.reap_every(1.0))
        self.transfers = KvTransferMetrics(self.metrics, lambda: len(list_transfers(self.engine.store)))

    def parse(self, inputs, request):
        parsed = parse_stage_inputs(inputs, self.sampling_limits)
        if not parsed.abort:
            return parsed, resolve_images(self.store, parsed.references)[0]
        if parsed.request_id:
            self.cancel_running(parsed.request_id)
            self.loop.submit(self.polls.cancel(parsed.request_id))
        if parsed.transfer_params:  # prefilled KV no decode will take
            self.engine.discard(parsed.transfer_params)
        return None

    def refresh_state(self):
        super().refresh_state()
        self.transfers.refresh()

    def request_id(self, parsed):
        return parsed[0].request_id or super().request_id(parsed)

    def serve(self, parsed, request_id):
        return decode_answers(self.engine, self.polls, *parsed, request_id)

    def respond(self, item):
        if isinstance(item, tuple):  # (chunk, next offset): one poll's one response
            return polled_response(*item, self.declared_outputs), True
        return super().respond(item)

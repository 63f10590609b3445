"""`decode`: a vLLM KV consumer, decoupled. Image references + KV transfer parameters in
(from `prefill`, through `epd`); streams tokens 2..N.

A request with `abort` = true is a control request, answered with one empty final response:
with a `request_id` it stops the running request of that id (the `epd` BLS sends it when its
client cancels, because a BLS request cannot be cancelled in Triton 2.51); with
`transfer_params` it deletes that prefilled KV transfer (client gone before decode).

Thin by design: inputs parsed by python_backends.pd.stage, served by
python_backends.pd.engines.DecodeEngine; the request/error/cancel policy is
python_backends.triton_edge.decoupled's.
"""

from python_backends import contract
from python_backends.pd.engines import DecodeEngine
from python_backends.pd.manifest import list_transfers
from python_backends.pd.stage import parse_stage_inputs, resolve_images
from python_backends.store import EmbeddingStore
from python_backends.triton_edge.decoupled import DecoupledModel
from python_backends.triton_edge.metrics import KvTransferMetrics


class TritonPythonModel(DecoupledModel):
    INPUTS = contract.DECODE.input_names

    def setup(self, args):
        self.max_tokens_limit = self.params.integer(contract.MAX_TOKENS_LIMIT)
        self.store = EmbeddingStore(self.params.store_config())
        self.engine = self.start_engine(args, DecodeEngine)
        self.transfers = KvTransferMetrics(self.metrics, lambda: len(list_transfers(self.engine.store)))
        self.loop.submit(self.transfers.refresh_every(1.0))

    def parse(self, inputs, request):
        parsed = parse_stage_inputs(inputs, self.max_tokens_limit)
        if not parsed.abort:
            return parsed, resolve_images(self.store, parsed.references)[0]
        if parsed.request_id:
            self.cancel_running(parsed.request_id)
        if parsed.transfer_params:  # prefilled KV no decode will take
            self.engine.discard(parsed.transfer_params)
        return None

    def request_done(self):
        super().request_done()
        self.transfers.refresh()

    def request_id(self, parsed):
        return parsed[0].request_id or super().request_id(parsed)

    def serve(self, parsed, request_id):
        inputs, images = parsed
        return self.engine.decode(
            inputs.transfer_params, images, inputs.sampling, request_id=request_id, stream=inputs.stream
        )

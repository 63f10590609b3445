"""`encoder_<i>`: one encoder instance in front of the node's embedding store.

image(s) or video(s) in -> content key -> store claim (hit / join another request's encode /
encode through the `encode` ensemble and write the store) -> references out. Embeddings never
leave this process through Triton; `epd` and `prefill` get references. This file is the source
of every `encoder_<i>`: builders/ copy it to the others. The logic: python_backends/encode/.
"""

from pathlib import Path

from python_backends import contract
from python_backends.encode.server import EncoderServer
from python_backends.triton_edge.bls import BlsEncode
from python_backends.triton_edge.decoupled import DecoupledModel
from python_backends.triton_edge.metrics import CacheMetrics
from python_backends.triton_edge.responses import encoder_response


class TritonPythonModel(DecoupledModel):
    INPUTS = contract.ENCODER.input_names

    def setup(self, args):
        self.engine = BlsEncode.from_params(self.params)
        repository = Path(args["model_repository"]).parent
        self.server = EncoderServer.build(self.params, repository, self.model_name, self.engine)
        self.store = self.server.store
        self.cache_metrics = CacheMetrics(self.metrics, self.store)

    def parse(self, inputs, request):
        return self.server.parse(inputs, request.parameters())

    async def serve(self, parsed, request_id):
        answers, by_value = await self.server.serve(parsed)
        for answer in answers:
            self.cache_metrics.count(answer.outcome.value)
        yield answers, by_value

    def respond(self, item):
        return encoder_response(*item), True

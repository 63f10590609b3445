"""`prefill`: a vLLM KV producer. Prompt + image references in; first token + KV transfer
parameters out (max_tokens=1). Never receives media: its config has no image input.

Thin by design: inputs parsed by python_backends.pd.stage, served by
python_backends.pd.engines.PrefillEngine; the request/error/cancel policy is
python_backends.triton_edge.decoupled's. Decoupled (one response per request) so that
requests run concurrently on the engine's event loop, like `llm`.
"""

from python_backends import contract
from python_backends.pd.engines import PrefillEngine
from python_backends.pd.stage import parse_stage_inputs, resolve_images
from python_backends.store import EmbeddingStore
from python_backends.triton_edge.decoupled import DecoupledModel


class TritonPythonModel(DecoupledModel):
    INPUTS = contract.PREFILL.input_names

    def setup(self, args):
        self.max_tokens_limit = self.params.integer(contract.MAX_TOKENS_LIMIT)
        self.store = EmbeddingStore(self.params.store_config())
        self.engine = self.start_engine(args, PrefillEngine)
        # Scraped by tests: what crossed Triton into prefill per image (references only).
        input_bytes = "Bytes of image inputs prefill received, by kind (reference; media is always 0)"
        self.reference_bytes = self.metrics.counter("epd_prefill_input_bytes", input_bytes, kind="reference")
        self.metrics.counter("epd_prefill_input_bytes", input_bytes, kind="media")
        self.references = self.metrics.counter("epd_prefill_references", "Image references prefill received")

    def parse(self, inputs, request):
        parsed = parse_stage_inputs(inputs, self.max_tokens_limit)
        self.reference_bytes.increment(sum(len(r) for r in parsed.references))
        self.references.increment(len(parsed.references))
        return parsed, resolve_images(self.store, parsed.references)[0]

    async def serve(self, parsed, request_id):
        inputs, images = parsed
        result = await self.engine.prefill(inputs.text, images, inputs.sampling, request_id=request_id)
        yield result.chunk()

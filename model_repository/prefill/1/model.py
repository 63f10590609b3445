"""`prefill`: a vLLM KV producer. Prompt + image references in; first token + KV transfer
parameters out (max_tokens=1). Never receives media: its config has no image input (an audio
checkpoint's takes clips only for an experiment's baseline, python_backends/pd/forwarded.py).

Thin by design: inputs parsed by python_backends.pd.stage, served by
python_backends.pd.engines.PrefillEngine; the request/error/cancel policy is
python_backends.triton_edge.decoupled's. Decoupled (one response per request) so that
requests run concurrently on the engine's event loop, like `llm`.
"""

from python_backends import contract
from python_backends.pd.engines import PrefillEngine
from python_backends.pd.forwarded import ReprocessedAudio, reprocess_forwarded
from python_backends.pd.stage import parse_stage_inputs, resolve_images
from python_backends.request.sampling import SamplingLimits
from python_backends.store import EmbeddingStore
from python_backends.triton_edge.decoupled import DecoupledModel


class TritonPythonModel(DecoupledModel):
    INPUTS = contract.AUDIO_PREFILL.input_names  # an image checkpoint's prefill declares no audio

    def setup(self, args):
        self.sampling_limits = SamplingLimits.from_params(self.params)
        self.store = EmbeddingStore(self.params.store_config())
        self.engine = self.start_engine(args, PrefillEngine)
        # Scraped by tests: what crossed Triton into prefill (references; clips only in a baseline).
        input_bytes = "Bytes of media inputs prefill received, by kind (media: an experiment's baseline only)"
        self.reference_bytes = self.metrics.counter("epd_prefill_input_bytes", input_bytes, kind="reference")
        self.media_bytes = self.metrics.counter("epd_prefill_input_bytes", input_bytes, kind="media")
        self.references = self.metrics.counter("epd_prefill_references", "Image references prefill received")
        self.reprocessed = ReprocessedAudio.from_params(self.params)  # the experiment's baseline only

    def parse(self, inputs, request):
        parsed = parse_stage_inputs(inputs, self.sampling_limits)
        self.reference_bytes.increment(sum(len(r) for r in parsed.references))
        self.references.increment(len(parsed.references))
        images, references = resolve_images(self.store, parsed.references)
        self.media_bytes.increment(reprocess_forwarded(inputs.get(contract.AUDIO), self.reprocessed, references))
        return parsed, images

    async def serve(self, parsed, request_id):
        inputs, images = parsed
        result = await self.engine.prefill(inputs.text, images, inputs.sampling, request_id=request_id)
        yield result.chunk()

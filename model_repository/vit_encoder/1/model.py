"""`vit_encoder` (cpu target): the exported vision tower + merger, fp32 on ONNX Runtime (the
default) or bf16 on OpenVINO (``vit_precision``).

Thin by design, not batched (``max_batch_size`` 0): python_backends.encode.stage runs every
image of a request (``pixel_values`` [rows, width], ``image_grid_thw`` [n, 3]) through the runner,
one call per image, several at once (python_backends.encode.vit_onnx, vit_openvino), and gives
``image_embeds`` [1, tokens, hidden] (every image's, concatenated) or one coded error per request
(python_backends.triton_edge.batched).
"""

import time
from pathlib import Path

from python_backends import contract
from python_backends.encode.stage import EncoderProvenance, EncoderStage, open_vision_encoder
from python_backends.triton_edge.batched import BatchedModel


class TritonPythonModel(BatchedModel):
    INPUTS = contract.VIT_ENCODER.input_names

    def setup(self, args):
        params = self.params
        provenance = EncoderProvenance.from_parameters(params)
        onnx_path = Path(args["model_repository"]) / args["model_version"] / params.string(contract.ONNX_FILE_KEY)
        started = time.perf_counter()
        precision = params.string(contract.VIT_PRECISION)
        encoder = open_vision_encoder(onnx_path, precision, params.integer(contract.VIT_THREADS))
        seconds = time.perf_counter() - started
        provenance.check(encoder, params)
        megabytes = sum(p.stat().st_size for p in onnx_path.parent.glob(onnx_path.name + "*")) / 1e6
        self.log_info(provenance.describe(onnx_path.name, megabytes, seconds))
        self.stage = EncoderStage(encoder)
        shards = "Checkpoint shard files behind the served encoder: read (vision) and total"
        load = "Seconds the vit_encoder instance took to load its weights"
        for which, count in (("read", provenance.vision_shards), ("total", provenance.checkpoint_shards)):
            self.metrics.gauge("epd_vit_encoder_checkpoint_shards", shards, shards=which).set(count)
        self.metrics.gauge("epd_vit_encoder_load_seconds", load).set(seconds)

    def run(self, batch):
        results = self.stage.run([(inputs[contract.PIXEL_VALUES], inputs[contract.IMAGE_GRID_THW]) for inputs in batch])
        return [r if isinstance(r, Exception) else {contract.IMAGE_EMBEDS: r} for r in results]

"""`vit_encoder` (cpu target): ONNX Runtime on the exported vision tower + merger.

Thin by design: settings are read in initialize; python_backends.encode_stage packs every
request of a dynamic batch into as few ONNX Runtime calls as the patch budget allows
(python_backends.vit_onnx) and gives one result or one coded error per request.
"""

import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.encode_stage import EncoderProvenance, EncoderStage
from python_backends.errors import EpdError
from python_backends.model_params import ModelParameters
from python_backends.triton_edge import ModelMetrics, error_response, read_inputs
from python_backends.vit_onnx import OnnxVisionEncoder


class TritonPythonModel:
    def initialize(self, args):
        params = ModelParameters.from_model_config(args["model_config"])
        provenance = EncoderProvenance.from_parameters(params)
        onnx_path = Path(args["model_repository"]) / args["model_version"] / params.string("onnx_file", "model.onnx")
        started = time.perf_counter()
        encoder = OnnxVisionEncoder(
            onnx_path,
            intra_op_threads=params.integer("intra_op_threads", 0),
            max_patches_per_run=params.integer("max_patches_per_run", 1024, minimum=1),
        )
        seconds = time.perf_counter() - started
        provenance.check(encoder, params)
        megabytes = sum(p.stat().st_size for p in onnx_path.parent.glob(onnx_path.name + "*")) / 1e6
        pb_utils.Logger.log_info(provenance.describe(onnx_path.name, megabytes, seconds))
        self.stage = EncoderStage(encoder)
        self.metrics = ModelMetrics(args["model_name"])
        shards = "Checkpoint shard files behind the served encoder: read (vision) and total"
        gauges = [
            self.metrics.gauge("epd_vit_encoder_checkpoint_shards", shards, shards="read"),
            self.metrics.gauge("epd_vit_encoder_checkpoint_shards", shards, shards="total"),
            self.metrics.gauge("epd_vit_encoder_load_seconds", "Seconds the vit_encoder instance took to load its weights"),
        ]
        for metric, value in zip(gauges, (provenance.vision_shards, provenance.checkpoint_shards, seconds)):
            metric.set(value)

    def execute(self, requests):
        inputs = [read_inputs(request, ("pixel_values", "image_grid_thw")) for request in requests]
        try:
            results = self.stage.run([(i["pixel_values"], i["image_grid_thw"]) for i in inputs])
        except Exception as exc:  # a failure of the batch itself: every request gets one coded error
            pb_utils.Logger.log_error(f"vit_encoder failed on a batch of {len(requests)}: {exc!r}")
            return [error_response(exc) for _ in requests]
        return [
            error_response(r)
            if isinstance(r, EpdError)
            else pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("image_embeds", np.ascontiguousarray(r))])
            for r in results
        ]

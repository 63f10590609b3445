"""`preprocess` (cpu target): the serialized DALI pipeline run on the CPU, dynamically batched.

Thin by design: settings are read in initialize; python_backends.encode_stage runs every
request of a dynamic batch through python_backends.preprocess (the same pipeline that Triton's
DALI backend serves on the gpu target) and gives one result or one coded error per request.
"""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.dali_pipeline import ImageTransformConfig
from python_backends.encode_stage import PreprocessStage
from python_backends.errors import EpdError
from python_backends.media import ImageLimits
from python_backends.model_params import ModelParameters
from python_backends.preprocess import DaliImagePreprocessor
from python_backends.triton_edge import error_response, read_inputs


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = ModelParameters.from_model_config(config)
        max_batch_size = int(config["max_batch_size"])
        limits = ImageLimits(
            max_images=max_batch_size,  # the most images Triton puts in one execute
            max_image_bytes=params.integer("max_image_bytes", 20 << 20, minimum=1),
            max_image_pixels=params.integer("max_image_pixels", 4096 * 4096, minimum=1),
        )
        version_dir = Path(args["model_repository"]) / args["model_version"]
        preprocessor = DaliImagePreprocessor.from_file(
            version_dir / params.string("pipeline_file", "model.dali"),
            ImageTransformConfig.from_file(params.string("preprocessor_config")),
            limits=limits,
            max_batch_size=max_batch_size,
            num_threads=params.integer("dali_num_threads", 2, minimum=1),
        )
        self.stage = PreprocessStage(preprocessor)

    def execute(self, requests):
        tensors = [read_inputs(request, ("image",)).get("image") for request in requests]
        try:
            results = self.stage.run_tensors(tensors)
        except Exception as exc:  # a failure of the batch itself: every request gets one coded error
            pb_utils.Logger.log_error(f"preprocess failed on a batch of {len(requests)}: {exc!r}")
            return [error_response(exc) for _ in requests]
        return [error_response(r) if isinstance(r, EpdError) else _response(r) for r in results]


def _response(batch):
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor("pixel_values", np.ascontiguousarray(batch.pixel_values)),
            pb_utils.Tensor("image_grid_thw", np.ascontiguousarray(batch.image_grid_thw)),
        ]
    )

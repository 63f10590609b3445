"""`vit_positions` (gpu target): rotary position ids and cu_seqlens for the TensorRT encoder.

Generated into model_repository/vit_positions/1/model.py by builders/repository.py for the
gpu target only (the cpu target's vit_encoder computes these itself). Thin by design: the
numbers come from python_backends.vit_onnx, the same code the ONNX Runtime path uses.
"""

import triton_python_backend_utils as pb_utils

from python_backends.errors import EpdError
from python_backends.model_params import ModelParameters
from python_backends.triton_edge import error_response, read_inputs
from python_backends.vit_onnx import vision_cu_seqlens, vision_position_ids


class TritonPythonModel:
    def initialize(self, args):
        params = ModelParameters.from_model_config(args["model_config"])
        self.merge_size = params.integer("merge_size", 2, minimum=1)

    def execute(self, requests):
        responses = []
        for request in requests:
            grid = read_inputs(request, ("image_grid_thw",))["image_grid_thw"]
            try:
                outputs = [
                    pb_utils.Tensor("rotary_pos_ids", vision_position_ids(grid, self.merge_size)),
                    pb_utils.Tensor("cu_seqlens", vision_cu_seqlens(grid)),
                ]
            except EpdError as exc:
                responses.append(error_response(exc))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses

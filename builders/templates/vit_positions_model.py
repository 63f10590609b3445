"""`vit_positions` (gpu target): the rotary position ids of one image for the TensorRT encoder.

Generated into model_repository/vit_positions/1/model.py by builders/repository.py for the
gpu target only (the cpu target's vit_encoder computes these itself). Thin by design: the
numbers come from python_backends.encode.vit_onnx, the same code the ONNX Runtime path uses.
The plan encodes one image (one frame) per request, so its ids are one frame's, ``[h*w, 2]``.
"""

from python_backends import contract
from python_backends.encode.vit_onnx import frame_position_ids
from python_backends.errors import invalid_arg
from python_backends.triton_edge.batched import BatchedModel


class TritonPythonModel(BatchedModel):
    INPUTS = contract.VIT_POSITIONS.input_names

    def setup(self, args):
        self.merge_size = self.params.integer(contract.MERGE_SIZE)

    def run(self, batch):
        return [self._positions(inputs[contract.IMAGE_GRID_THW]) for inputs in batch]

    def _positions(self, grid):
        merge = self.merge_size
        # Preprocess gives one image: [[1, h, w]] with sides in whole merge blocks; anything else
        # would reach the plan with shapes its profile (frames fixed at 1) refuses.
        if grid.shape != (1, 3) or grid[0, 0] != 1 or grid[0, 1] % merge or grid[0, 2] % merge:
            return invalid_arg(
                f"vit_positions takes one image's grid [[1, h, w]] (h, w multiples of {merge}), got {grid.tolist()}"
            )
        return {contract.ROTARY_POS_IDS: frame_position_ids(int(grid[0, 1]), int(grid[0, 2]), merge)}

"""`vit_positions` (gpu target): rotary position ids and cu_seqlens for the TensorRT encoder.

Generated into model_repository/vit_positions/1/model.py by builders/repository.py for the
gpu target only (the cpu target's vit_encoder computes these itself). Thin by design: the
numbers come from python_backends.encode.vit_onnx, the same code the ONNX Runtime path uses.
"""

from python_backends import contract
from python_backends.encode.vit_onnx import vision_cu_seqlens, vision_position_ids
from python_backends.errors import EpdError
from python_backends.triton_edge.batched import BatchedModel


class TritonPythonModel(BatchedModel):
    INPUTS = contract.VIT_POSITIONS.input_names

    def setup(self, args):
        self.merge_size = self.params.integer(contract.MERGE_SIZE)

    def run(self, batch):
        return [self._positions(inputs[contract.IMAGE_GRID_THW]) for inputs in batch]

    def _positions(self, grid):
        try:
            positions = vision_position_ids(grid, self.merge_size)
            return {contract.ROTARY_POS_IDS: positions, contract.CU_SEQLENS: vision_cu_seqlens(grid)}
        except EpdError as exc:
            return exc

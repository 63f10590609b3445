"""`audio_encoder`: ONNX Runtime on an audio checkpoint's encoder + projector (cpu target).

Generated into <repository>/audio_encoder/1/model.py by builders/repository.py for an audio
checkpoint only (model_repository/ holds the image models). Thin by design: the work is
python_backends.encode.audio_onnx's; encoder_<i> calls it with each clip's DALI features.
"""

from pathlib import Path

from python_backends import contract
from python_backends.encode.audio_onnx import OnnxAudioEncoder
from python_backends.errors import EpdError
from python_backends.triton_edge.batched import BatchedModel


class TritonPythonModel(BatchedModel):
    INPUTS = contract.AUDIO_ENCODER.input_names

    def setup(self, args):
        onnx_path = Path(args["model_repository"]) / args["model_version"] / self.params.string(contract.ONNX_FILE_KEY)
        self.encoder = OnnxAudioEncoder(onnx_path, intra_op_threads=self.params.integer(contract.INTRA_OP_THREADS))

    def run(self, batch):
        return [self._encode(inputs) for inputs in batch]

    def _encode(self, inputs):
        try:
            embeds, tokens = self.encoder.encode(inputs[contract.INPUT_FEATURES], inputs[contract.FEATURE_LENGTHS])
        except EpdError as exc:
            return exc
        return {contract.AUDIO_EMBEDS: embeds, contract.AUDIO_TOKENS: tokens}

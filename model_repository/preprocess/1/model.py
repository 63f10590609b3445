"""`preprocess` (cpu target): the serialized DALI pipeline run on the CPU, dynamically batched.

Thin by design: python_backends.preprocess.stage runs every request of a dynamic batch through
python_backends.preprocess.images (the same pipeline that Triton's DALI backend serves on the gpu
target) and gives one result or one coded error per request (python_backends.triton_edge.batched).
"""

from pathlib import Path

from python_backends import contract
from python_backends.preprocess.image_pipeline import ImageTransformConfig
from python_backends.preprocess.images import DaliImagePreprocessor
from python_backends.preprocess.stage import PreprocessStage
from python_backends.request.images import ImageLimits
from python_backends.triton_edge.batched import BatchedModel


class TritonPythonModel(BatchedModel):
    INPUTS = contract.PREPROCESS.input_names

    def setup(self, args):
        params = self.params
        max_batch_size = int(self.config["max_batch_size"])
        limits = ImageLimits(
            max_images=max_batch_size,  # the most images Triton puts in one execute
            max_image_bytes=params.integer(contract.MAX_IMAGE_BYTES),
            max_image_pixels=params.integer(contract.MAX_IMAGE_PIXELS),
        )
        preprocessor = DaliImagePreprocessor.from_file(
            Path(args["model_repository"]) / args["model_version"] / params.string(contract.PIPELINE_FILE),
            ImageTransformConfig.from_file(params.string(contract.PREPROCESSOR_CONFIG)),
            limits=limits,
            max_batch_size=max_batch_size,
            num_threads=params.integer(contract.DALI_NUM_THREADS),
        )
        self.stage = PreprocessStage(preprocessor)

    def run(self, batch):
        results = self.stage.run_tensors([inputs.get(contract.IMAGE) for inputs in batch])
        return [r if isinstance(r, Exception) else _outputs(r) for r in results]


def _outputs(batch):
    return {contract.PIXEL_VALUES: batch.pixel_values, contract.IMAGE_GRID_THW: batch.image_grid_thw}

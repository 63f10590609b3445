"""`preprocess` (cpu target): encoded images -> folded ``pixel_values`` + ``image_grid_thw``, dynamically batched.

Thin by design: python_backends.preprocess.stage runs every request of a dynamic batch through
one image preprocessor and gives one result or one coded error per request
(python_backends.triton_edge.batched). The ``image_backend`` parameter picks it:

- ``torchvision`` (the cpu default): PIL decode + torchvision resize, vLLM's processor bit for bit
  (python_backends.preprocess.torch_images), one torch intra-op thread per call.
- ``dali``: the serialized DALI pipeline that Triton's DALI backend serves on the gpu target,
  run on the CPU (python_backends.preprocess.images); ~2 uint8 levels off vLLM's pixels.
"""

from pathlib import Path

from python_backends import contract
from python_backends.preprocess.image_pipeline import ImageTransformConfig
from python_backends.preprocess.stage import ImagePreprocessor, PreprocessStage
from python_backends.request.images import ImageLimits
from python_backends.triton_edge.batched import BatchedModel

TORCHVISION = "torchvision"
DALI = "dali"


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
        config = ImageTransformConfig.from_file(params.string(contract.PREPROCESSOR_CONFIG))
        backend = params.string(contract.IMAGE_BACKEND)
        self.stage = PreprocessStage(_preprocessor(backend, args, params, config, limits, max_batch_size))

    def run(self, batch):
        results = self.stage.run_tensors([inputs.get(contract.IMAGE) for inputs in batch])
        return [r if isinstance(r, Exception) else _outputs(r) for r in results]


def _preprocessor(backend, args, params, config, limits, max_batch_size) -> ImagePreprocessor:
    """The backend the config names (torch is imported only when it is the one chosen)."""
    if backend == TORCHVISION:
        from python_backends.preprocess.torch_images import TorchImagePreprocessor, set_process_threads

        set_process_threads()  # this stub runs nothing else on torch: one intra-op thread, set once
        return TorchImagePreprocessor(config, limits)
    if backend == DALI:
        from python_backends.preprocess.images import DaliImagePreprocessor

        return DaliImagePreprocessor.from_file(
            Path(args["model_repository"]) / args["model_version"] / params.string(contract.PIPELINE_FILE),
            config,
            limits=limits,
            max_batch_size=max_batch_size,
            num_threads=params.integer(contract.DALI_NUM_THREADS),
        )
    raise ValueError(
        f"model '{args.get('model_name', 'preprocess')}': parameter '{contract.IMAGE_BACKEND}' is "
        f"{backend!r}; use one of {', '.join(contract.IMAGE_BACKENDS)}"
    )


def _outputs(batch):
    return {contract.PIXEL_VALUES: batch.pixel_values, contract.IMAGE_GRID_THW: batch.image_grid_thw}

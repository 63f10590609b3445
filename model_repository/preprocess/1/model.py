"""`preprocess` (cpu target): encoded images -> folded ``pixel_values`` + ``image_grid_thw``.

Thin by design: python_backends.preprocess.stage gives one result or one coded error per request
(python_backends.triton_edge.batched). Not batched (``max_batch_size`` 0): a request's 0..N
images (BYTES) in one preprocessor call, rows concatenated (``RequestPreprocess``). A config that
batches is the gpu target's DALI interface, one image per batch row (``PreprocessStage``), which
tests/server/test_gpu_topology.py serves with this file on the CPU. The ``image_backend``
parameter picks the preprocessor:

- ``torchvision`` (the cpu default): PIL decode + torchvision resize, vLLM's processor bit for bit
  (python_backends.preprocess.torch_images), one torch intra-op thread per call.
- ``dali``: the serialized DALI pipeline that Triton's DALI backend serves on the gpu target,
  run on the CPU (python_backends.preprocess.images); ~2 uint8 levels off vLLM's pixels.
"""

from pathlib import Path

from python_backends import contract
from python_backends.preprocess.processor import ImageTransformConfig
from python_backends.preprocess.stage import ImagePreprocessor, PreprocessStage, RequestPreprocess
from python_backends.request.images import ImageLimits
from python_backends.triton_edge.batched import BatchedModel

TORCHVISION = "torchvision"
DALI = "dali"


class TritonPythonModel(BatchedModel):
    INPUTS = contract.PREPROCESS.input_names

    def setup(self, args):
        params = self.params
        max_batch_size = int(self.config["max_batch_size"])
        # Not batched: a request's images, at most max_images_per_request; batched (the DALI
        # interface): the most images Triton puts in one execute.
        max_images = max_batch_size or params.integer(contract.MAX_IMAGES_PER_REQUEST)
        limits = ImageLimits(
            max_images=max_images,
            max_image_bytes=params.integer(contract.MAX_IMAGE_BYTES),
            max_image_pixels=params.integer(contract.MAX_IMAGE_PIXELS),
        )
        config = ImageTransformConfig.from_file(params.string(contract.PREPROCESSOR_CONFIG))
        backend = params.string(contract.IMAGE_BACKEND)
        preprocessor = _preprocessor(backend, args, params, config, limits, max_batch_size)
        if max_batch_size > 0:
            self.stage = PreprocessStage(preprocessor)
        else:
            self.stage = RequestPreprocess(preprocessor, config.folded_patch_dim)

    def run(self, batch):
        results = self.stage.run_tensors([inputs.get(contract.IMAGE) for inputs in batch])
        return [r if isinstance(r, Exception) else _outputs(r) for r in results]


def _preprocessor(backend, args, params, config, limits, max_batch_size) -> ImagePreprocessor:
    """The backend the config names (torch is imported only when it is the one chosen)."""
    if backend == TORCHVISION:
        from python_backends.preprocess.torch_images import TorchImagePreprocessor, set_process_threads

        set_process_threads()  # this stub runs nothing else on torch: one intra-op thread, set once
        return TorchImagePreprocessor(config, limits)
    if backend == DALI:  # DALI, too, is imported only when chosen
        from python_backends.preprocess.image_pipeline import DEFAULT_MAX_BATCH_SIZE
        from python_backends.preprocess.images import DaliImagePreprocessor

        return DaliImagePreprocessor.from_file(
            Path(args["model_repository"]) / args["model_version"] / params.string(contract.PIPELINE_FILE),
            config,
            limits=limits,
            # images per DALI run: the batch Triton gives, or (not batched) up to the pipeline's own
            max_batch_size=max_batch_size or min(limits.max_images, DEFAULT_MAX_BATCH_SIZE),
            num_threads=params.integer(contract.DALI_NUM_THREADS),
        )
    raise ValueError(
        f"model '{args.get('model_name', 'preprocess')}': parameter '{contract.IMAGE_BACKEND}' is "
        f"{backend!r}; use one of {', '.join(contract.IMAGE_BACKENDS)}"
    )


def _outputs(result):
    return {contract.PIXEL_VALUES: result.pixel_values, contract.IMAGE_GRID_THW: result.image_grid_thw}

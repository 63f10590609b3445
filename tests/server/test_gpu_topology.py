"""The gpu target's `encode` wiring, loaded by a real tritonserver on this CPU machine.

Triton's DALI backend, TensorRT and a GPU are absent here, so the two gpu-only models become
python stand-ins that keep the *generated* gpu configs (inputs, outputs with their reshapes,
batch sizes) and swap only the backend: ``preprocess`` runs the cpu pipeline (the same
outputs as the gpu one, tests/unit/test_preprocess_parity.py), ``vit_encoder`` feeds ONNX
Runtime the TensorRT engine's own inputs (pixel_values [1 frame, patches, folded row] and one
frame's rotary_pos_ids: the graph the plan is built from). The rest is the generated gpu
repository as is: the ensemble with max_batch_size 0, ``vit_positions``, the one-image reshape of
image_embeds. What this cannot show: nvJPEG decoding, the TensorRT engine, CUDA graphs (GPU-only
tests, skipped here).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from builders.repository import TARGETS, EncoderFacts, repository_files
from builders.tritonserver import Ports, ServerOptions, TritonServer
from tests.images import synthetic_image
from tests.server.conftest import LOG_DIR, serving
from tests.server.test_encode import grpc_infer

pytestmark = pytest.mark.server

# Stand-in for the tensorrt_plan: the engine's inputs as Triton hands them.
TRT_STAND_IN = '''
import json
from pathlib import Path

import onnxruntime as ort
import triton_python_backend_utils as pb_utils

INPUTS = ("pixel_values", "rotary_pos_ids")


class TritonPythonModel:
    def initialize(self, args):
        folder = Path(args["model_repository"]) / args["model_version"]
        self.session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
        # The generated config's CUDA graph shapes: TensorRT captures a graph for exactly these.
        self.graphs = json.loads((folder / "cuda_graphs.json").read_text())

    def execute(self, requests):
        responses = []
        for request in requests:
            feed = {name: pb_utils.get_input_tensor_by_name(request, name).as_numpy() for name in INPUTS}
            pixels = feed["pixel_values"]
            if pixels.ndim != 3 or pixels.shape[0] != 1:  # the engine takes [1 frame, patches, row]
                error = pb_utils.TritonError(f"not one frame of one image: {pixels.shape}")
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            fed = {name: list(array.shape) for name, array in feed.items()}
            same_patches = [g for g in self.graphs if g["pixel_values"][1] == fed["pixel_values"][1]]
            if any(graph != fed for graph in same_patches):
                error = pb_utils.TritonError(f"CUDA graph shapes {same_patches} are not the engine's inputs {fed}")
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            (embeds,) = self.session.run(["image_embeds"], feed)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("image_embeds", embeds)]))
        return responses
'''


def _parse(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def _as_python_on_cpu(
    config: model_config_pb2.ModelConfig, parameters_from: model_config_pb2.ModelConfig | None = None
) -> str:
    config.backend = "python"
    config.platform = ""
    config.ClearField("optimization")  # CUDA graphs: TensorRT only
    for group in config.instance_group:
        group.kind = model_config_pb2.ModelInstanceGroup.KIND_CPU
        group.ClearField("gpus")  # the gpu target pins the encode side to its GPU
    if parameters_from is not None:
        for key, value in parameters_from.parameters.items():
            config.parameters[key].CopyFrom(value)
    return text_format.MessageToString(config)


@pytest.fixture(scope="module")
def gpu_like_server(
    server: TritonServer, server_repository: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    # The session server's cpu repository: its artefacts and the encoder facts it was built with.
    cpu_repository = server_repository
    cpu_configs = {m: _parse((cpu_repository / m / "config.pbtxt").read_text()) for m in ("preprocess", "vit_encoder")}
    encoder_parameters = cpu_configs["vit_encoder"].parameters
    facts = EncoderFacts(
        **{name: int(encoder_parameters[name].string_value) for name in EncoderFacts.__dataclass_fields__}
    )
    out = tmp_path_factory.mktemp("gpu_repository")
    for relative, content in repository_files(TARGETS["gpu"], model_dir, facts).items():
        if relative.split("/")[0] not in TARGETS["gpu"].encode.models:
            continue  # llm, prefill, decode, epd, ensemble: not the encode path; saves vLLM starts
        path = out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    for model in TARGETS["gpu"].encode.models:
        (out / model / "1").mkdir(parents=True, exist_ok=True)
    preprocess = _parse((out / "preprocess" / "config.pbtxt").read_text())
    assert preprocess.backend == "dali"
    (out / "preprocess" / "config.pbtxt").write_text(_as_python_on_cpu(preprocess, cpu_configs["preprocess"]))
    # The cpu pipeline (same outputs as the gpu one); its model.py serves the DALI interface (one
    # image per batch row) when its config batches, as this one does.
    for name in ("model.py", "model.dali"):
        shutil.copy(cpu_repository / "preprocess" / "1" / name, out / "preprocess" / "1" / name)
    encoder = _parse((out / "vit_encoder" / "config.pbtxt").read_text())
    assert encoder.platform == "tensorrt_plan"
    graphs = [{k: list(v.dim) for k, v in spec.input.items()} for spec in encoder.optimization.cuda.graph_spec]
    (out / "vit_encoder" / "1" / "cuda_graphs.json").write_text(json.dumps(graphs))
    (out / "vit_encoder" / "config.pbtxt").write_text(_as_python_on_cpu(encoder))
    (out / "vit_encoder" / "1" / "model.py").write_text(TRT_STAND_IN)
    shutil.copy(cpu_repository / "vit_encoder" / "1" / "model.onnx", out / "vit_encoder" / "1" / "model.onnx")

    with serving(ServerOptions(out, Ports.free()), LOG_DIR / "gpu-topology-server.log", timeout_s=300) as running:
        yield running


def test_gpu_encode_wiring_gives_the_cpu_numbers(server: TritonServer, gpu_like_server: TritonServer) -> None:
    cpu = grpcclient.InferenceServerClient(server.grpc_url)
    gpu = grpcclient.InferenceServerClient(gpu_like_server.grpc_url)
    for image in (synthetic_image(640, 480, 1), synthetic_image(64, 64, 2, "PNG"), synthetic_image(300, 1000, 3)):
        expected, actual = grpc_infer(cpu, "encode", image), grpc_infer(gpu, "encode", image, one_image_uint8=True)
        # Same output shapes for a one-image request on both targets (the input: BYTES [1] on cpu,
        # UINT8 [1, bytes] on gpu).
        assert actual["image_embeds"].shape == expected["image_embeds"].shape
        np.testing.assert_array_equal(actual["image_grid_thw"], expected["image_grid_thw"])
        np.testing.assert_allclose(actual["image_embeds"], expected["image_embeds"], atol=1e-5, rtol=0)


def test_cuda_graph_shapes_are_what_the_engine_is_fed(gpu_like_server: TritonServer) -> None:
    """A one-image request of the profile's opt patch count reaches the engine with exactly the
    shapes the config's CUDA graph was declared for (one frame of folded rows, one frame's ids);
    the stand-in refuses the request otherwise (a graph in other dims would never be used by
    TensorRT)."""
    client = grpcclient.InferenceServerClient(gpu_like_server.grpc_url)
    opt_patches = TARGETS["gpu"].encode.trt_profile.opt_patches
    out = grpc_infer(client, "encode", synthetic_image(448, 448, 5), one_image_uint8=True)  # 32 x 32 patches of 14 px
    assert int(np.prod(out["image_grid_thw"])) == opt_patches


def test_gpu_encode_takes_one_image_per_request(gpu_like_server: TritonServer) -> None:
    client = grpcclient.InferenceServerClient(gpu_like_server.grpc_url)
    two = np.stack([np.frombuffer(synthetic_image(64, 64, 4, "BMP"), np.uint8)] * 2)
    tensor = grpcclient.InferInput("image", list(two.shape), "UINT8")
    tensor.set_data_from_numpy(two)
    with pytest.raises(InferenceServerException) as info:
        client.infer("encode", [tensor])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "unexpected shape for input 'image'" in info.value.message()


def test_gpu_encode_bad_image_is_invalid_arg(gpu_like_server: TritonServer) -> None:
    client = grpcclient.InferenceServerClient(gpu_like_server.grpc_url)
    with pytest.raises(InferenceServerException) as info:
        grpc_infer(client, "encode", b"\xff\xd8\xff" + b"\x13" * 100, one_image_uint8=True)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "image[0] cannot be read" in info.value.message()

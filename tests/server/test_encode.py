"""`preprocess`, `vit_encoder` and the `encode` ensemble over the wire (cpu target).

The cpu target's encode side is not batched: a request carries 0..N encoded images (``image``
BYTES ``[n]``), ``preprocess`` answers every image's folded rows concatenated
(``pixel_values`` ``[rows, image_patch_dim]``, ``image_grid_thw`` ``[n, 3]``) and ``encode``
every image's embeddings concatenated (``image_embeds`` ``[1, tokens, hidden]``).

Parity reference: transformers' own path, ``Qwen2VLImageProcessor`` (torchvision, what
AutoImageProcessor and vLLM load) + ``model.visual(pixel_values, grid_thw)`` in float32.

Tolerances (the tiny default model: random weights, hidden size 128):
- Pixels: ``preprocess`` (the cpu target's torchvision kernels) gives the processor's
  ``pixel_values`` bit for bit, folded to one temporal copy per row (``unfold_temporal`` gives
  the processor's rows back).
- Encoder and end to end (``encode`` vs processor + ``model.visual``): max-abs <= 1e-4, the
  issue's fp32 bound for ONNX Runtime vs torch (measured ~3e-6).
"""

from __future__ import annotations

import concurrent.futures
import io
import re
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from PIL import Image, ImageOps
from tritonclient.utils import InferenceServerException

from builders.repository import TARGETS
from builders.stage_watch import peak_rss
from builders.tritonserver import REPO_ROOT, TritonServer
from python_backends import contract
from python_backends.encode.vit_onnx import unfold_temporal
from tests.images import bilevel_png, synthetic_image, zero_width_png
from tests.server.conftest import LOG_DIR

pytestmark = pytest.mark.server

ENCODER_TOLERANCE = 1e-4


def _encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _picture(width: int, height: int, seed: int) -> Image.Image:
    return Image.open(io.BytesIO(synthetic_image(width, height, seed, "PNG")))


def _rgba(width: int, height: int, seed: int) -> Image.Image:
    image = _picture(width, height, seed).convert("RGBA")
    image.putalpha(Image.fromarray(np.tile(np.linspace(0, 255, width, dtype=np.uint8), (height, 1))))
    return image


PARITY_IMAGES: dict[str, bytes] = {
    "640x480.jpeg": synthetic_image(640, 480, 1),
    "28x28.png": synthetic_image(28, 28, 2, "PNG"),
    "300x1000.webp": _encode(_picture(300, 1000, 3), "WEBP", quality=90),
    "1920x1080.jpeg": synthetic_image(1920, 1080, 4),
    "gray-500x375.png": _encode(_picture(500, 375, 5).convert("L"), "PNG"),
    "rgba-400x300.png": _encode(_rgba(400, 300, 6), "PNG"),
    "2000x60.bmp": _encode(_picture(2000, 60, 7), "BMP"),
}


BOMB = bilevel_png(30000, 30000)
BAD_IMAGES = [
    ("corrupt", b"\xff\xd8\xff" + b"\x13" * 500, "image[0] cannot be read"),
    ("truncated", synthetic_image(640, 480, 8)[:5000], "image[0] cannot be decoded"),
    ("empty", b"", "image[0] is empty"),
    ("zero-size", zero_width_png(), "image[0] cannot be read"),
    ("not an image", b"hello world", "image[0] is neither"),
    ("30000x30000 png bomb", BOMB, f"above the limit of {TARGETS['cpu'].limits['max_image_pixels']} pixels"),
]


# ---------------------------------------------------------------------------------------------
# Clients and references
# ---------------------------------------------------------------------------------------------


def _as_uint8(image: bytes) -> np.ndarray:
    return np.frombuffer(image, dtype=np.uint8)[None]  # [1 image, bytes]: the gpu target's encode


def _as_bytes(images: list[bytes]) -> np.ndarray:
    return np.array(images, dtype=np.object_).reshape(len(images))  # [n images]: the cpu target's


def grpc_infer_many(
    client: grpcclient.InferenceServerClient, model: str, images: list[bytes]
) -> dict[str, np.ndarray]:
    """``images`` in one request (the cpu target's ``preprocess`` and ``encode``: BYTES [n])."""
    data = _as_bytes(images)
    tensor = grpcclient.InferInput("image", list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data)
    result = client.infer(model, [tensor], client_timeout=120)
    return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}


def grpc_infer(
    client: grpcclient.InferenceServerClient, model: str, image: bytes, one_image_uint8: bool = False
) -> dict[str, np.ndarray]:
    """One image: BYTES [1] (cpu target), or with ``one_image_uint8`` UINT8 [1, bytes] (the gpu
    target's ``encode``, tests/server/test_gpu_topology.py)."""
    if not one_image_uint8:
        return grpc_infer_many(client, model, [image])
    data = _as_uint8(image)
    tensor = grpcclient.InferInput("image", list(data.shape), "UINT8")
    tensor.set_data_from_numpy(data)
    result = client.infer(model, [tensor], client_timeout=120)
    return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}


def http_infer(client: httpclient.InferenceServerClient, model: str, image: bytes) -> dict[str, np.ndarray]:
    data = _as_bytes([image])
    tensor = httpclient.InferInput("image", list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data, binary_data=True)
    result = client.infer(model, [tensor])
    return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}


@pytest.fixture(scope="module")
def grpc(server: TritonServer):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def http(server: TritonServer):
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    """transformers' processor + the full Qwen2-VL model (its ``visual`` is what we compare)."""
    from transformers import Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    model = Qwen2VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    visual = getattr(model, "visual", None) or model.model.visual
    return Qwen2VLImageProcessor.from_pretrained(str(model_dir)), visual


def visual_embeds(visual, pixel_values: np.ndarray, grid: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        pixels = torch.from_numpy(np.array(pixel_values, dtype=np.float32))
        out = visual(pixels, grid_thw=torch.from_numpy(np.array(grid, dtype=np.int64)))
    return getattr(out, "pooler_output", out).numpy()


def processor_inputs(processor, data: bytes) -> tuple[np.ndarray, np.ndarray]:
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))  # what transformers' load_image does
    out = processor(images=[image], return_tensors="np")
    return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


# ---------------------------------------------------------------------------------------------
# Parity
# ---------------------------------------------------------------------------------------------


def test_encode_matches_transformers_visual(grpc, reference) -> None:
    processor, visual = reference
    report = []
    for name, data in PARITY_IMAGES.items():
        encoded = grpc_infer(grpc, "encode", data)
        embeds, grid = encoded["image_embeds"], encoded["image_grid_thw"]
        assert embeds.dtype == np.float32 and grid.dtype == np.int64

        # End to end against transformers' own preprocessing + model.visual.
        ref_pixels, ref_grid = processor_inputs(processor, data)
        np.testing.assert_array_equal(grid, ref_grid, err_msg=name)
        expected = visual_embeds(visual, ref_pixels, ref_grid)
        assert embeds.shape == (1, *expected.shape), name
        end_to_end = float(np.abs(embeds[0] - expected).max())
        cosine = float(_cosine(embeds[0], expected).min())

        # The pixels `preprocess` served are the processor's, bit for bit.
        pre = grpc_infer(grpc, "preprocess", data)
        np.testing.assert_array_equal(pre["image_grid_thw"], grid)
        assert pre["pixel_values"].ndim == 2  # [rows, image_patch_dim]: no batch dimension
        np.testing.assert_array_equal(unfold_temporal(pre["pixel_values"], 2), ref_pixels, err_msg=name)

        report.append(f"{name}: grid {grid[0].tolist()} end-to-end {end_to_end:.2e} (min cosine {cosine:.7f})")
        assert end_to_end <= ENCODER_TOLERANCE, report[-1]
    print("\n" + "\n".join(report))


def test_http_gives_the_grpc_numbers(grpc, http) -> None:
    data = PARITY_IMAGES["640x480.jpeg"]
    over_grpc, over_http = grpc_infer(grpc, "encode", data), http_infer(http, "encode", data)
    np.testing.assert_array_equal(over_grpc["image_embeds"], over_http["image_embeds"])
    np.testing.assert_array_equal(over_grpc["image_grid_thw"], over_http["image_grid_thw"])


def _counts(server: TritonServer, model: str) -> tuple[float, float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()

    def value(metric: str) -> float:
        match = re.search(rf'^{metric}\{{model="{model}",version="1"\}} (\S+)$', text, re.M)
        assert match, f"{metric} for {model} missing from /metrics"
        return float(match.group(1))

    return value("nv_inference_request_success"), value("nv_inference_exec_count")


def test_one_request_takes_images_of_different_sizes(grpc) -> None:
    """Several images of different sizes in one request: each image's grid and embeddings are the
    ones it gets alone (one ONNX Runtime call per image on one thread: the same bits whatever else
    is encoded), concatenated in order; preprocess concatenates the rows the same way."""
    images = list(PARITY_IMAGES.values())[:4]
    alone = [grpc_infer(grpc, "encode", image) for image in images]
    together = grpc_infer_many(grpc, "encode", images)
    np.testing.assert_array_equal(together["image_grid_thw"], np.concatenate([a["image_grid_thw"] for a in alone]))
    assert together["image_embeds"].shape[0] == 1
    np.testing.assert_array_equal(together["image_embeds"], np.concatenate([a["image_embeds"] for a in alone], axis=1))
    pixels_alone = [grpc_infer(grpc, "preprocess", image)["pixel_values"] for image in images]
    pixels = grpc_infer_many(grpc, "preprocess", images)
    np.testing.assert_array_equal(pixels["pixel_values"], np.concatenate(pixels_alone))
    np.testing.assert_array_equal(pixels["image_grid_thw"], together["image_grid_thw"])


def test_no_image_gives_empty_tensors(grpc) -> None:
    """``image`` of shape [0]: no rows, no tokens (what the ``ensemble`` hands ``llm`` as no image)."""
    encoded = grpc_infer_many(grpc, "encode", [])
    assert encoded["image_embeds"].shape == (1, 0, 128) and encoded["image_grid_thw"].shape == (0, 3)
    pre = grpc_infer_many(grpc, "preprocess", [])
    assert pre["pixel_values"].shape[0] == 0 and pre["pixel_values"].ndim == 2 and pre["image_grid_thw"].shape == (0, 3)


def test_concurrent_requests_are_unchanged(server, grpc) -> None:
    images = list(PARITY_IMAGES.values()) + [synthetic_image(64 + 8 * i, 48, 20 + i) for i in range(9)]
    alone = [grpc_infer(grpc, "encode", image) for image in images]
    before = {m: _counts(server, m) for m in ("preprocess", "vit_encoder")}
    with concurrent.futures.ThreadPoolExecutor(len(images)) as pool:
        together = list(pool.map(lambda image: grpc_infer(grpc, "encode", image), images))
    for single, concurrent_one in zip(alone, together, strict=True):
        np.testing.assert_array_equal(single["image_grid_thw"], concurrent_one["image_grid_thw"])
        np.testing.assert_array_equal(single["image_embeds"], concurrent_one["image_embeds"])
    for model, (requests_before, _) in before.items():
        requests, _ = _counts(server, model)
        assert requests - requests_before == len(images), model


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def _stub(server: TritonServer, model: str) -> psutil.Process:
    assert server.process is not None
    for child in psutil.Process(server.process.pid).children(recursive=True):
        if f"/{model}/1/model.py" in " ".join(child.cmdline()):
            return child
    raise AssertionError(f"no python backend stub for {model}")


def _peak_rss_mib(process: psutil.Process) -> float:
    return (peak_rss(process.pid) or 0) / 2**20


@pytest.mark.parametrize("model", ["preprocess", "encode"])
@pytest.mark.parametrize(("name", "image", "fragment"), BAD_IMAGES, ids=[b[0] for b in BAD_IMAGES])
def test_bad_image_is_invalid_arg_and_the_server_keeps_serving(
    server, grpc, http, model, name, image, fragment
) -> None:
    with pytest.raises(InferenceServerException) as over_grpc:
        grpc_infer(grpc, model, image)
    # Not decoupled: gRPC unary carries the code.
    assert over_grpc.value.status() == "StatusCode.INVALID_ARGUMENT", over_grpc.value
    assert fragment in over_grpc.value.message()
    with pytest.raises(InferenceServerException) as over_http:
        http_infer(http, model, image)
    assert over_http.value.status() == "400" and fragment in over_http.value.message()
    assert "Traceback" not in over_grpc.value.message() + over_http.value.message()
    smallest = grpc_infer(grpc, model, PARITY_IMAGES["28x28.png"])
    assert smallest["image_grid_thw"].tolist() == [[1, 4, 4]]  # min_pixels: 56x56


def test_a_bad_image_among_several_is_named_by_its_index(grpc) -> None:
    good = PARITY_IMAGES["28x28.png"]
    for model in ("preprocess", "encode"):
        with pytest.raises(InferenceServerException) as info:
            grpc_infer_many(grpc, model, [good, good, b"\xff\xd8\xff" + b"\x13" * 500])
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
        assert "image[2] cannot be read" in info.value.message(), info.value.message()


def test_more_images_than_max_images_per_request_is_invalid_arg(grpc) -> None:
    limit = int(contract.default_of(contract.MAX_IMAGES_PER_REQUEST))
    with pytest.raises(InferenceServerException) as info:
        grpc_infer_many(grpc, "preprocess", [PARITY_IMAGES["28x28.png"]] * (limit + 1))
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert f"above the limit of {limit} (max_images_per_request)" in info.value.message()


def test_bomb_costs_bounded_memory_and_time(server, grpc) -> None:
    stub = _stub(server, "preprocess")
    grpc_infer(grpc, "encode", PARITY_IMAGES["640x480.jpeg"])  # the stub's own peak (torch's import) first
    before = _peak_rss_mib(stub)
    started = time.perf_counter()
    for _ in range(3):
        with pytest.raises(InferenceServerException, match="max_image_pixels"):
            grpc_infer(grpc, "encode", BOMB)
    seconds = (time.perf_counter() - started) / 3
    peak = _peak_rss_mib(stub)
    print(f"\n30000x30000 PNG ({len(BOMB)} bytes): rejected in {seconds * 1e3:.0f} ms; "
          f"preprocess stub peak RSS {before:.0f} -> {peak:.0f} MiB")
    # Decoding it would take >= 900 MiB (gray) or 2.7 GB (RGB); the header check reads ~100 bytes.
    assert peak - before < 100, f"the preprocess process's peak grew from {before:.0f} to {peak:.0f} MiB"
    assert stub.is_running() and _stub(server, "preprocess").pid == stub.pid  # no restart


# ---------------------------------------------------------------------------------------------
# The encoder instance loaded only vision weights
# ---------------------------------------------------------------------------------------------


def test_encoder_instance_loaded_only_the_vision_shards(server, grpc, model_dir: Path) -> None:
    import json

    import onnx
    from onnx import numpy_helper
    from safetensors import safe_open

    from builders.encoder import load_vision_weights

    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    shard_metric = r'^epd_vit_encoder_checkpoint_shards\{model="vit_encoder",shards="(\w+)"\} (\S+)$'
    shards = dict(re.findall(shard_metric, text, re.M))
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    vision_files = {f for k, f in index.items() if k.startswith("visual.")}
    all_files = set(index.values())
    read = {k: float(v) for k, v in shards.items()}
    assert read == {"read": len(vision_files), "total": len(all_files)} == {"read": 1, "total": 2}
    log_lines = (LOG_DIR / "server.log").read_text().splitlines()
    load_line = next(line for line in log_lines if "vit_encoder: loaded" in line)
    assert "exported from 1 of 2 checkpoint shard files" in load_line

    # The served file holds the vision weights and nothing of the language model.
    served = onnx.load(str(REPO_ROOT / "model_repository" / "vit_encoder" / "1" / "model.onnx"))
    onnx_bytes = sum(numpy_helper.to_array(t).nbytes for t in served.graph.initializer)
    vision = load_vision_weights(model_dir)
    vision_bytes = sum(t.numel() * t.element_size() for t in vision.tensors.values())
    all_bytes = 0
    started = time.perf_counter()
    for shard in sorted(all_files):  # what an encoder that loads the whole checkpoint reads
        with safe_open(str(model_dir / shard), framework="pt") as handle:
            all_bytes += sum(handle.get_tensor(k).numel() * handle.get_tensor(k).element_size() for k in handle.keys())
    full_seconds = time.perf_counter() - started
    # All of the vision tower (the exporter folds a few buffers, e.g. rotary frequencies) plus the
    # patch embedding's weights summed over time for folded image rows, and none of the language model.
    conv = vision.tensors["patch_embed.proj.weight"]
    folded_bytes = conv.sum(dim=2).numel() * conv.element_size()
    assert 0.95 * vision_bytes <= onnx_bytes <= vision_bytes + folded_bytes < all_bytes
    metric = re.search(r'^epd_vit_encoder_load_seconds\{model="vit_encoder"\} (\S+)$', text, re.M)
    assert metric, "vit_encoder must export epd_vit_encoder_load_seconds"
    print(
        f"\nvit_encoder: shards read {shards['read']} of {shards['total']}; served ONNX weights {onnx_bytes} B, "
        f"vision weights {vision_bytes} B, full checkpoint {all_bytes} B; "
        f"instance load {float(metric.group(1)):.3f} s; "
        f"vision-shard read {vision.seconds:.4f} s vs full-checkpoint read {full_seconds:.4f} s"
    )

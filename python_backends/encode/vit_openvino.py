"""OpenVINO runner of the exported Qwen2-VL vision tower: the same ``model.onnx`` as
:class:`python_backends.encode.vit_onnx.OnnxVisionEncoder`, optionally in bfloat16.

Why it exists: speed, at a stated accuracy cost. On CPUs with bfloat16 dot products
(``avx512_bf16``, or AMX's ``amx_bf16``) OpenVINO's CPU plugin runs the tower in bf16: on one
AVX512_BF16 core that took 1.7x (tiny checkpoint) to 2.0x (Qwen2-VL-2B's widths) less time than
ONNX Runtime fp32, while the embeddings moved by up to ~2% of their largest value (bf16 keeps
8 mantissa bits; min row cosine 0.9998 against fp32) where fp32 runners agree to ~1e-5.
Numbers and method: docs/benchmarks/encode.md (``python -m bench.vit_precision``). It is
optional and off by default: ONNX Runtime fp32 stays the reference; ``precision="f32"`` gives
fp32 numbers (within 1e-4 of transformers) from OpenVINO, for comparison.

Same contract as the ONNX Runtime runner: one call per image (or video), each call on ONE
thread, up to ``threads`` calls at once. Each call runs on its own OpenVINO stream (an infer
request per concurrent call, ``NUM_STREAMS == INFERENCE_NUM_THREADS == threads``), so an
image goes through the same single-threaded kernels whatever else is being encoded and
whatever the CPU set: bit-identical embeddings for a given CPU type and precision
(tests/unit/test_vit_openvino.py checks 1 vs 3 concurrent calls). OpenVINO caps the stream
count at the cores of the CPU set; extra calls then wait for a free stream.

The graph's dimensions stay dynamic: OpenVINO infers shapes per call and caches the kernels
it builds for each shape, so the first image of a new grid pays that once.

Plain Python: no Triton import.
"""

from __future__ import annotations

import queue
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from python_backends.encode.vit_onnx import (
    META_HIDDEN_SIZE,
    META_MERGE_SIZE,
    META_PATCH_DIM,
    META_TEMPORAL_PATCH_SIZE,
    OUTPUT_NAME,
    EncoderCall,
    VisionRunner,
    VisionShape,
    side_by_side,
    threads_of_cpu_set,
)

if TYPE_CHECKING:  # openvino loads lazily, as onnxruntime does in vit_onnx
    import openvino as ov

Precision = Literal["bf16", "f32"]
PRECISIONS: tuple[Precision, ...] = ("bf16", "f32")
# x86 /proc/cpuinfo flags of hardware bfloat16 dot products (AVX512-BF16, AMX-BF16). Without
# them OpenVINO would quietly run fp32 (or emulate bf16 slowly), so bf16 is refused instead.
BF16_CPU_FLAGS: tuple[str, ...] = ("avx512_bf16", "amx_bf16")
CPUINFO = Path("/proc/cpuinfo")
_METADATA_KEYS = (META_MERGE_SIZE, META_PATCH_DIM, META_TEMPORAL_PATCH_SIZE, META_HIDDEN_SIZE)


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The ``flags`` of the first processor in ``cpuinfo`` (empty where there is no such file)."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def bf16_flags(flags: frozenset[str]) -> tuple[str, ...]:
    """Which of :data:`BF16_CPU_FLAGS` the CPU has."""
    return tuple(flag for flag in BF16_CPU_FLAGS if flag in flags)


def check_precision(precision: str, flags: frozenset[str]) -> Precision:
    """``precision`` if this CPU can run it, else a ValueError that says why."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    if precision == "bf16" and not bf16_flags(flags):
        raise ValueError(
            f"bf16 needs a CPU with {' or '.join(BF16_CPU_FLAGS)} in /proc/cpuinfo flags; this one has "
            "neither: use precision='f32' (or the ONNX Runtime encoder)"
        )
    return "bf16" if precision == "bf16" else "f32"


def _metadata(model: ov.Model, onnx_path: Path) -> dict[str, str]:
    """The exporter's metadata: OpenVINO keeps ONNX ``metadata_props`` under rt_info
    ``framework``; read the ONNX header without weights where it does not."""
    found = {
        key: str(model.get_rt_info(["framework", key]).astype(str))
        for key in _METADATA_KEYS
        if model.has_rt_info(["framework", key])
    }
    if len(found) < len(_METADATA_KEYS):
        import onnx

        props = onnx.load(str(onnx_path), load_external_data=False).metadata_props
        found.update({prop.key: prop.value for prop in props if prop.key in _METADATA_KEYS})
    return found


class OpenVinoVisionEncoder(VisionRunner):
    """One OpenVINO compiled model on CPU, ``threads`` streams of one thread each, an infer
    request per stream; the public surface of :class:`~python_backends.encode.vit_onnx.OnnxVisionEncoder`.
    Thread-safe: concurrent calls wait for a free infer request."""

    def __init__(self, onnx_path: str | Path, threads: int = 0, precision: Precision = "bf16") -> None:
        import openvino as ov  # heavy import stays out of callers that only need the helpers

        self.precision: Precision = check_precision(precision, cpu_flags())
        onnx_path = Path(onnx_path)
        core = ov.Core()
        model = core.read_model(str(onnx_path))
        metadata = _metadata(model, onnx_path)
        missing = [key for key in _METADATA_KEYS if key not in metadata]
        if missing:
            raise ValueError(f"{onnx_path} lacks metadata {missing}: export it with builders.encoder")
        self.shape = VisionShape(*(int(metadata[key]) for key in _METADATA_KEYS))
        self._threads = threads_of_cpu_set(threads)
        self._compiled = core.compile_model(
            model,
            "CPU",
            {
                "INFERENCE_PRECISION_HINT": self.precision,
                # One thread per stream, one stream per concurrent call (the ORT runner's rule).
                "NUM_STREAMS": self._threads,
                "INFERENCE_NUM_THREADS": self._threads,
                # Threads float within the CPU set: two processes on one set would otherwise pin
                # their stream 0 to the same core.
                "ENABLE_CPU_PINNING": False,
                # Never quantize activations on the fly (it only applies to compressed weights).
                "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0,
            },
        )
        streams = int(self._compiled.get_property("NUM_STREAMS"))
        threads_used = int(self._compiled.get_property("INFERENCE_NUM_THREADS"))
        if streams < 1 or threads_used != streams:  # results would depend on the thread count
            raise RuntimeError(f"OpenVINO gave {threads_used} threads for {streams} streams; expected one each")
        self._output = self._compiled.output(OUTPUT_NAME)
        self._requests: queue.SimpleQueue[ov.InferRequest] = queue.SimpleQueue()
        for _ in range(streams):
            self._requests.put(self._compiled.create_infer_request())
        self._pool = side_by_side(streams, "vit-ov")

    def run(self, call: EncoderCall) -> np.ndarray:
        """One image's (or video's) embeddings, on a free infer request (waits for one)."""
        request = self._requests.get()
        try:
            # Inputs are read in place (the call's arrays are contiguous); the output is copied
            # out of the request's buffer before the request serves another call.
            result = request.infer(call.as_feed(), share_inputs=True, share_outputs=False)
            return np.asarray(result[self._output], dtype=np.float32)
        finally:
            self._requests.put(request)

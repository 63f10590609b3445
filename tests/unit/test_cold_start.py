"""bench.cold_start: the per-model breakdown read from a tritonserver log, the report and the plot."""

from __future__ import annotations

import json
from datetime import datetime

from bench.cold_start import load_breakdown, main, markdown, median_of

LOG = """\
I1203 21:17:24.675624 8686 model_lifecycle.cc:472] "loading: encoder_0:1"
I1203 21:17:24.675759 8686 model_lifecycle.cc:472] "loading: preprocess:1"
I1203 21:17:24.678951 8686 python_be.cc:2249] "TRITONBACKEND_ModelInstanceInitialize: preprocess_0_0 (CPU device 0)"
I1203 21:17:24.684899 8686 python_be.cc:2249] "TRITONBACKEND_ModelInstanceInitialize: encoder_0_0_0 (CPU device 0)"
I1203 21:17:25.100000 8686 python_be.cc:2249] "TRITONBACKEND_ModelInstanceInitialize: preprocess_0_1 (CPU device 0)"
I1203 21:17:28.183333 8686 model_lifecycle.cc:839] "successfully loaded 'preprocess'"
I1203 21:17:28.264977 8686 model_lifecycle.cc:839] "successfully loaded 'encoder_0'"
(EngineCore pid=1) INFO 12-03 21:17:28 [core.py:402] init engine took 1.00 s
"""


def test_each_models_load_is_read_relative_to_the_launch():
    launched = datetime(datetime.now().year, 12, 3, 21, 17, 24, 175624).timestamp()
    models = load_breakdown(LOG, launched)
    assert set(models) == {"encoder_0", "preprocess"}
    pre = models["preprocess"]
    assert round(pre["loading"], 3) == 0.500  # the first line of each kind counts (instance 0)
    assert round(pre["instance"], 3) == 0.503
    assert round(pre["loaded"], 3) == 4.008
    assert round(models["encoder_0"]["instance"], 3) == 0.509  # encoder_0_0_0: the model is encoder_0


def test_medians_go_through_nested_runs_and_the_report_lists_every_model():
    runs = [{"ready_s": r, "models": {"m": {"loading": 0.1, "loaded": r}}} for r in (3.0, 1.0, 2.0)]
    assert median_of(runs) == {"ready_s": 2.0, "models": {"m": {"loading": 0.1, "loaded": 2.0}}}
    summary = {"machine": "x", "role": "encoder", "auto_complete_config": False, "repeat": 3,
               "server": median_of(runs), "triton_no_model": {"ready_s": 0.3}, "offline_vllm": None}
    text = markdown(summary)
    assert "| m | 0.1 |  | 2.0 | 1.9 |" in text and "launch -> ready | 2.0 |" in text


def test_the_report_gives_the_cpu_seconds_each_kind_of_process_had_used_at_ready():
    used = {"tritonserver": 0.1, "stub": 30.0, "engine": 5.0, "total": 35.1}
    runs = [{"ready_s": r, "cpu_s_at_ready": used, "models": {}} for r in (20.0, 18.0, 30.0)]
    summary = {"machine": "x", "role": "all", "auto_complete_config": False, "repeat": 3, "server": median_of(runs),
               "triton_no_model": {"ready_s": 0.3}, "offline_vllm": None}
    assert "| 35.1 (0.1, 30.0, 5.0) |" in markdown(summary)


def test_the_plot_puts_every_start_of_a_label_together(tmp_path):
    for name, ready in (("a", 18.0), ("b", 22.0)):
        (tmp_path / name).mkdir()
        start = {"ready_s": ready, "cpu_s_at_ready": {"total": 2 * ready - 2}}
        (tmp_path / name / "cold_start.json").write_text(json.dumps({"runs": {"server": [start, start]}}))
    png = tmp_path / "plot.png"
    assert main(["--plot", str(png), f"same code={tmp_path / 'a'}", f"same code={tmp_path / 'b'}"]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")

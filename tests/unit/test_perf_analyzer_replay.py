"""bench.perf_analyzer_replay without a server: it reads perf_analyzer's --input-data files back to
exactly the tensors perf_analyzer sends, and it names every event that would fail or hang
perf_analyzer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.perf_analyzer import input_data
from bench.perf_analyzer_replay import ReplayResult, RequestTrace, load_entries
from bench.workload import BenchRequest

DATATYPES = {
    "text_input": "BYTES", "image": "BYTES", "stream": "BOOL", "sampling_parameters": "BYTES",
    "exclude_input_in_output": "BOOL",
}  # fmt: skip


@pytest.mark.parametrize("encoding", ["binary", "b64"])
def test_input_data_reads_back_to_the_tensors_perf_analyzer_sends(tmp_path: Path, encoding: str):
    images = (b"\xff\xd8 one", b"\x89PNG\x00 two \x00")  # arbitrary bytes, NULs included
    requests = [
        BenchRequest("a", "prompt a", images, {"max_tokens": 4}),
        BenchRequest("b", "prompt b", (), {"max_tokens": 8}),
    ]
    path = tmp_path / "epd.json"
    path.write_text(json.dumps(input_data(requests, encoding)))
    first, second = load_entries(path, DATATYPES)
    assert first["text_input"].tolist() == [b"prompt a"]
    assert first["stream"].dtype == np.bool_ and first["stream"].tolist() == [True]
    assert json.loads(first["sampling_parameters"][0]) == {"max_tokens": 4}
    assert first["image"].shape == (2,)
    if encoding == "binary":
        assert first["image"].tolist() == list(images)
    else:  # base64 strings, which the models decode themselves
        import base64

        assert [base64.b64decode(x) for x in first["image"].tolist()] == list(images)
    assert "image" not in second


def trace(request_id: str, *, final: bool = True, data: int = 1, error: str = "") -> RequestTrace:
    return RequestTrace(0, request_id, 0, 0.0, [0.0] * (data + 1), data, final, error)


def test_problems_name_what_would_stop_or_hang_perf_analyzer():
    clean = ReplayResult([trace("0"), trace("1")], [], [])
    assert clean.problems() == []
    bad = ReplayResult(
        [trace("0", error="boom"), trace("1", final=False), trace("2", data=0)],
        ["slot 1: got id '7' while '2' ran"],
        ["slot 3 still waiting after the deadline"],
    )
    assert bad.problems() == [
        "slot 0 request 0: boom",
        "slot 3 still waiting after the deadline",
        "response for unknown request id: slot 1: got id '7' while '2' ran",
        "slot 0 request 1: no final response",
        "slot 0 request 2: final response without any output",
    ]

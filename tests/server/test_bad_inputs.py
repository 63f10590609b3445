"""Every kind of bad input in tests/server/bad_input_cases.py, sent to ``epd`` on the session
server: each gets its coded error with a message that names the problem, nothing is INTERNAL,
no traceback reaches the client, the server keeps serving, and the "Bad input" table of
docs/operations.md is exactly what the server said (regenerate it with ``UPDATE_DOCS=1``).

How the code is read: a gRPC stream carries a model's error as a message only, so the requests ask
for errors in the ``error`` output (``errors_as_outputs``: JSON code + message). Triton rejects some
requests itself before the model runs (a tensor of the wrong datatype or shape, an unknown input):
those reach a stream as a message only (and a plain ``ModelInfer`` is refused for a decoupled model
before any input check), so their code is Triton core's for input checks, INVALID_ARG, and the
table says Triton answered them.
"""

from __future__ import annotations

import json
import os
import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from builders.tritonserver import REPO_ROOT, TritonServer
from client.epd_client import GrpcClient, chat_prompt
from tests.server.bad_input_cases import CASES, GOOD, BadInput, docs_table, render_table

pytestmark = [
    pytest.mark.server,
]

OPERATIONS = REPO_ROOT / "docs" / "operations.md"
# Triton core's code for every request it refuses on its own input checks (datatype, shape, names).
TRITON_INPUT_CHECK = "INVALID_ARG"


def _inputs(tensors: dict[str, tuple[str, np.ndarray]], errors_as_outputs: bool) -> list[grpcclient.InferInput]:
    items = dict(tensors)
    if errors_as_outputs:
        items["errors_as_outputs"] = ("BOOL", np.array([True]))
    inputs = []
    for name, (dtype, array) in items.items():
        item = grpcclient.InferInput(name, list(array.shape), dtype)
        item.set_data_from_numpy(array)
        inputs.append(item)
    return inputs


def send(server: TritonServer, case: BadInput) -> tuple[str, str, str]:
    """(code, message, who answered: "epd" or "triton") for one bad request."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer(
            "epd", _inputs(case.tensors(), True), parameters=case.parameters or None, enable_empty_final_response=True
        )
        result, error = answers.get(timeout=300)
        if error is not None:  # Triton's own refusal, before the model: a message without its code
            return TRITON_INPUT_CHECK, error.message(), "Triton"
        payload = result.as_numpy("error")
        if payload is None:  # accepted: the first test names it (one such case must not stop the rest)
            return "none", "(accepted: no error)", "epd"
        fields = json.loads(payload.reshape(-1)[0])
        return fields["code"], fields["message"], "epd"
    finally:
        client.stop_stream()
        client.close()


@pytest.fixture(scope="module")
def answers(server: TritonServer) -> dict[str, tuple[str, str, str]]:
    return {case.kind: send(server, case) for case in CASES}


def test_every_bad_input_gets_its_code_and_a_message_that_names_the_problem(server, answers):
    assert len(CASES) >= 30 and len({case.kind for case in CASES}) == len(CASES)
    wrong = [
        (case.kind, answers[case.kind])
        for case in CASES
        if answers[case.kind][0] != case.code or case.fragment not in answers[case.kind][1]
    ]
    assert not wrong, "\n".join(f"{kind}: got {answer}" for kind, answer in wrong)
    for code, message, _ in answers.values():
        assert "Traceback" not in message and code != "INTERNAL", message
    # Still serving, with the same flag a client that wants codes sends.
    client = GrpcClient(server.grpc_url, "epd")
    try:
        done = client.generate(chat_prompt("Still there?", 1), [GOOD], {"max_tokens": 2, "temperature": 0})
    finally:
        client.close()
    assert done.num_output_tokens == 2


def test_docs_table_is_what_the_server_says(answers):
    rows = [(case.kind, *answers[case.kind]) for case in CASES]
    table = render_table(rows)
    page = OPERATIONS.read_text()
    current = docs_table(page)
    if current is None:
        pytest.fail(f"docs/operations.md has no bad-input table: put the two marker lines of "
                    f"tests/server/bad_input_cases.py in its 'Bad input' section, then rerun with UPDATE_DOCS=1. "
                    f"Table:\n{table}")
    if os.environ.get("UPDATE_DOCS") == "1" and current is not None:
        OPERATIONS.write_text(page.replace(current, table))
        current = table
    assert current == table, (
        "docs/operations.md's bad-input table differs from what the server answers; rerun with UPDATE_DOCS=1 "
        f"to regenerate it. Expected:\n{table}"
    )

"""The E|PD topology against a real server: the encoder models on CPU 0, epd's one engine (prefill
and decode) on CPU 1, every new image encoded by the encoders into the store and handed to the
engine by reference (``--cpus encoders=0 --cpus engines=1 --colocated-encodes encoders``).

Shown here: each stub and what it started (the vLLM engine core, ONNX Runtime's and DALI's
threads) runs inside its model's CPU set; epd answers ``llm``'s greedy tokens on new images
and again from the store, with no engine-side encode (a second request is all store hits).
Only the encoder models and epd are loaded: one vLLM engine, not four. epd runs the default
``adaptive`` policy: in this topology the colocated path dominates (reason ``dominates``), so no
request, probe or not, goes to ``prefill`` or ``decode``, which are not even loaded here.
"""

from __future__ import annotations

import dataclasses
import os
import secrets

import psutil
import pytest

from builders.launcher import prepare
from builders.repository import TARGETS
from builders.roles import role_models
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer
from tests.images import synthetic_image, with_note
from tests.server.conftest import LOG_DIR, NODE_DIR, SLOT, TEST_EXIT_TIMEOUT_S, serving
from tests.server.test_epd_acceptance import VISION, tokens_of
from tests.server.test_epd_paths import metrics_text, path_requests

pytestmark = pytest.mark.server

TWO_CORES = len(os.sched_getaffinity(0)) >= 2


def model_affinities(server: TritonServer) -> dict[str, set[frozenset[int]]]:
    """Per python model: the CPU sets of every thread of its stub and of the stub's children."""
    assert server.process is not None
    seen: dict[str, set[frozenset[int]]] = {}
    for stub in psutil.Process(server.process.pid).children():
        model_py = next((arg for arg in stub.cmdline() if arg.endswith("/model.py")), None)
        if model_py is None:
            continue
        model = model_py.split("/")[-3]
        for process in (stub, *stub.children(recursive=True)):
            for thread in process.threads():
                seen.setdefault(model, set()).add(frozenset(os.sched_getaffinity(thread.id)))
    return seen


@pytest.fixture(scope="module")
def split_server(model_dir) -> TritonServer:
    repository = REPO_ROOT / "build" / "test-slots" / f"epd-split-{SLOT}"
    cache = dataclasses.replace(TARGETS["cpu"].cache, path=str(NODE_DIR / "epd-split-embeddings"))
    prepare("cpu", model_dir, repository, cache=cache, kv_store_path=str(NODE_DIR / "epd-split-kv"),
            cpus=["encoders=0", "engines=1"], colocated_encodes="encoders")  # fmt: skip
    models = (*role_models(TARGETS["cpu"], "encoder"), "epd")
    options = ServerOptions(
        repository, Ports.free(), exit_timeout_s=TEST_EXIT_TIMEOUT_S,
        extra_args=("--model-control-mode=explicit", *(f"--load-model={m}" for m in models)),
    )  # fmt: skip
    with serving(options, LOG_DIR / "epd-split.log") as running:
        yield running


@pytest.mark.skipif(not TWO_CORES, reason="needs two CPUs to give each role one")
def test_each_role_runs_on_its_own_cpu(split_server: TritonServer):
    affinities = model_affinities(split_server)
    for model in ("preprocess", "vit_encoder", "encoder_0", "encoder_1"):
        assert affinities[model] == {frozenset({0})}, (model, affinities[model])
    assert affinities["epd"] == {frozenset({1})}, affinities["epd"]  # its engine core included
    log = split_server.log_path.read_text(errors="replace")
    assert "epd runs on CPUs 1" in log and "vit_encoder runs on CPUs 0" in log


@pytest.mark.skipif(not TWO_CORES, reason="needs two CPUs to give each role one")
def test_epd_answers_llms_tokens_with_the_encoders_encoding(split_server: TritonServer, server: TritonServer):
    sizes = ((320, 240), (256, 256))
    images = [with_note(synthetic_image(w, h, seed=9100 + w), secrets.token_hex(8).encode()) for w, h in sizes]
    prompt = f"{VISION}{VISION}Compare these."
    expected = tokens_of(server, "llm", prompt, images).result.token_ids
    before = path_requests(metrics_text(split_server), "colocated", "dominates")
    first = tokens_of(split_server, "epd", prompt, images)
    assert first.result.token_ids == expected and first.serving_path == "colocated"
    assert first.cache_hits == 0
    again = tokens_of(split_server, "epd", prompt, images)
    assert again.result.token_ids == expected and again.cache_hits == 2  # the encoders stored both
    # adaptive (the default policy) took the colocated path by the dominance rule, both times
    assert path_requests(metrics_text(split_server), "colocated", "dominates") - before == 2

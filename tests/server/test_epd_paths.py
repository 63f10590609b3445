"""epd's serving paths against the real server (issue 14): the ``path`` request parameter, the
``serving_path`` output, the path metrics on /metrics, and no silent switch.

Token equality of every path with ``llm`` on the 18 acceptance prompts is in
test_epd_acceptance.py (one pass over the prompts serves all paths).
"""

from __future__ import annotations

import os
import re
import secrets
import time
import urllib.request

import pytest

from builders.tritonserver import Ports, ServerOptions, TritonServer
from tests.images import synthetic_image, with_note
from tests.server.conftest import LOG_DIR, serving
from tests.server.test_epd_acceptance import GREEDY, stream_generate, tokens_of

pytestmark = pytest.mark.server

PROMPT = "<|vision_start|><|image_pad|><|vision_end|>What is it?"


def metrics_text(server: TritonServer) -> str:
    return urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()


def path_requests(text: str, path: str, reason: str) -> float:
    pattern = rf'^epd_path_requests\{{(?=.*path="{path}")(?=.*reason="{reason}").*\}} (\S+)$'
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.MULTILINE))


def test_each_path_is_served_reported_and_counted(server):
    image = with_note(synthetic_image(320, 240, seed=4242), secrets.token_hex(8).encode())  # new to the store
    before = metrics_text(server)
    forced = {path: tokens_of(server, "epd", PROMPT, [image], path=path) for path in ("colocated", "disaggregated")}
    adaptive = tokens_of(server, "epd", PROMPT, [image])
    assert adaptive.serving_path in ("colocated", "disaggregated")
    assert forced["colocated"].result.token_ids == forced["disaggregated"].result.token_ids == adaptive.result.token_ids
    after = metrics_text(server)
    for path in ("colocated", "disaggregated"):  # counters: sent as each request is served
        assert path_requests(after, path, "forced") - path_requests(before, path, "forced") == 1
    time.sleep(1.5)  # the gauges are state, sent every second (triton_edge/metrics.py's cost rule)
    after = metrics_text(server)
    for gauge in ("epd_path_last_decision", "epd_path_in_flight", "epd_path_probe_interval_s"):
        assert f"{gauge}{{" in after, gauge
    # The cost model's inputs: what each path measured, per stage and image-size bucket.
    for path, stage in (("colocated", "first_token/media"), ("disaggregated", "prefill"), ("disaggregated", "encode")):
        assert re.search(rf'^epd_path_estimate_ms\{{(?=.*path="{path}")(?=.*stage="{stage}").*\}} \S+$', after, re.M)


def test_a_bad_path_is_a_coded_error_and_the_server_keeps_serving(server):
    answer = stream_generate(server.grpc_url, "epd", "Hello", [], GREEDY, parameters={"path": "fastest"})
    assert answer.error is not None and "request parameter 'path' must be one of" in answer.error
    assert tokens_of(server, "epd", "Hello", [], path="disaggregated").result.token_ids


def test_forcing_a_path_this_epd_does_not_serve_is_unavailable_not_a_switch(server, tmp_path):
    """An epd with ``path_policy`` disaggregated runs no colocated engine: a request forcing
    ``colocated`` gets UNAVAILABLE, naming the policy, before any stage works on it. Served
    alone (explicit model control), so no engine starts and the server is up in seconds."""
    repository = tmp_path / "repository"
    repository.mkdir()
    source = server.options.model_repository
    for entry in os.listdir(source):
        if entry != "epd":
            (repository / entry).symlink_to(source / entry)
    (repository / "epd" / "1").mkdir(parents=True)
    for name in ("model.py", "engine_args.json"):  # the engine args name the checkpoint (its generation_config)
        (repository / "epd" / "1" / name).symlink_to(source / "epd" / "1" / name)
    config = (source / "epd" / "config.pbtxt").read_text()
    policy = re.compile(r'(key: "path_policy"\s*value: \{\s*string_value: )"adaptive"')
    assert policy.search(config), "the generated epd config has no path_policy"
    (repository / "epd" / "config.pbtxt").write_text(policy.sub(r'\1"disaggregated"', config))
    options = ServerOptions(
        repository, Ports.free(), extra_args=("--model-control-mode=explicit", "--load-model=epd"), exit_timeout_s=60
    )
    with serving(options, LOG_DIR / "epd-disaggregated-only.log", timeout_s=300) as alone:
        answer = stream_generate(alone.grpc_url, "epd", "Hello", [], GREEDY, parameters={"path": "colocated"})
        assert answer.error is not None
        assert "path 'colocated' is not available on this epd" in answer.error
        assert "path_policy=disaggregated" in answer.error
        assert "epd_epd_unfinished_requests" not in metrics_text(alone)  # no engine was started

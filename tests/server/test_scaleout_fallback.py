"""Scale-out local fallback on loopback (issue 13, item 5): an ``all`` server given
``--remote-encoders`` serves its own encoder models too; while its one remote encoder is up the
images go there, and once that encoder is SIGKILLed every request is still answered (llm's
tokens), encoded on the server's own ``encoder_<i>`` (``epd_routing_decisions{decision=
"local_fallback"}``). A ``pd`` server, which has none, answers UNAVAILABLE instead
(tests/server/test_scaleout.py). Its own module: the 3-server topology is stopped first.
"""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from builders.tritonserver import TritonServer
from client.epd_client import chat_prompt
from tests.images import synthetic_image, with_note
from tests.server.conftest import LOG_DIR, serving
from tests.server.test_epd_acceptance import metric, stream_generate, tokens_of
from tests.server.test_scaleout import _encoded_on, _server, _text, _wait_for

pytestmark = [
    pytest.mark.timeout(2400),
    pytest.mark.server,
    pytest.mark.skipif(not os.environ.get("TRITON_EPD_SCALEOUT_TESTS"), reason="run with `make test-scaleout`"),
]


@pytest.fixture(scope="module")
def pair(model_dir: Path, node_dir: Path) -> Iterator[tuple[TritonServer, TritonServer]]:
    store_x, store_y = str(node_dir / "fallback-node-x"), str(node_dir / "fallback-node-y")
    options_x = _server("x", node_dir, model_dir, "encoder", "node-x", store_x)
    with serving(options_x, LOG_DIR / "scaleout-fallback-encoder.log") as encoder:
        remote = f"127.0.0.1:{encoder.options.ports.grpc}"
        options_y = _server("y", node_dir, model_dir, "all", "node-y", store_y, remote_encoders=remote)
        with serving(options_y, LOG_DIR / "scaleout-fallback-all.log") as server:
            yield encoder, server


def test_an_all_server_falls_back_to_its_own_encoders_when_none_is_left(
    pair: tuple[TritonServer, TritonServer],
) -> None:
    encoder, server = pair
    address = f"127.0.0.1:{encoder.options.ports.grpc}"
    note = f"fallback {secrets.token_hex(8)}".encode()
    prompt, sampling = chat_prompt("What is this?", 1), {"max_tokens": 4, "temperature": 0.0}
    images = [with_note(synthetic_image(96 + 4 * (i % 4), 96, 300 + i, "PNG"), note) for i in range(16)]
    expected = [tokens_of(server, "llm", prompt, [image], sampling).result.token_ids for image in images]
    admitted = _wait_for(lambda: f'endpoint="{address}"' in _text(server), 60)
    assert admitted, f"{address} was not admitted (its metrics are exported once it is)"
    local_before = _encoded_on(server)

    for image, want in zip(images[:4], expected[:4], strict=True):  # the remote encoder is up
        assert tokens_of(server, "epd", prompt, [image], sampling).result.token_ids == want
    assert _encoded_on(encoder) >= 4 and _encoded_on(server) == local_before
    assert metric(server, "epd_routing_decisions", decision="local_fallback") == 0

    os.killpg(encoder.group.pid, signal.SIGKILL)
    try:
        with ThreadPoolExecutor(4) as pool:  # the rest at c=4, with no remote encoder left
            answers = list(pool.map(lambda image: stream_generate(server.grpc_url, "epd", prompt, [image], sampling),
                                    images[4:]))  # fmt: skip
        errors = [a.error for a in answers if a.error is not None]
        assert not errors, errors
        assert [a.result.token_ids for a in answers] == expected[4:]
        assert _encoded_on(server) - local_before == len(images) - 4  # each encoded here, once
        fell_back = _wait_for(
            lambda: metric(server, "epd_routing_decisions", decision="local_fallback") == len(images) - 4, 10
        )
        assert fell_back, metric(server, "epd_routing_decisions", decision="local_fallback")
    finally:  # restarted, so that the fixture's stop is a clean one
        encoder.group.log_path = LOG_DIR / "scaleout-fallback-encoder-restarted.log"
        encoder.start()
        encoder.wait_ready(timeout_s=600)

"""python_backends' logging reaches Triton's log (triton_edge.logs), with the pb_utils stub."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from python_backends.triton_edge.logs import ROOT, TritonLogHandler, route_to_triton_log
from tests.unit.conftest import _Logger


@pytest.fixture
def routed() -> Iterator[list[str]]:
    root = logging.getLogger(ROOT)
    saved = (root.handlers[:], root.level, root.propagate)
    # A model another unit test initialized has already routed this process's logs under its name.
    root.handlers[:] = [handler for handler in root.handlers if not isinstance(handler, TritonLogHandler)]
    _Logger.messages.clear()
    route_to_triton_log("epd")
    yield _Logger.messages
    root.handlers[:], root.level, root.propagate = saved
    _Logger.messages.clear()


def test_module_lines_reach_triton_log_with_model_and_module(routed: list[str]) -> None:
    log = logging.getLogger("python_backends.scaleout.remote")
    log.info("encoder %s admitted", "127.0.0.1:8001")
    log.warning("refused")
    log.debug("not at INFO")
    assert routed == [
        "epd python_backends.scaleout.remote: encoder 127.0.0.1:8001 admitted",
        "epd python_backends.scaleout.remote: refused",
    ]


def test_second_model_in_the_process_adds_no_second_handler(routed: list[str]) -> None:
    route_to_triton_log("llm")
    handlers = [h for h in logging.getLogger(ROOT).handlers if isinstance(h, TritonLogHandler)]
    assert len(handlers) == 1
    logging.getLogger("python_backends.store").error("once")
    assert routed == ["epd python_backends.store: once"]


def test_other_libraries_are_not_routed(routed: list[str]) -> None:
    logging.getLogger("vllm.engine").warning("vLLM configures its own")
    assert routed == []

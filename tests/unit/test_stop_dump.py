"""tests/server/stop_dump.py's reading of a stuck stop: which models are still loaded, whether
Triton alone holds them, and the stack summary (the real-server checks are in
tests/server/test_server_stop.py and ``make cancel-storm``)."""

from __future__ import annotations

from tests.server.stop_dump import held_by_triton, models_still_loaded, summarize_stacks

LOG = """
I1201 successfully loaded 'llm'
I1201 successfully loaded 'epd'
I1201 successfully loaded 'ensemble'
I1201 successfully unloaded 'epd' version 1
I1201 successfully unloaded 'ensemble' version 1
I1201 successfully loaded 'ensemble'
"""

IDLE = """
# HELP epd_llm_running_requests Requests the llm model is still serving
epd_llm_running_requests{model="llm"} 0
epd_epd_running_requests{model="epd"} 0
epd_epd_bls_open_streams{model="epd"} 0
nv_inference_request_success{model="llm",version="1"} 12
"""


def test_models_loaded_more_often_than_unloaded_are_still_loaded() -> None:
    assert models_still_loaded(LOG) == ["ensemble", "llm"]


def test_only_a_model_of_ours_that_holds_nothing_and_still_beats_is_held_by_triton() -> None:
    assert held_by_triton(["llm"], IDLE, {"llm": True}, connections=0)
    assert held_by_triton(["llm", "epd"], IDLE, {"llm": True, "epd": True}, connections=0)
    # A request of ours that never ended, an open BLS stream: ours to fix.
    assert not held_by_triton(["llm"], IDLE.replace('"llm"} 0', '"llm"} 1'), {"llm": True}, 0)
    open_stream = IDLE.replace('open_streams{model="epd"} 0', 'open_streams{model="epd"} 2')
    assert not held_by_triton(["epd"], open_stream, {"epd": True}, 0)
    # A stub whose heartbeat stopped: it began finalize, or runs no Python any more (a deadlock).
    assert not held_by_triton(["llm"], IDLE, {"llm": False}, 0)
    # A stream this test process left open; a model without our counters; nothing stuck at all.
    assert not held_by_triton(["llm"], IDLE, {"llm": True}, connections=1)
    assert not held_by_triton(["ensemble"], IDLE, {"ensemble": True}, 0)
    assert not held_by_triton([], IDLE, {}, 0)
    assert not held_by_triton(["llm"], "<failed: URLError()>", {"llm": True}, 0)  # /metrics unread


def test_the_stack_summary_keeps_each_threads_first_named_frames() -> None:
    stacks = """Process 1: stub
Thread 10 (idle): "MainThread"
    0x7f5dc62a3f16 (libc.so.6)
    0x7f5dc62aeb8b (libc.so.6)
Thread 11 (active): "epd-event-loop"
    epoll_wait (libc.so.6)
    select_epoll_poll_impl (selectmodule.c:1598)
    select_epoll_poll (selectmodule.c.h:841)
    EpollSelector.select (selectors.py:468)
"""
    assert summarize_stacks(stacks, frames=2) == [
        '  Thread 10 (idle): "MainThread"',
        '  Thread 11 (active): "epd-event-loop"',
        "      epoll_wait (libc.so.6)",
        "      select_epoll_poll_impl (selectmodule.c:1598)",
    ]

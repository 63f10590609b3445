"""An asyncio event loop on a background thread, for Triton python models.

Triton calls ``execute`` on the stub's main thread; vLLM's AsyncLLM and our pipelines
are asyncio. Every coroutine submitted here is tracked until it finishes, so no future
is lost and ``stop`` can wait for (or cancel) what is still running.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class EventLoopThread:
    def __init__(self, name: str = "epd-event-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()  # submitted ones now running (loop thread only)
        self._lock = threading.Lock()
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (for initialize/finalize)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Fire-and-track: the coroutine must report its own errors to its client."""
        future = asyncio.run_coroutine_threadsafe(self._tracked(coro), self.loop)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._finished)
        return future

    async def _tracked(self, coro: Coroutine[Any, Any, T]) -> T:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            return await coro
        finally:
            self._tasks.discard(task)

    def _finished(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.error("request task failed", exc_info=future.exception())

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def stop(
        self, timeout_s: float = 10.0, last: Callable[[], None] | None = None, last_timeout_s: float = 30.0
    ) -> None:
        """Cancel every submitted coroutine and wait (up to ``timeout_s``) until each has run its
        cleanup -- a cancelled request still aborts its engine request and ends its stream --
        then run ``last`` on the loop, then stop the loop and its thread.

        ``last`` is for a library whose shutdown schedules its own cleanup on this loop (vLLM's
        AsyncLLM closes its sockets and cancels its output handler there, or with
        ``call_soon_threadsafe`` from another thread): run on the loop, that cleanup happens; run
        after the loop stopped, it never would. It gets ``last_timeout_s`` more."""

        async def cancel_submitted() -> None:
            await asyncio.sleep(0)  # coroutines submitted just before start running
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout_s)
            if last is not None:
                last()
                await asyncio.sleep(0)  # what ``last`` scheduled on the loop runs

        if self.loop.is_running():
            budget = timeout_s + 1.0 + (last_timeout_s if last is not None else 0.0)
            try:
                asyncio.run_coroutine_threadsafe(cancel_submitted(), self.loop).result(budget)
            except Exception:
                log.warning("tasks still running when the event loop stopped", exc_info=True)
        elif last is not None:
            last()
        with self._lock:
            never_started = list(self._pending)
        for future in never_started:
            future.cancel()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)

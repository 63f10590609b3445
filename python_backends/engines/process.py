"""A vLLM engine inside a python model's process: started from the model's folder
(:func:`start_hosted_engine`), and its engine core process dying with the stub that started it.

vLLM 0.32's engine core (a child process, forked or spawned) does not notice while idle that its
parent died: after the epd stub crashed on 2026-12-02 its engine core kept ~1.7 GB and its 1 GiB KV
cache for over an hour, and the next server on the machine could not allocate its own. So
:func:`engine_cores_die_with_parent` wraps vLLM's engine-core entry point: in the engine core, a
daemon thread checks every second that its parent is still the process that started it, and ends
the process when not (a stub killed with SIGKILL gets no say; Triton's stop is unaffected).
"""

from __future__ import annotations

import gc
import importlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PARENT_CHECK_S = 1.0

_original: Callable[..., Any] | None = None  # vLLM's entry point, in this process once wrapped


def exit_when_orphaned(parent: int, period_s: float = PARENT_CHECK_S) -> threading.Thread:
    """Exit this process (no cleanup: its parent, which owns it, is gone) once ``parent`` is no
    longer its parent."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name="epd-parent-watch", daemon=True)
    thread.start()
    return thread


def _run_engine_core(*args: Any, **kwargs: Any) -> Any:
    exit_when_orphaned(os.getppid())
    original = _original
    if original is None:  # a spawned engine core imported vLLM afresh: its entry point is vLLM's own
        from vllm.v1.engine.core import EngineCoreProc

        original = EngineCoreProc.run_engine_core
    return original(*args, **kwargs)


def engine_cores_die_with_parent() -> None:
    """Wrap ``EngineCoreProc.run_engine_core`` (once) before this process starts a vLLM engine."""
    global _original
    from vllm.v1.engine.core import EngineCoreProc

    if _original is None:
        _original = EngineCoreProc.run_engine_core
        EngineCoreProc.run_engine_core = staticmethod(_run_engine_core)  # type: ignore[method-assign]


# What starting an engine imports of vLLM (and with it torch, transformers, torch._inductor).
VLLM_MODULES = ("vllm.engine.arg_utils", "vllm.v1.engine.async_llm", "vllm.v1.engine.core", "vllm.v1.executor")


def import_vllm_frozen(modules: tuple[str, ...] = VLLM_MODULES) -> None:
    """Import ``modules`` with the cyclic GC paused, then freeze what they allocated (``gc.freeze``:
    never traversed again). The import makes millions of long-lived objects that each collection
    during it walks again: paused and frozen, a stub's start took 1.3 CPU-s less and its forked
    engine core's 0.7 (it inherits the frozen heap), 4 engines on 2 cores (docs/benchmarks/cold-start.md).
    A pause without the freeze gained nothing: the collections came after, over the same heap."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        for module in modules:
            importlib.import_module(module)
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def start_hosted_engine(
    engine_type: Any, environment: dict[str, str], engine_args_file: Path, run: Callable[[Any], Any]
) -> Any:
    """Start ``engine_type`` (``LlmEngine``, ``PrefillEngine``, ``DecodeEngine``: a classmethod
    ``start(engine_args)`` coroutine) from ``engine_args.json`` beside the model, after applying
    the model's ``VLLM_*`` and ``OMP_*`` parameters (``environment``: read at engine start).
    ``run``: runs a coroutine to completion on the model's event loop."""
    from python_backends.engines.llm import apply_vllm_environment, load_engine_args

    apply_vllm_environment(environment)
    import_vllm_frozen()
    engine_cores_die_with_parent()  # a crashed stub leaves no engine core behind
    return run(engine_type.start(load_engine_args(engine_args_file)))

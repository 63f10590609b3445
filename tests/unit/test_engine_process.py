"""A vLLM engine core process dies with the stub that started it (python_backends/engines/process.py).

Real processes: pytest -> a "stub" process -> a child that runs ``exit_when_orphaned`` for its
parent, as the wrapped engine-core entry point does. The stub is SIGKILLed, as a crashed stub dies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from python_backends.engines import process as engine_process

REPO = Path(__file__).resolve().parents[2]

STUB = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
    print(child.pid, flush=True)
    time.sleep(600)
""")

ENGINE_CORE = textwrap.dedent("""
    import os, time
    from python_backends.engines.process import exit_when_orphaned
    exit_when_orphaned(os.getppid(), period_s=0.05)
    print("watching", flush=True)
    time.sleep(600)
""")


def running(pid: int) -> bool:
    """Alive and not a zombie (this machine's PID 1 does not reap orphans)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_child_exits_once_its_parent_is_killed() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    stub = subprocess.Popen([sys.executable, "-c", STUB, ENGINE_CORE], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert stub.stdout is not None
        child = int(stub.stdout.readline())
        # The child watches the parent it has when it starts; killed before that, its parent is
        # already init (a loaded machine starts Python slowly), and nothing is tested.
        assert stub.stdout.readline().strip() == "watching"
        time.sleep(0.3)
        assert running(child)  # its parent is alive: it stays
        stub.send_signal(signal.SIGKILL)
        stub.wait(10)
        deadline = time.monotonic() + 10
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(child), "the child outlived its killed parent"
    finally:
        stub.kill()


def test_vllm_engine_core_entry_point_is_wrapped_once() -> None:
    from vllm.v1.engine.core import EngineCoreProc

    original = EngineCoreProc.run_engine_core
    try:
        engine_process.engine_cores_die_with_parent()
        engine_process.engine_cores_die_with_parent()
        assert EngineCoreProc.run_engine_core is engine_process._run_engine_core
        assert engine_process._original is original
    finally:
        if engine_process._original is not None:
            EngineCoreProc.run_engine_core = staticmethod(engine_process._original)
        engine_process._original = None


def test_vllm_is_imported_with_the_gc_paused_and_its_heap_frozen() -> None:
    # In a fresh interpreter: the freeze is process-wide, and the module must not be imported yet.
    script = textwrap.dedent(
        """
        import gc, sys
        from python_backends.engines.process import import_vllm_frozen
        collections = []
        gc.callbacks.append(lambda phase, info: collections.append(phase) if phase == "start" else None)
        import_vllm_frozen(("json.tool", "email.mime.text"))
        assert "json.tool" in sys.modules and "email.mime.text" in sys.modules
        assert collections == [], collections  # no collection ran during the import
        assert gc.isenabled() and gc.get_freeze_count() > 0
        gc.disable()
        import_vllm_frozen(("tomllib",))
        assert not gc.isenabled()  # a caller's paused GC stays paused
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)

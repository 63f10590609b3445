"""Starting, driving and stopping one vLLM ``AsyncLLM``: what every engine wrapper shares.

Who calls it: ``engines/llm.py`` (``LlmEngine``, the colocated engine of ``llm`` and ``epd``)
and ``pd/engines.py`` (``PrefillEngine`` / ``DecodeEngine``). It holds the engine's start
(:func:`start_async_llm`), its one shutdown (:func:`shut_down_engine`), the unfinished-request
count, the sampling parameters a request runs with (:func:`sampling_params`, :func:`output_kind`)
and how vLLM's refusals of an input become INVALID_ARG (:func:`input_rejections`). vLLM is
imported inside the functions, so importing this module costs nothing.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from python_backends.errors import invalid_arg

# Seconds an engine-core process gets to exit at shutdown before vLLM's process manager kills it
# (vLLM's default: 5). Its last step is ``gc.unfreeze(); gc.collect()`` over its whole heap
# (vllm/distributed/parallel_state.py, cleanup_dist_env_and_memory): ~3 s idle and 5 s (killed)
# under load on 2 cores, after its requests, executor and scheduler are already shut down. A CPU
# engine holds nothing a kill would leak (no device memory), so the cpu target does not wait that
# collection out; GPU targets keep vLLM's default (a kill during teardown can leave VRAM resident).
ENGINE_EXIT_GRACE_ENV = "VLLM_EPD_ENGINE_EXIT_GRACE_S"

# How the engine-core process starts: "fork" or "spawn" (unset: vLLM's choice). vLLM's CPU platform
# always says spawn (0.32, CpuPlatform.check_and_update_config), and a spawned engine core imports
# torch and vLLM again: ~7 CPU-seconds per engine, most of a server's start on 2 cores. Forked from
# a stub that has imported them it starts at once (docs/benchmarks/cold-start.md). Only where no
# device is initialised in the stub: the gpu target keeps spawn (never fork a CUDA process).
ENGINE_START_ENV = "VLLM_EPD_ENGINE_START"
START_METHODS = ("fork", "spawn")


async def start_async_llm(engine_args: Mapping[str, Any]) -> Any:
    """A vLLM AsyncLLM built from ``engine_args`` (AsyncEngineArgs fields), its engine core
    started the way ``VLLM_EPD_ENGINE_START`` says. ``AsyncLLM.from_engine_args`` unrolled: the
    start method must be set after the platform has chosen its own (in ``create_engine_config``)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor import Executor

    args = AsyncEngineArgs(**engine_args)
    vllm_config = args.create_engine_config()
    with _engine_start_method(engine_start_method()):
        return AsyncLLM(
            vllm_config=vllm_config,
            executor_class=Executor.get_class(vllm_config),
            log_requests=args.enable_log_requests,
            log_stats=not args.disable_log_stats,
        )


def engine_start_method(environ: Mapping[str, str] = os.environ) -> str | None:
    """``VLLM_EPD_ENGINE_START`` checked, or None (unset: vLLM's choice)."""
    method = environ.get(ENGINE_START_ENV) or None
    if method is not None and method not in START_METHODS:
        raise ValueError(f"{ENGINE_START_ENV}={method!r}: expected one of {', '.join(START_METHODS)}")
    return method


@contextmanager
def _engine_start_method(method: str | None) -> Iterator[None]:
    """vLLM reads its start method from the environment when it starts a process; the stub's
    environment gets it back afterwards."""
    if method is None:
        yield
        return
    key = "VLLM_WORKER_MULTIPROC_METHOD"
    before = os.environ.get(key)
    os.environ[key] = method
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def engine_exit_grace_s(environ: Mapping[str, str] = os.environ) -> float | None:
    """The engine core's exit grace (``VLLM_EPD_ENGINE_EXIT_GRACE_S``), or None: vLLM's default."""
    value = environ.get(ENGINE_EXIT_GRACE_ENV)
    if value is None or value == "":
        return None
    try:
        grace = float(value)
    except ValueError:
        raise ValueError(f"{ENGINE_EXIT_GRACE_ENV}={value!r}: expected seconds, e.g. 2") from None
    if not grace > 0:
        raise ValueError(f"{ENGINE_EXIT_GRACE_ENV}={value!r}: must be > 0 (0 would kill the engine at once)")
    return grace


def shut_down_engine(async_llm: Any) -> None:
    """Shut a vLLM AsyncLLM down now (its engine core exits within ``engine_exit_grace_s``), once.

    ``AsyncLLM.__del__`` (0.32) shuts it down again when the object goes. An engine held until its
    stub exits goes during interpreter shutdown, after vLLM's module globals are gone, and every
    server stop logged ``TypeError: 'NoneType' object is not callable`` from there, once per engine.
    So the instance becomes one of a subclass whose ``__del__`` does nothing: it was shut down here."""
    async_llm.shutdown(timeout=engine_exit_grace_s())
    cls: type = type(async_llm)
    async_llm.__class__ = _already_shut_down(cls)


@functools.cache
def _already_shut_down(cls: type) -> type:
    return type(cls)(cls.__name__, (cls,), {"__del__": lambda self: None, "__module__": cls.__module__})


def unfinished_requests(async_llm: Any) -> int:
    """Requests a vLLM AsyncLLM still tracks; zero when idle, so a leak after cancel shows here.
    The one place that reaches into vLLM for it: AsyncLLM 0.32 has no public count."""
    return int(async_llm.output_processor.get_num_unfinished_requests())


def output_kind(stream: bool) -> Any:
    """vLLM's output kind: new tokens per output when streaming, else the final output only."""
    from vllm.sampling_params import RequestOutputKind

    return RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY


def sampling_params(sampling: Mapping[str, Any], **overrides: Any) -> Any:
    """``vllm.SamplingParams`` of a request's parsed ``sampling_parameters`` with ``overrides``
    (e.g. ``output_kind``, a split's ``max_tokens``); vLLM's own cross-field checks -> INVALID_ARG."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import StructuredOutputsParams

    fields = {**sampling, **overrides}
    try:
        if fields.get("structured_outputs") is not None:
            fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
        if fields.get("logit_bias") is not None:  # JSON keys are text; vLLM takes token ids
            fields["logit_bias"] = {int(token): float(bias) for token, bias in fields["logit_bias"].items()}
        return SamplingParams(**fields)
    except (ValueError, TypeError, VLLMClientError) as exc:  # vLLM's validation error is not a ValueError
        raise invalid_arg(f"invalid sampling_parameters: {exc}") from None


@contextmanager
def input_rejections(engine: str) -> Iterator[None]:
    """vLLM refuses input it cannot serve (prompt above the context, bad image) with ValueError
    or, for validation, VLLMClientError (not a ValueError in 0.32): INVALID_ARG with vLLM's
    message. ``AsyncLLM.generate`` (0.32) wraps a ValueError raised while it processes the input
    (e.g. "Cache miss" for an item sent as None that its cache no longer holds) in
    EngineGenerateError: that one is the input's fault too. Anything else goes on as it is."""
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineGenerateError

    refusals = (ValueError, VLLMClientError)
    try:
        yield
    except refusals as exc:
        raise invalid_arg(f"request rejected by the {engine}: {exc}") from None
    except EngineGenerateError as exc:
        if not isinstance(exc.__cause__, refusals):
            raise
        raise invalid_arg(f"request rejected by the {engine}: {exc.__cause__}") from None

"""The colocated vLLM engine behind the ``llm`` model (the baseline of every mode).

Triton-free: takes a :class:`GenerateRequest` and decoded images, yields
:class:`GenerationChunk`s. ``model.py`` turns chunks into Triton responses. Also the two
steps every vLLM-serving model takes before its engine starts: :func:`apply_vllm_environment`
and :func:`load_engine_args`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from python_backends.engines.generation import GenerationChunk
from python_backends.engines.videos import LoadedVideo
from python_backends.errors import EpdError, ErrorCode, invalid_arg
from python_backends.request.generate import GenerateRequest

log = logging.getLogger(__name__)


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


def load_engine_args(path: Path) -> dict[str, Any]:
    """Engine args (vLLM's AsyncEngineArgs fields) from the JSON file beside the model."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: generate the repository with `python -m builders.repository`"
        )
    args = json.loads(path.read_text())
    if not isinstance(args, dict) or "model" not in args:
        raise ValueError(f"{path} must be a JSON object with at least a 'model' field")
    if not Path(args["model"]).is_dir():
        raise FileNotFoundError(
            f"model directory {args['model']} (from {path}) does not exist: build the "
            "default model with `python -m builders.default_model` or point 'model' at a "
            "Qwen2-VL checkpoint"
        )
    return args


# The engine's GPU (builders/targets.py, GpuBudget): a VLLM_ parameter so that it travels with the
# others; it becomes CUDA_VISIBLE_DEVICES, which the engine processes vLLM spawns start with.
ENGINE_GPUS_ENV = "VLLM_EPD_CUDA_VISIBLE_DEVICES"
# Seconds an engine-core process gets to exit at shutdown before vLLM's process manager kills it
# (vLLM's default: 5). Its last step is ``gc.unfreeze(); gc.collect()`` over its whole heap
# (vllm/distributed/parallel_state.py, cleanup_dist_env_and_memory): ~3 s idle and 5 s (killed)
# under load on 2 cores, after its requests, executor and scheduler are already shut down. A CPU
# engine holds nothing a kill would leak (no device memory), so the cpu target does not wait that
# collection out; GPU targets keep vLLM's default (a kill during teardown can leave VRAM resident).
ENGINE_EXIT_GRACE_ENV = "VLLM_EPD_ENGINE_EXIT_GRACE_S"
OMP_THREADS_ENV = "OMP_NUM_THREADS"


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


def apply_vllm_environment(vllm_env: dict[str, str]) -> None:
    """Set the engine's ``VLLM_*`` and ``OMP_*`` variables (a model's parameters) in this process's
    environment: vLLM reads them when its engine starts, in this process and the ones it spawns
    (the engine core's torch reads ``OMP_NUM_THREADS`` as it starts). This process's own torch
    started before (vLLM's input processing runs here): its threads are set too."""
    os.environ.update(vllm_env)
    log.info("vLLM engine environment: %s", " ".join(f"{key}={value}" for key, value in sorted(vllm_env.items())))
    if OMP_THREADS_ENV in vllm_env:
        import torch

        torch.set_num_threads(int(vllm_env[OMP_THREADS_ENV]))
    if ENGINE_GPUS_ENV in vllm_env:
        os.environ["CUDA_VISIBLE_DEVICES"] = vllm_env[ENGINE_GPUS_ENV]


def unfinished_requests(async_llm: Any) -> int:
    """Requests a vLLM AsyncLLM still tracks; zero when idle, so a leak after cancel shows here.
    The one place that reaches into vLLM for it: AsyncLLM 0.32 has no public count."""
    return int(async_llm.output_processor.get_num_unfinished_requests())


@dataclass
class LlmEngine:
    """Owns one vLLM AsyncLLM. All methods run on the event loop thread."""

    engine: Any  # vllm.v1.engine.async_llm.AsyncLLM
    active_requests: set[str] = field(default_factory=set)

    @classmethod
    async def start(cls, engine_args: dict[str, Any]) -> LlmEngine:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
        return cls(engine)

    def sampling_params(self, request: GenerateRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        try:
            return SamplingParams(**request.sampling, output_kind=kind)
        except (ValueError, TypeError) as exc:  # vLLM's own cross-field checks
            raise invalid_arg(f"invalid sampling_parameters: {exc}") from None

    async def generate(
        self,
        request: GenerateRequest,
        images: list[Image.Image],
        request_id: str,
        videos: Sequence[LoadedVideo] = (),
    ) -> AsyncIterator[GenerationChunk]:
        """``videos``: what vLLM's own loader returned (python_backends.engines.videos.load_videos)."""
        mm_data: dict[str, Any] = {}
        if request.image_embeds is not None:
            mm_data.update(request.image_embeds.multi_modal_data())
        elif images:
            mm_data["image"] = images
        if videos:
            mm_data["video"] = list(videos)
        prompt: dict[str, Any] = {"prompt": request.prompt}
        if mm_data:
            prompt["multi_modal_data"] = mm_data
        async for chunk in self.generate_prompt(prompt, request, request_id):
            yield chunk

    async def generate_prompt(
        self, prompt: dict[str, Any], request: GenerateRequest, request_id: str
    ) -> AsyncGenerator[GenerationChunk, None]:
        """Serve ``request`` with ``prompt`` as vLLM's input (text plus ``multi_modal_data``, media
        or embeddings, and ``multi_modal_uuids``): ``epd``'s colocated path builds its own."""
        params = self.sampling_params(request)
        self.active_requests.add(request_id)
        produced = 0
        first = True
        try:
            with input_rejections("engine"):
                async for output in self.engine.generate(prompt, params, request_id):
                    completion = output.outputs[0]
                    produced += len(completion.token_ids)
                    text = completion.text
                    if first and not request.exclude_input_in_output:
                        text = (output.prompt or "") + text
                    first = False
                    yield GenerationChunk(
                        text=text,
                        token_ids=list(completion.token_ids),
                        num_input_tokens=len(output.prompt_token_ids or []),
                        num_output_tokens=produced,
                        finish_reason=completion.finish_reason,
                        finished=output.finished,
                    )
        except EpdError:
            raise
        except Exception as exc:
            log.exception("vLLM generation failed")
            raise EpdError(f"generation failed: {type(exc).__name__}", ErrorCode.INTERNAL) from None
        finally:
            self.active_requests.discard(request_id)

    def holds_media(self, uuid: str) -> bool:
        """Whether vLLM's processor cache holds the processed media of the item sent with ``uuid``
        as its ``multi_modal_uuids`` entry: that item may then be sent as None (vLLM 0.32: the
        renderer's cache, keyed by the uuid itself when no processor kwargs are given)."""
        cache = self.engine.renderer.mm_processor_cache
        return cache is not None and bool(cache.is_cached_item(uuid))

    def unfinished_requests(self) -> int:
        return unfinished_requests(self.engine)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)
        self.active_requests.discard(request_id)

    def shutdown(self) -> None:
        shut_down_engine(self.engine)

"""The colocated vLLM engine behind the ``llm`` model (the baseline of every mode).

Triton-free: takes a :class:`GenerateRequest` and decoded images, yields
:class:`GenerationChunk`s. ``model.py`` turns chunks into Triton responses; ``epd``'s colocated
path (``epd/colocated.py``) drives the same engine with a prompt of its own. Also the two
steps every vLLM-serving model takes before its engine starts: :func:`apply_vllm_environment`
and :func:`load_engine_args`. Starting, stopping and sampling are ``engines/async_llm.py``'s,
the prompt ``engines/prompt.py``'s.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from python_backends.engines.async_llm import (
    input_rejections,
    output_kind,
    sampling_params,
    shut_down_engine,
    start_async_llm,
    unfinished_requests,
)
from python_backends.engines.generation import GenerationChunk, wire_logprobs
from python_backends.engines.prompt import vllm_prompt
from python_backends.engines.videos import LoadedVideo
from python_backends.errors import EpdError, ErrorCode
from python_backends.request.generate import GenerateRequest

log = logging.getLogger(__name__)


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
OMP_THREADS_ENV = "OMP_NUM_THREADS"


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


def request_chunks(output: Any, produced: dict[int, int], with_prompt: bool = False) -> list[GenerationChunk]:
    """One vLLM ``RequestOutput`` as chunks, one per sequence it holds (n > 1: several, each with
    its ``index``); ``finished`` on the last chunk of the request's last output (an empty one when
    that output holds no sequence). ``produced``: tokens so far per sequence, updated.
    ``with_prompt``: each sequence's first text starts with the prompt (``exclude_input_in_output``
    false)."""
    chunks = []
    for completion in output.outputs:
        first = completion.index not in produced
        produced[completion.index] = produced.get(completion.index, 0) + len(completion.token_ids)
        text = completion.text
        if first and with_prompt:
            text = (output.prompt or "") + text
        chunks.append(
            GenerationChunk(
                text=text,
                token_ids=list(completion.token_ids),
                num_input_tokens=len(output.prompt_token_ids or []),
                num_output_tokens=produced[completion.index],
                finish_reason=completion.finish_reason,
                index=completion.index,
                logprobs=wire_logprobs(completion.logprobs),
                prompt_logprobs=wire_logprobs(output.prompt_logprobs) if first and completion.index == 0 else None,
            )
        )
    if output.finished and not chunks:
        chunks.append(GenerationChunk(text="", token_ids=[], num_input_tokens=len(output.prompt_token_ids or [])))
    if chunks:
        chunks[-1].finished = bool(output.finished)
    return chunks


@dataclass
class LlmEngine:
    """Owns one vLLM AsyncLLM. All methods run on the event loop thread."""

    engine: Any  # vllm.v1.engine.async_llm.AsyncLLM
    active_requests: set[str] = field(default_factory=set)

    @classmethod
    async def start(cls, engine_args: dict[str, Any]) -> LlmEngine:
        return cls(await start_async_llm(engine_args))

    def sampling_params(self, request: GenerateRequest) -> Any:
        return sampling_params(request.sampling, output_kind=output_kind(request.stream))

    async def generate(
        self,
        request: GenerateRequest,
        images: list[Image.Image],
        request_id: str,
        videos: Sequence[LoadedVideo] = (),
        audios: Sequence[tuple[Any, int]] = (),
    ) -> AsyncIterator[GenerationChunk]:
        """``videos``: what vLLM's own loader returned (python_backends.engines.videos.load_videos);
        ``audios``: (mono float32 samples, their rate) per clip (python_backends.request.audios), at
        the feature extractor's rate, so vLLM does not resample."""
        mm_data: dict[str, Any] = {}
        if request.image_embeds is not None:
            mm_data.update(request.image_embeds.multi_modal_data())
        elif images:
            mm_data["image"] = images
        if videos:
            mm_data["video"] = list(videos)
        if audios:
            mm_data["audio"] = list(audios)
        async for chunk in self.generate_prompt(vllm_prompt(request.prompt, mm_data=mm_data), request, request_id):
            yield chunk

    async def generate_prompt(
        self, prompt: dict[str, Any], request: GenerateRequest, request_id: str
    ) -> AsyncGenerator[GenerationChunk, None]:
        """Serve ``request`` with ``prompt`` as vLLM's input (``engines/prompt.py``'s
        :func:`vllm_prompt`): ``epd``'s colocated path builds its own."""
        params = self.sampling_params(request)
        self.active_requests.add(request_id)
        produced: dict[int, int] = {}  # tokens so far, per sequence
        try:
            with input_rejections("engine"):
                async for output in self.engine.generate(prompt, params, request_id):
                    for chunk in request_chunks(output, produced, not request.exclude_input_in_output):
                        yield chunk
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

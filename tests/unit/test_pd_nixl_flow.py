"""Prefill -> decode over NixlConnector, parameter flow only (no GPU here, see tests/gpu for the
real transfer): our ``PrefillEngine`` / ``DecodeEngine`` in front of scripted vLLM engines whose
KV-transfer answers come from vLLM 0.32's real Nixl scheduler code (``NixlPullConnectorScheduler``,
the part of the connector that reads and writes ``kv_transfer_params``; it needs no GPU and no
``nixl`` package). What it shows:

- prefill asks Nixl for ``do_remote_decode``; what Nixl's producer side answers travels in the
  epd transfer parameters (one JSON object, the same contract as TransferIdConnector's) and
  reaches decode's engine request unchanged, where Nixl's consumer side accepts it and loads
  every token of decode's prompt (the prefilled prompt plus prefill's first token);
- decode continues from prefill's first token and checks it loaded the prompt;
- altered block ids, other images, a reused or unknown transfer are refused before any engine
  work; a decode that computed the prompt itself is an error, not a fallback.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pytest

from python_backends.engines.prompt import ImageEmbeds
from python_backends.errors import EpdError, ErrorCode
from python_backends.pd import manifest as mf
from python_backends.pd import transfer as tx
from python_backends.pd.engines import DecodeEngine, PrefillEngine
from python_backends.pd.kv_transfer import RECORD_MAX_AGE_S

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

IMAGE_TOKEN = 9
BLOCK = 4
PROMPT = [1, IMAGE_TOKEN, IMAGE_TOKEN, 2, 3, 4, 5, 6]  # as vLLM expands it: 2 rows for the image
FIRST, REST = 42, [43, 44, 45]


class _TransferConfig:
    """The parts of vLLM's KVTransferConfig that Nixl's scheduler reads."""

    def __init__(self, role: str, engine_id: str) -> None:
        self.kv_role, self.engine_id, self.kv_buffer_device = role, engine_id, "cuda"

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return default


def nixl_scheduler(role: str, engine_id: str) -> Any:
    import torch as torch_module
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch_module.float16)
    group = KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)
    vllm_config = NS(
        parallel_config=NS(tensor_parallel_size=1, decode_context_parallel_size=1, data_parallel_index=0,
                           pipeline_parallel_size=1),
        cache_config=NS(block_size=BLOCK), kv_transfer_config=_TransferConfig(role, engine_id),
        scheduler_config=NS(disable_hybrid_kv_cache_manager=True), num_prefill_lookahead_tokens=0,
    )  # fmt: skip
    return NixlPullConnectorScheduler(vllm_config, engine_id, KVCacheConfig(64, [], [group]))


def _output(prompt: list[int], tokens: list[int], finished: bool, reason: str | None = None, **extra: Any) -> Any:
    completion = NS(token_ids=tokens, text="".join(f"<{t}>" for t in tokens), finish_reason=reason, logprobs=None)
    fields = {"kv_transfer_params": None, "num_cached_tokens": 0, "prompt_logprobs": None, **extra}
    return NS(prompt_token_ids=prompt, outputs=[completion], finished=finished, **fields)


class ScriptedEngine:
    """An AsyncLLM stand-in: records each request and answers with ``script``."""

    def __init__(self, script: Callable[[dict, Any, str], list[Any]]) -> None:
        self.script = script
        self.requests: list[tuple[dict, Any, str]] = []
        self.model_config = NS(hf_config=NS(image_token_id=IMAGE_TOKEN))

    async def generate(self, prompt: dict, params: Any, request_id: str) -> AsyncIterator[Any]:
        self.requests.append((prompt, params, request_id))
        for output in self.script(prompt, params, request_id):
            yield output

    def get_tokenizer(self) -> Any:
        return NS(decode=lambda ids: "".join(f"<{t}>" for t in ids))

    async def abort(self, request_id: str) -> None:
        pass


def prefill_script(producer: Any) -> Callable[[dict, Any, str], list[Any]]:
    """Nixl's producer: two steps (the first token's KV too), then its request_finished answer."""

    def script(prompt: dict, params: Any, request_id: str) -> list[Any]:
        from vllm.v1.request import RequestStatus

        assert params.max_tokens == 2
        request = NS(request_id=request_id, kv_transfer_params=params.extra_args["kv_transfer_params"],
                     status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=len(PROMPT) + 1)  # fmt: skip
        blocks = ([10, 11, 12],)  # ceil(9 / 4) blocks hold the prompt and the first token
        _, kv = producer.request_finished(request, blocks)
        kv[tx.NIXL_REPORTED_CACHE_KEY] = 0  # what vLLM's scheduler adds on the producer
        final = _output(PROMPT, [FIRST + 100], True, "length")
        final.kv_transfer_params = kv
        return [_output(PROMPT, [FIRST], False), final]

    return script


def decode_script(consumer: Any, cached: Callable[[int], int] = lambda loaded: loaded - 1) -> Any:
    """Nixl's consumer: how many tokens it loads for decode's request; vLLM recomputes the last."""

    def script(prompt: dict, params: Any, request_id: str) -> list[Any]:
        expanded = [t for t in prompt["prompt_token_ids"] for _ in range(2 if t == IMAGE_TOKEN else 1)]
        request = NS(request_id=request_id, kv_transfer_params=params.extra_args["kv_transfer_params"],
                     prompt_token_ids=expanded, num_prompt_tokens=len(expanded))  # fmt: skip
        loaded, asynchronous = consumer.get_num_new_matched_tokens(request, 0)
        assert asynchronous and loaded == len(expanded)  # the whole prompt comes from prefill
        return [_output(expanded, REST, True, "length", num_cached_tokens=cached(loaded))]

    return script


@pytest.fixture(scope="module")
def schedulers() -> tuple[Any, Any]:
    return nixl_scheduler("kv_producer", "prefill-engine"), nixl_scheduler("kv_consumer", "decode-engine")


def _image() -> ImageEmbeds:
    return ImageEmbeds(torch.ones(2, 8), (1, 2, 4), uuid="key-of-the-image")


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _collect(decode: DecodeEngine, params: str, images: list[ImageEmbeds]) -> list[Any]:
    return [c async for c in decode.decode(params, images, {"max_tokens": 4, "temperature": 0.0}, stream=False)]


def _engines(tmp_path: Path, schedulers: tuple[Any, Any], **decode_kw: Any) -> tuple[PrefillEngine, DecodeEngine]:
    producer, consumer = schedulers
    prefill = PrefillEngine(ScriptedEngine(prefill_script(producer)), tmp_path, tx.NIXL_CONNECTOR)
    decode = DecodeEngine(ScriptedEngine(decode_script(consumer, **decode_kw)), tmp_path, tx.NIXL_CONNECTOR)
    return prefill, decode


def _prefill(prefill: PrefillEngine) -> Any:
    return _run(prefill.prefill("a prompt", [_image()], {"max_tokens": 4, "temperature": 0.0}))


def test_nixl_parameters_flow_from_prefill_to_decode(tmp_path: Path, schedulers: tuple[Any, Any]) -> None:
    prefill, decode = _engines(tmp_path, schedulers)
    result = _prefill(prefill)
    assert (result.first_token_id, result.first_text, result.finish_reason) == (FIRST, f"<{FIRST}>", None)
    sent = prefill.engine.requests[0][1].extra_args["kv_transfer_params"]  # type: ignore[attr-defined]
    assert sent == {"do_remote_decode": True}
    wire = result.chunk().transfer_params  # the prefill model's transfer_params output
    params = tx.TransferParams.parse(wire)
    assert params.connector == tx.NIXL_CONNECTOR and params.kv_transfer_params["remote_engine_id"] == "prefill-engine"
    assert tx.NIXL_REPORTED_CACHE_KEY not in params.kv_transfer_params  # decode's cache count is its proof

    chunks = _run(_collect(decode, wire, [_image()]))
    prompt, vllm_params, _ = decode.engine.requests[0]  # type: ignore[attr-defined]
    assert prompt["prompt_token_ids"] == [1, IMAGE_TOKEN, 2, 3, 4, 5, 6, FIRST]  # continues from FIRST
    assert vllm_params.max_tokens == 3
    assert chunks[-1].token_ids == REST and chunks[-1].num_output_tokens == 4
    assert chunks[-1].num_cached_tokens == len(PROMPT)
    assert mf.list_transfers(tmp_path) == []  # single use: the record is gone
    with pytest.raises(EpdError) as err:
        _run(_collect(decode, wire, [_image()]))
    assert err.value.code == ErrorCode.NOT_FOUND


@pytest.mark.parametrize(
    ("tamper", "needle"),
    [
        (lambda p: {**p, "kv_transfer_params": {**p["kv_transfer_params"], "remote_block_ids": [[0, 1, 2]]}},
         "kv_transfer_params differ"),
        (lambda p: {**p, "first_token_id": FIRST + 1}, "first_token_id"),
        (lambda p: {**p, "kv_transfer_params": {**p["kv_transfer_params"], "do_remote_prefill": False}},
         "do_remote_prefill"),
    ],
)
def test_altered_nixl_parameters_are_refused_before_any_engine_work(
    tmp_path: Path, schedulers: tuple[Any, Any], tamper: Callable[[dict], dict], needle: str
) -> None:
    prefill, decode = _engines(tmp_path, schedulers)
    wire = _prefill(prefill).chunk().transfer_params
    with pytest.raises(EpdError, match=needle) as err:
        _run(_collect(decode, json.dumps(tamper(json.loads(wire))), [_image()]))
    assert err.value.code == ErrorCode.INVALID_ARG and decode.engine.requests == []  # type: ignore[attr-defined]


def test_other_images_are_refused(tmp_path: Path, schedulers: tuple[Any, Any]) -> None:
    prefill, decode = _engines(tmp_path, schedulers)
    wire = _prefill(prefill).chunk().transfer_params
    other = ImageEmbeds(torch.ones(2, 8), (1, 2, 4), uuid="key-of-another-image")
    with pytest.raises(EpdError, match="same image embeddings") as err:
        _run(_collect(decode, wire, [other]))
    assert err.value.code == ErrorCode.INVALID_ARG and decode.engine.requests == []  # type: ignore[attr-defined]


def test_decode_that_computed_the_prompt_itself_fails(tmp_path: Path, schedulers: tuple[Any, Any]) -> None:
    prefill, decode = _engines(tmp_path, schedulers, cached=lambda loaded: 0)
    wire = _prefill(prefill).chunk().transfer_params
    with pytest.raises(EpdError, match="instead of loading them") as err:
        _run(_collect(decode, wire, [_image()]))
    assert err.value.code == ErrorCode.INTERNAL


def test_prefill_sweeps_records_no_decode_took(tmp_path: Path, schedulers: tuple[Any, Any]) -> None:
    import os
    import time

    prefill, _ = _engines(tmp_path, schedulers)
    stale = tmp_path / ("f" * 32)
    stale.mkdir()
    old = time.time() - 2 * RECORD_MAX_AGE_S
    os.utime(stale, (old, old))
    wire = _prefill(prefill).chunk().transfer_params
    assert mf.list_transfers(tmp_path) == [tx.TransferParams.parse(wire).transfer_id]

"""Prefill -> decode over vLLM's NixlConnector on a real GPU (the gpu target's connector).

The same cases and proofs as ``tests/integration/test_pd_transfer.py`` (TransferIdConnector on
the CPU), with the engine args the gpu target generates (``pd_engine_args(..., "NixlConnector")``):
prefill's first token + decode's tokens equal a colocated engine's greedy tokens, decode (no
prefix cache) reports every prompt token as loaded, the transfer parameters are the epd contract
with Nixl's own ``kv_transfer_params`` inside, and a transfer is single use. Three engines share
one GPU in this process. Skipped without a CUDA GPU or the ``nixl`` package; run by
``tests/gpu/check_gpu.sh``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def _missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    if importlib.util.find_spec("nixl") is None and importlib.util.find_spec("nixl_cu13") is None:
        return "the nixl package is not installed (requirements/gpu.txt: nixl-cu13)"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]

# Nixl's side channel: one port per engine in this process.
PREFILL_PORT, DECODE_PORT = 15600, 15700


@pytest.fixture(scope="module")
def engines() -> Iterator[Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from builders.launcher import prepare
    from builders.tritonserver import REPO_ROOT
    from python_backends.engines.llm import load_engine_args
    from python_backends.pd.engine_args import pd_engine_args
    from python_backends.pd.engines import DecodeEngine, PrefillEngine
    from python_backends.pd.transfer import NIXL_CONNECTOR
    from tests.integration.test_pd_transfer import CHUNK_TOKENS, ENGINE_ARGS, Engines

    prepare("cpu", None, REPO_ROOT / "model_repository")  # the tiny default model + its engine args
    base = {**load_engine_args(ENGINE_ARGS), "max_num_batched_tokens": CHUNK_TOKENS,
            "gpu_memory_utilization": 0.2, "enforce_eager": True, "dtype": "bfloat16"}  # fmt: skip
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_NIXL_SIDE_CHANNEL_PORT")}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    store = Path("/dev/shm") / f"epd-nixl-test-{uuid.uuid4().hex[:8]}"
    loop = asyncio.new_event_loop()
    started: list[Any] = []
    try:
        colocated = AsyncLLM.from_engine_args(AsyncEngineArgs(**{**base, "enable_mm_embeds": True}))
        started.append(colocated)
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(PREFILL_PORT)
        prefill_args = pd_engine_args(base, "prefill", store, NIXL_CONNECTOR)
        prefill = loop.run_until_complete(PrefillEngine.start(prefill_args))
        started.append(prefill)
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(DECODE_PORT)
        decode = loop.run_until_complete(DecodeEngine.start(pd_engine_args(base, "decode", store, NIXL_CONNECTOR)))
        started.append(decode)
        assert prefill.connector == decode.connector == NIXL_CONNECTOR
        yield Engines(loop, colocated, prefill, decode, store, prefill.engine.vllm_config.cache_config.block_size)
    finally:
        from tests.integration.test_pd_transfer import stop_engines

        stop_engines(loop, started, store, saved)


def _cases() -> dict[str, tuple[str, list]]:
    from tests.integration.test_pd_transfer import _cases as cpu_cases

    return cpu_cases()


@pytest.mark.parametrize("case", ["text_over_one_block", "text_and_image", "two_images", "shorter_than_one_block"])
def test_nixl_prefill_decode_equals_colocated_and_loads_the_prompt(engines: Any, case: str) -> None:
    from python_backends.pd import transfer as tx
    from tests.integration.test_pd_transfer import MAX_TOKENS, _colocated, _pd

    prompt, images = _cases()[case]
    images = [img.__class__(img.embeds.cuda(), img.grid_thw) for img in images]
    salt = uuid.uuid4().hex
    expected, num_prompt = engines.run(_colocated(engines.colocated, prompt, images, salt))
    tokens, result, chunks, manifest = engines.run(_pd(engines, prompt, images, salt=salt))
    assert tokens == expected
    params = result.transfer
    assert params.connector == tx.NIXL_CONNECTOR and params.kv_transfer_params["do_remote_prefill"] is True
    assert not manifest.holds_kv and manifest.num_tokens == num_prompt == params.num_prompt_tokens
    # Decode has no prefix cache: every prompt token it did not compute came from prefill's GPU.
    assert chunks[0].num_cached_tokens >= num_prompt
    assert chunks[-1].finished and chunks[-1].num_output_tokens == MAX_TOKENS
    assert params.transfer_id not in os.listdir(engines.store)  # single use


def test_altered_block_ids_are_refused(engines: Any) -> None:
    import json

    from python_backends.errors import EpdError, ErrorCode
    from tests.integration.test_pd_transfer import GREEDY

    prompt, images = _cases()["text_over_one_block"]
    result = engines.run(engines.prefill.prefill(prompt, images, GREEDY))
    wire = json.loads(result.transfer.to_json())
    wire["kv_transfer_params"]["remote_block_ids"] = [[0] * len(wire["kv_transfer_params"]["remote_block_ids"][0])]

    async def decode() -> None:
        async for _ in engines.decode.decode(json.dumps(wire), images, GREEDY):
            pass

    with pytest.raises(EpdError, match="kv_transfer_params differ") as err:
        engines.run(decode())
    assert err.value.code == ErrorCode.INVALID_ARG

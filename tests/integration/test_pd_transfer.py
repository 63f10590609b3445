"""Prefill -> decode over ``TransferIdConnector`` with real vLLM engines on the CPU (no Triton).

Three engines in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, like the server): a
colocated reference built from the ``llm`` model's engine args plus ``enable_mm_embeds``
and *no* connector, a prefill engine (KV producer) and a decode engine (KV consumer,
prefix caching off), both from :func:`pd_engine_args` on the same base args. Starting them
takes ~35-45 s here; the whole file runs in about a minute.

What it shows:

- equality: prefill's first token + decode's tokens == the colocated greedy tokens, for
  text and text + image embeddings prompts longer than one KV block (128 tokens on CPU),
  and for a prompt shorter than one block (ExampleConnector transfers nothing there);
- proof that decode *loaded* the KV: ``num_cached_tokens`` == every prompt token while the
  decode engine has no prefix cache, and overwriting the transferred pages with noise
  changes decode's tokens (same shapes, so the load still "succeeds");
- bad, altered, unknown, reused or mismatched transfer parameters -> INVALID_ARG /
  NOT_FOUND, and no request is left behind in the decode engine;
- timings of P+D against colocated, printed (run with ``-s``); what is asserted is what makes
  them comparable: every timed decode loaded the whole prompt and computed none of it, every
  timed colocated request computed the whole prompt, and both gave the same tokens.

Image embeddings are seeded random tensors of the right shape (``[t*h*w/4, hidden]``): the
transfer does not care where embeddings come from, and DESIGN.md records that real encoder
embeddings give the same tokens as the raw-image path.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from builders.launcher import prepare
from builders.tritonserver import REPO_ROOT
from python_backends.errors import EpdError, ErrorCode

ENGINE_ARGS = REPO_ROOT / "model_repository" / "llm" / "1" / "engine_args.json"
MAX_TOKENS = 12
CHUNK_TOKENS = 200  # not a multiple of the 128-token block
# ignore_eos: exactly MAX_TOKENS tokens, whatever the random model's greedy choices.
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
TEXT = "The quick brown fox jumps over the lazy dog while the cat watches. " * 8


# Real engines: slow. The `server` marker is the repository's "slow, real stack" marker.
pytestmark = pytest.mark.server


@dataclass
class Engines:
    loop: asyncio.AbstractEventLoop
    colocated: Any  # vllm AsyncLLM, no connector
    prefill: Any  # PrefillEngine
    decode: Any  # DecodeEngine
    store: Path
    block_size: int

    def run(self, coro):
        return self.loop.run_until_complete(coro)


def _images(*grids: tuple[int, int, int]) -> list:
    import torch

    from python_backends.engines.prompt import ImageEmbeds

    gen = torch.Generator().manual_seed(sum(h * w for _, h, w in grids))
    return [ImageEmbeds(torch.randn(t * h * w // 4, 128, generator=gen), (t, h, w)) for t, h, w in grids]


def _cases() -> dict[str, tuple[str, list]]:
    return {
        "text_over_one_block": (TEXT, []),
        "text_and_image": (IMAGE + TEXT, _images((1, 16, 16))),
        "two_images": (IMAGE + "Describe. " + IMAGE + TEXT[:100], _images((1, 16, 16), (1, 20, 28))),
        "shorter_than_one_block": ("short", []),
    }


@pytest.fixture(scope="module")
def engines():
    prepare("cpu", None, REPO_ROOT / "model_repository")  # default model + engine_args.json
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from python_backends.engines.llm import load_engine_args
    from python_backends.pd.engine_args import pd_engine_args
    from python_backends.pd.engines import DecodeEngine, PrefillEngine

    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING",)}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    shm = Path("/dev/shm")
    store = (shm if shm.is_dir() else Path("/tmp")) / f"epd-kv-test-{uuid.uuid4().hex[:8]}"
    # Prompts over 200 tokens are prefilled in two chunks (vLLM's chunked prefill), with a KV
    # block split between them: the transfer must carry every chunk. All three engines get
    # the same budget so that the colocated reference computes the same chunks.
    base = {**load_engine_args(ENGINE_ARGS), "max_num_batched_tokens": CHUNK_TOKENS}
    loop = asyncio.new_event_loop()
    started: list[Any] = []
    try:
        t0 = time.perf_counter()
        colocated = loop.run_until_complete(_start_colocated(AsyncLLM, AsyncEngineArgs, base))
        started.append(colocated)
        prefill = loop.run_until_complete(PrefillEngine.start(pd_engine_args(base, "prefill", store)))
        started.append(prefill)
        decode = loop.run_until_complete(DecodeEngine.start(pd_engine_args(base, "decode", store)))
        started.append(decode)
        print(f"\n[pd] three engines started in {time.perf_counter() - t0:.1f} s")
        assert decode.engine.vllm_config.cache_config.enable_prefix_caching is False
        yield Engines(loop, colocated, prefill, decode, store, prefill.engine.vllm_config.cache_config.block_size)
    finally:
        stop_engines(loop, started, store, saved)


def stop_engines(loop: asyncio.AbstractEventLoop, started: list, store: Path, saved: dict[str, str | None]) -> None:
    """Shut the engines down, close their loop, remove the KV store, restore the environment."""
    for engine in reversed(started):
        engine.shutdown()
    # AsyncLLM.shutdown() called off its loop only schedules the closing of its zmq sockets on
    # that loop (vLLM's MPClient BackgroundResources): run the loop so they close. Left open,
    # a later garbage collection of the client's zmq Context blocks forever in term() (it hung
    # the next test module's setup in CI).
    loop.run_until_complete(asyncio.sleep(0.2))
    loop.close()
    shutil.rmtree(store, ignore_errors=True)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


async def _start_colocated(async_llm, async_engine_args, base: dict) -> Any:
    return async_llm.from_engine_args(async_engine_args(**{**base, "enable_mm_embeds": True}))


@dataclass
class Colocated:
    tokens: list[int]
    num_prompt: int
    num_cached: int  # prompt tokens served from the prefix cache instead of computed
    ttft_s: float


async def _colocated_timed(engine: Any, prompt: str, images: list, salt: str | None) -> Colocated:
    """Greedy tokens, prompt length, cached prompt tokens and seconds to the first token from
    the colocated engine."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from python_backends.engines.prompt import multi_modal_data

    request: dict[str, Any] = {"prompt": prompt}
    mm = multi_modal_data(images)
    if mm:
        request["multi_modal_data"] = mm
    if salt:
        request["cache_salt"] = salt
    answer = Colocated([], 0, -1, 0.0)
    t0 = time.perf_counter()
    params = SamplingParams(**GREEDY, output_kind=RequestOutputKind.DELTA)
    async for output in engine.generate(request, params, f"colocated-{uuid.uuid4().hex}"):
        if not answer.tokens:
            answer.ttft_s = time.perf_counter() - t0
            answer.num_prompt = len(output.prompt_token_ids or [])
            answer.num_cached = int(output.num_cached_tokens or 0)
        answer.tokens += output.outputs[0].token_ids
    return answer


async def _colocated(engine: Any, prompt: str, images: list, salt: str | None = None) -> tuple[list[int], int]:
    answer = await _colocated_timed(engine, prompt, images, salt)
    return answer.tokens, answer.num_prompt


async def _pd(e: Engines, prompt: str, images: list, decode_images: list | None = None, params=None, salt=None):
    """Prefill then decode; returns (tokens, prefill result, decode chunks, manifest)."""
    from python_backends.pd import manifest as mf

    result = await e.prefill.prefill(prompt, images, GREEDY, cache_salt=salt)
    manifest = mf.read_manifest(e.store, result.transfer.transfer_id)
    chunks = []
    async for chunk in e.decode.decode(
        params if params is not None else result.transfer.to_json(),
        images if decode_images is None else decode_images,
        GREEDY,
    ):
        chunks.append(chunk)
    tokens = [result.first_token_id] + [t for c in chunks for t in c.token_ids]
    return tokens, result, chunks, manifest


def _unfinished(engine: Any) -> int:
    return int(engine.output_processor.get_num_unfinished_requests())


@pytest.mark.parametrize("case", list(_cases()))
def test_prefill_decode_equals_colocated_and_loads_every_prompt_token(engines: Engines, case: str) -> None:
    prompt, images = _cases()[case]
    # A fresh cache salt: both engines compute the whole prompt, whatever ran before. (A
    # prefix-cache hit takes another numeric path, and this random-weight model's greedy
    # tokens are sensitive to it after several steps.)
    salt = uuid.uuid4().hex
    expected, num_prompt = engines.run(_colocated(engines.colocated, prompt, images, salt))
    if case != "shorter_than_one_block":
        assert num_prompt > engines.block_size, "the case must span more than one KV block"
    else:
        assert num_prompt < engines.block_size

    tokens, result, chunks, manifest = engines.run(_pd(engines, prompt, images, salt=salt))

    assert tokens == expected
    assert result.num_prompt_tokens == num_prompt == result.transfer.num_prompt_tokens
    # Decode has no prefix cache: every prompt token it did not compute came from the
    # connector. It computed exactly one position (prefill's first token) before decoding.
    assert chunks[0].num_cached_tokens == num_prompt
    assert chunks[-1].finished and chunks[-1].num_output_tokens == MAX_TOKENS
    # Every prefill chunk was stored: [0, 200), [200, n) for the long prompts.
    assert [tuple(c) for c in manifest.chunks] == [
        (start, min(start + CHUNK_TOKENS, num_prompt)) for start in range(0, num_prompt, CHUNK_TOKENS)
    ]
    # Single use: the transfer is gone once decoded.
    assert result.transfer.transfer_id not in os.listdir(engines.store)
    assert _unfinished(engines.decode.engine) == 0


def test_corrupted_transfer_changes_decode_output(engines: Engines) -> None:
    import safetensors.torch
    import torch

    prompt, images = _cases()["text_and_image"]
    salt = uuid.uuid4().hex
    expected, num_prompt = engines.run(_colocated(engines.colocated, prompt, images, salt))
    result = engines.run(engines.prefill.prefill(prompt, images, GREEDY, cache_salt=salt))
    folder = engines.store / result.transfer.transfer_id
    chunk_files = sorted(folder.glob("chunk-*.safetensors"))
    assert chunk_files, "prefill stored nothing"
    gen = torch.Generator().manual_seed(1)
    for path in chunk_files:
        pages = safetensors.torch.load_file(str(path))
        noisy = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) * v.std() for k, v in pages.items()}
        safetensors.torch.save_file(noisy, str(path))

    async def decode() -> tuple[list[int], int]:
        tokens, cached = [result.first_token_id], -1
        async for chunk in engines.decode.decode(result.transfer, images, GREEDY):
            tokens += chunk.token_ids
            cached = chunk.num_cached_tokens if cached < 0 else cached
        return tokens, cached

    tokens, cached = engines.run(decode())
    print(f"\n[pd] corrupted KV: colocated {expected}\n[pd]               decode    {tokens}")
    assert cached == num_prompt  # it did load the (noisy) pages ...
    assert tokens[0] == expected[0]  # ... prefill's token is untouched ...
    assert tokens[1:] != expected[1:]  # ... and decode's continuation follows the pages.


def test_bad_transfer_params_are_clear_errors(engines: Engines) -> None:
    prompt, images = _cases()["text_and_image"]
    result = engines.run(engines.prefill.prefill(prompt, images, GREEDY))
    good = result.transfer.to_dict()

    def altered(**change: Any) -> dict:
        """``good`` with fields changed as a client could: the connector's parameters follow
        them (otherwise parsing alone refuses the mismatch, before the checks shown here)."""
        from python_backends.pd import transfer as tx

        fields = {k: v for k, v in good.items() if k not in ("kv_transfer_params", "version")}
        return tx.TransferParams(**{**fields, **change}).to_dict()

    def decode_error(params: Any, decode_images: list) -> EpdError:
        async def run() -> None:
            async for _ in engines.decode.decode(params, decode_images, GREEDY):
                pass

        with pytest.raises(EpdError) as err:
            engines.run(run())
        return err.value

    other_image = [type(images[0])(images[0].embeds + 1.0, images[0].grid_thw)]  # same shape, other content
    cases = [
        ("garbage", "{not json", images, ErrorCode.INVALID_ARG, "JSON"),
        ("wrong version", {**good, "version": 7}, images, ErrorCode.INVALID_ARG, "version"),
        ("path traversal", altered(transfer_id="../../etc/passwd"), images, ErrorCode.INVALID_ARG, "transfer_id"),
        ("unknown id", altered(transfer_id="0" * 32), images, ErrorCode.NOT_FOUND, "not found"),
        ("altered digest", altered(digest="f" * 64), images, ErrorCode.INVALID_ARG, "do not match"),
        ("altered token count", altered(num_prompt_tokens=good["num_prompt_tokens"] - 1), images,
         ErrorCode.INVALID_ARG, "do not match"),
        ("altered first token", altered(first_token_id=(good["first_token_id"] + 1) % 1000), images,
         ErrorCode.INVALID_ARG, "first_token_id"),
        ("connector parameters naming another transfer", {**good, "kv_transfer_params": {
            **good["kv_transfer_params"], "epd_transfer_id": "0" * 32}}, images, ErrorCode.INVALID_ARG, "name this"),
        ("images missing", good, [], ErrorCode.INVALID_ARG, "image"),
        ("other image", good, other_image, ErrorCode.INVALID_ARG, "could not load"),
    ]
    for name, params, decode_images, code, needle in cases:
        err = decode_error(params, decode_images)
        assert (err.code, needle in err.message) == (code, True), f"{name}: {err.code} {err.message}"
        assert "Traceback" not in err.message

    # The transfer survived the bad attempts; the good parameters still work, once.
    _, _, chunks = engines.run(_pd_decode_only(engines, good, images))
    assert chunks[0].num_cached_tokens == good["num_prompt_tokens"]
    reuse = decode_error(good, images)
    assert reuse.code == ErrorCode.NOT_FOUND
    assert _unfinished(engines.decode.engine) == 0


async def _pd_decode_only(e: Engines, params: dict, images: list):
    chunks = [c async for c in e.decode.decode(params, images, GREEDY)]
    return [params["first_token_id"]] + [t for c in chunks for t in c.token_ids], None, chunks


def test_damaged_transfer_fails_instead_of_recomputing(engines: Engines) -> None:
    prompt, images = _cases()["text_over_one_block"]
    result = engines.run(engines.prefill.prefill(prompt, images, GREEDY))
    for path in (engines.store / result.transfer.transfer_id).glob("chunk-*.safetensors"):
        path.write_bytes(b"not a safetensors file")

    async def run() -> None:
        async for _ in engines.decode.decode(result.transfer, images, GREEDY):
            pass

    with pytest.raises(EpdError) as err:
        engines.run(run())
    assert err.value.code == ErrorCode.INVALID_ARG and "could not load" in err.value.message
    assert _unfinished(engines.decode.engine) == 0
    assert engines.decode.discard(result.transfer) is True


def test_timings_prefill_decode_vs_colocated(engines: Engines) -> None:
    """Numbers for the report (run with -s); nothing is asserted about time, only that the
    two sides did the work they are timed for (else the comparison says nothing): decode
    loaded every prompt token from the transfer and computed none, colocated computed every
    prompt token, and both answered the same tokens.

    Sequential requests, each prompt under a fresh cache salt (no prefix-cache hits), the
    order of colocated and P+D alternating per round; medians over the rounds.
    """
    import statistics

    rows: dict[str, list[float]] = {"col_e2e": [], "col_ttft": [], "pd_e2e": [], "pd_ttft": [], "decode": []}
    pd_tokens: list[list[int]] = []
    col_tokens: list[list[int]] = []
    work: list[str] = []  # one line per request that did other work than the one it is timed for

    async def pd_timed(prompt: str, images: list, salt: str) -> None:
        t0 = time.perf_counter()
        result = await engines.prefill.prefill(prompt, images, GREEDY, cache_salt=salt)
        t1 = time.perf_counter()
        chunks = [chunk async for chunk in engines.decode.decode(result.transfer, images, GREEDY)]
        t2 = time.perf_counter()
        rows["pd_ttft"].append(t1 - t0)
        rows["decode"].append(t2 - t1)
        rows["pd_e2e"].append(t2 - t0)
        pd_tokens.append([result.first_token_id] + [t for c in chunks for t in c.token_ids])
        if chunks[0].num_cached_tokens != result.num_prompt_tokens:
            work.append(f"P+D {prompt[:20]!r}: decode loaded {chunks[0].num_cached_tokens} of "
                        f"{result.num_prompt_tokens} prompt tokens")

    async def col_timed(prompt: str, images: list, salt: str) -> None:
        t0 = time.perf_counter()
        answer = await _colocated_timed(engines.colocated, prompt, images, salt)
        rows["col_e2e"].append(time.perf_counter() - t0)
        rows["col_ttft"].append(answer.ttft_s)
        col_tokens.append(answer.tokens)
        if answer.num_cached != 0:
            work.append(f"colocated {prompt[:20]!r}: {answer.num_cached} of {answer.num_prompt} prompt tokens cached")

    for round_ in range(3):
        for prompt, images in _cases().values():
            salt = uuid.uuid4().hex
            if round_ % 2:
                engines.run(pd_timed(prompt, images, salt))
                engines.run(col_timed(prompt, images, salt + "c"))
            else:
                engines.run(col_timed(prompt, images, salt + "c"))
                engines.run(pd_timed(prompt, images, salt))
    assert not work, "the timed requests did other work than compared:\n" + "\n".join(work)
    assert pd_tokens == col_tokens
    assert all(len(tokens) == MAX_TOKENS for tokens in pd_tokens)
    med = {k: statistics.median(v) * 1000 for k, v in rows.items()}
    low = {k: min(v) * 1000 for k, v in rows.items()}
    print(
        f"\n[pd] {len(rows['pd_e2e'])} requests x {MAX_TOKENS} tokens, sequential, median (min) ms: "
        f"colocated e2e {med['col_e2e']:.0f} ({low['col_e2e']:.0f}), "
        f"TTFT {med['col_ttft']:.0f} ({low['col_ttft']:.0f}); "
        f"P+D e2e {med['pd_e2e']:.0f} ({low['pd_e2e']:.0f}), "
        f"TTFT = prefill {med['pd_ttft']:.0f} ({low['pd_ttft']:.0f}), "
        f"decode {med['decode']:.0f} ({low['decode']:.0f}); e2e ratio of medians {med['pd_e2e'] / med['col_e2e']:.2f}"
    )


def test_media_the_engine_holds_go_as_none(engines: Engines) -> None:
    """epd's colocated path sends an image whose processed pixels vLLM's processor cache holds as
    None under its uuid (python_backends/epd/colocated.py): the real engine takes it and answers
    as it did with the pixels, and refuses it before any token (the error that makes the path
    send the pixels again) for a uuid it does not hold."""
    from python_backends.engines.llm import LlmEngine
    from python_backends.request.generate import GenerateRequest
    from python_backends.request.images import ImageLimits, decode_images
    from tests.images import synthetic_image

    engine = LlmEngine(engines.colocated)
    (picture,) = decode_images([synthetic_image(96, 80, seed=5)], ImageLimits())
    key = f"engine-held-{uuid.uuid4().hex}"
    request = GenerateRequest(IMAGE + TEXT[:100], [], stream=True, sampling=GREEDY, exclude_input_in_output=True)

    async def tokens(item: Any) -> tuple[list[int], int]:
        prompt = {"prompt": request.prompt, "multi_modal_data": {"image": [item]},
                  "multi_modal_uuids": {"image": [key]}}
        chunks = [chunk async for chunk in engine.generate_prompt(prompt, request, uuid.uuid4().hex)]
        return [t for chunk in chunks for t in chunk.token_ids], chunks[0].num_input_tokens

    assert not engine.holds_media(key)
    with pytest.raises(EpdError) as refused:
        engines.run(tokens(None))
    # vLLM 0.32 raises EngineGenerateError from its "Cache miss ..." ValueError: the input's fault
    assert refused.value.code == ErrorCode.INVALID_ARG and "rejected by the engine" in refused.value.message
    with_pixels = engines.run(tokens(picture))
    assert engine.holds_media(key)
    assert engines.run(tokens(None)) == with_pixels and len(with_pixels[0]) == MAX_TOKENS
    assert _unfinished(engines.colocated) == 0

"""The equality pass of the peer comparison: the same fixed requests sent one at a time (no
batching) to every served model, greedy token ids and prompt lengths compared across modes;
and, for vLLM's native EPD, the proof that its consumer reads the stored encoder cache.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.metrics import RequestRecord
from bench.workload import BenchRequest, WorkloadBuilder


def equality_requests(builder: WorkloadBuilder, unique: int, repeated: int) -> list[tuple[str, BenchRequest]]:
    """(media policy, request): fresh images, then images from the pool the ``:repeated``
    modes used (cache hits where the mode caches)."""
    out = [("unique", r) for r in builder.build(unique, 0.0, "equality", 0)]
    out += [("repeated", r) for r in builder.build(repeated, 1.0, "equality", 1)]
    return out


async def run_equality(
    make_target: Callable[[], Any], model: str, requests: Sequence[tuple[str, BenchRequest]], timeout_s: float
) -> list[dict[str, Any]]:
    """The requests one at a time (no batching), in order; what each returned. The target is
    made here, inside the running loop (gRPC's aio channel belongs to the loop it is made in)."""
    target = make_target()
    rows = []
    try:
        for policy, request in requests:
            record: RequestRecord = await target.send(model, target.prepare(request, model), timeout_s)
            rendered = getattr(target, "rendered_prompts", {}).get(request.key)
            rows.append(
                {
                    "model": model,
                    "mode": model if policy == "unique" else f"{model}:repeated",
                    "key": request.key,
                    "policy": policy,
                    "error": record.error,
                    "num_input_tokens": record.num_input_tokens,
                    "output_token_ids": record.output_token_ids,
                    "cache_hits": record.cache_hits,
                    "prompt_text_equal": None if rendered is None else rendered == request.prompt,
                }
            )
    finally:
        await target.close()
    return rows


def equality_table(rows: Sequence[dict[str, Any]], reference: str = "llm") -> dict[str, Any]:
    """Per request: each mode's tokens against the reference model's for the same request
    (the first model served when the reference was not run)."""
    by_key: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_key.setdefault(row["key"], {})[row["model"]] = row
    if rows and not any(row["model"] == reference for row in rows):
        reference = rows[0]["model"]
    table = []
    for key, models in by_key.items():
        ref = models.get(reference)
        ref_tokens = ref["output_token_ids"] if ref and not ref["error"] else None
        cells = {}
        for model, row in models.items():
            if row["error"]:
                verdict = "error"
            elif ref_tokens is None:
                verdict = "no reference"
            elif row["output_token_ids"] == ref_tokens:
                verdict = "equal"
            else:
                pairs = zip(row["output_token_ids"], ref_tokens, strict=False)  # the shorter one ends the search
                first = next(
                    (i for i, (a, b) in enumerate(pairs) if a != b), min(len(row["output_token_ids"]), len(ref_tokens))
                )
                verdict = f"differs at token {first}"
            cells[model] = {
                "mode": row["mode"],
                "verdict": verdict,
                "num_input_tokens": row["num_input_tokens"],
                "cache_hits": row["cache_hits"],
                "prompt_text_equal": row["prompt_text_equal"],
                "error": row["error"],
            }
        input_tokens = {c["num_input_tokens"] for c in cells.values() if not c["error"]}
        table.append(
            {
                "key": key,
                "policy": next(iter(models.values()))["policy"],
                "reference_tokens": ref_tokens,
                "models": cells,
                "same_input_tokens": len(input_tokens) == 1,
                "all_equal": all(c["verdict"] == "equal" for c in cells.values()),
            }
        )
    models = list(dict.fromkeys(row["model"] for row in rows))
    return {
        "reference": reference,
        "models": models,
        "modes": list(dict.fromkeys(row["mode"] for row in rows)),
        "requests": table,
        "all_equal": bool(table) and all(r["all_equal"] for r in table),
        "all_same_input_tokens": bool(table) and all(r["same_input_tokens"] for r in table),
        "prompt_text_checked": sum(
            1 for r in table for c in r["models"].values() if c["prompt_text_equal"] is not None
        ),
        "prompt_text_all_equal": all(c["prompt_text_equal"] is not False for r in table for c in r["models"].values()),
    }


def ec_load_proof(
    encoder_url: str,
    consumer_url: str,
    storage: Path,
    served_model: str,
    request: BenchRequest,
    reference_tokens: dict[str, list[int]],
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Does vLLM-EPD's consumer use the encoder cache the producer stored, or encode the
    image itself? Equal tokens cannot tell (a consumer that recomputes gives the same
    tokens), so: the router's step 1 for a fresh image, then the stored tensor is replaced
    by zeros of the same shape, then the request goes to the consumer. Tokens that differ
    from what the other modes gave for this request prove the consumer read the storage."""
    import numpy as np
    import requests
    from safetensors.numpy import load_file, save_file

    from bench.epd_router import encoder_requests
    from bench.openai_target import chat_body

    body = chat_body(request, served_model)
    body.update(stream=False)
    body.pop("stream_options", None)
    before = set(os.listdir(storage))
    for payload in encoder_requests(body):
        requests.post(f"{encoder_url}/v1/chat/completions", json=payload, timeout=timeout_s).raise_for_status()
    new = sorted(set(os.listdir(storage)) - before)
    result: dict[str, Any] = {"request": request.key, "stored_entries": new}
    if len(new) != 1:
        return {**result, "proved": False, "reason": f"expected one new EC entry, found {len(new)}"}
    path = storage / new[0] / "encoder_cache.safetensors"
    tensors = load_file(str(path))
    result["stored_shape"] = {k: list(v.shape) for k, v in tensors.items()}
    save_file({k: np.zeros_like(v) for k, v in tensors.items()}, str(path))
    answer = requests.post(f"{consumer_url}/v1/chat/completions", json=body, timeout=timeout_s)
    answer.raise_for_status()
    tokens = answer.json()["choices"][0].get("token_ids") or []
    shutil.rmtree(storage / new[0], ignore_errors=True)
    others = {model: t for model, t in reference_tokens.items() if t}
    differs = bool(others) and all(tokens != t for t in others.values())
    return {
        **result,
        "tokens_with_zeroed_cache": tokens,
        "reference_tokens": others,
        "references_agree": len({tuple(t) for t in others.values()}) == 1,
        "proved": differs,
        "reason": (
            f"with the stored embeddings zeroed the consumer answered differently from {', '.join(others)} for the "
            "same request: it reads the EC storage instead of encoding the image itself"
            if differs
            else "no proof: no reference tokens, or the consumer's answer did not change with the stored embeddings "
            "zeroed"
        ),
    }

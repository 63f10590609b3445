"""Per-stage time of a mode at one load point, and a short "disaggregate or not" reading.

Sources, best first:

1. The pipeline's own per-request timings (``timing_<stage>_ms`` outputs, ``epd``).
2. Otherwise the client's split of each request into the first-token phase (queue +
   preprocess + encode + prefill) and the decode phase (e2e - TTFT), plus Triton's
   compute time for the non-decoupled models the mode runs on (``preprocess``,
   ``vit_encoder`` in the ``ensemble``), which measures the media side directly.
   Decoupled models are left out there: Triton times their ``execute`` call, which
   returns before generation ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.metrics import RequestRecord, e2e_s, ttft_s
from bench.server_stats import ModeLayout

MEDIA_STAGES = ("hash", "lookup", "preprocess", "encode", "vit_encoder", "store")
# vLLM and SGLang report disaggregation losing to colocated serving below about this.
DISAGGREGATION_BREAK_EVEN_CONCURRENCY = 32


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else 0.0


def stage_breakdown(
    records: Sequence[RequestRecord], per_model_ms: dict[str, dict[str, float]], layout: ModeLayout | None
) -> dict[str, Any]:
    done = [r for r in records if r.ok]
    if not done:
        return {"source": "none", "ms": {}, "share": {}, "media_share": None}
    stage_names = sorted({stage for r in done for stage in r.stage_ms})
    if stage_names:
        ms = {s: _mean([r.stage_ms[s] for r in done if s in r.stage_ms]) for s in stage_names}
        total = sum(ms.values())
        media = sum(v for s, v in ms.items() if s in MEDIA_STAGES)
        return {
            "source": "pipeline timings (timing_*_ms outputs)",
            "ms": ms,
            "share": {s: v / total for s, v in ms.items()} if total else {},
            "media_share": media / total if total else None,
        }
    first_token = _mean([ttft_s(r) * 1000 for r in done])
    decode = _mean([(e2e_s(r) - ttft_s(r)) * 1000 for r in done])
    total = first_token + decode
    media_models = {
        name: stats["compute_infer"]
        for name, stats in per_model_ms.items()
        if layout is not None
        and name in layout.models
        and not layout.models[name].decoupled
        and layout.models[name].kind != "ensemble"
    }
    media = sum(media_models.values())
    return {
        "source": "client (first-token phase vs decode)" + (" + Triton per-model compute" if media_models else ""),
        "ms": {"first_token": first_token, "decode": decode, **{f"server:{k}": v for k, v in media_models.items()}},
        "share": {"first_token": first_token / total, "decode": decode / total} if total else {},
        "media_share": media / total if media_models and total else None,
    }


def disaggregation_reading(mode: str, load_label: str, breakdown: dict[str, Any], max_concurrency: float | None) -> str:
    share = breakdown.get("share") or {}
    if not share:
        return f"{mode}: no completed requests, no reading."
    media = breakdown.get("media_share")
    dominant = max(share, key=share.get)
    parts = [f"{mode} at {load_label}: {dominant} dominates ({share[dominant]:.0%} of request time)"]
    if media is not None and media >= 0.4:
        parts.append(
            f"media-side stages take {media:.0%}: scaling encoder instances apart from the LLM and reusing "
            "embeddings (cache hits) should pay off -> disaggregate E"
        )
    elif media is not None:
        parts.append(
            f"media-side stages take only {media:.0%}: extra encoder instances would idle; gains come from "
            "the LLM side (prefill/decode), not from splitting E"
        )
    elif dominant == "first_token":
        parts.append(
            "the first-token phase (queue + media + prefill) dominates; this mode reports no per-stage timings, "
            "so run `epd` (timing outputs) to see whether encode or prefill owns it"
        )
    else:
        parts.append("decode dominates: splitting the encoder off buys little for this workload")
    if max_concurrency is not None and max_concurrency < DISAGGREGATION_BREAK_EVEN_CONCURRENCY:
        parts.append(
            f"at concurrency <= {max_concurrency:g}, below the ~{DISAGGREGATION_BREAK_EVEN_CONCURRENCY} where "
            "vLLM/SGLang see disaggregation pay, expect colocated serving to win"
        )
    return "; ".join(parts) + "."

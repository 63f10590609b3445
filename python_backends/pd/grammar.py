"""Structured outputs across the prefill/decode split: decode continues the grammar prefill began.

Prefill samples the first token under vLLM's own structured outputs (its grammar backend,
``structured_outputs`` in the request). Decode's prompt ends with that token, and vLLM starts a
request's grammar at its first *output* token: given the same ``structured_outputs``, decode would
constrain token 2 as if it were token 1. So decode's request carries the constraint in
``extra_args`` instead (:func:`decode_extra_args`), and :class:`ContinuedGrammarLogitsProcessor`,
a vLLM logits processor the decode engine loads (engine arg ``logits_processors``, see
``pd/engine_args.py``), compiles it with vLLM's own backend (the one vLLM's validation picks, as
prefill's engine did), feeds it prefill's token, then each token decode samples, and masks the
logits as vLLM's scheduler would. The masks are vLLM's for the same grammar state, so greedy
tokens equal ``llm``'s.

What differs: vLLM applies its grammar mask before it computes logprobs, a logits processor
after. So a request that asks for logprobs under a grammar is not served this way (``epd`` serves
it on its colocated path: ``epd/pipeline.py``).

Who calls what: ``DecodeEngine`` (pd/engines.py) calls :func:`decode_extra_args` per request in
the stub's process; vLLM's engine core builds the processor once and calls ``update_state`` and
``apply`` each step. Nothing here imports Triton.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

log = logging.getLogger(__name__)

# The request's ``extra_args`` key: {"spec": StructuredOutputsParams fields, "backend": vLLM's pick,
# "prefix": the token ids the grammar has already accepted on prefill}.
EXTRA_ARG = "epd_continued_grammar"
# The processor, as the decode engine's ``logits_processors`` engine arg names it.
PROCESSOR = f"{__name__}:ContinuedGrammarLogitsProcessor"


def decode_extra_args(structured_outputs: dict[str, Any], prefix: list[int], engine: Any) -> dict[str, Any]:
    """The ``extra_args`` entry of a decode request whose prefill ran under ``structured_outputs``
    (the request's, as parsed) and sampled ``prefix``. vLLM's validation picks the backend here,
    as it did for prefill (``engine``: decode's AsyncLLM, whose config equals prefill's)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    checked = StructuredOutputsParams(**structured_outputs)
    params = SamplingParams(structured_outputs=checked)
    params._validate_structured_outputs(
        engine.model_config, engine.vllm_config.structured_outputs_config, engine.get_tokenizer()
    )
    # vLLM's validation rewrites the constraint for its backend (xgrammar: a choice becomes a grammar):
    # the engine core compiles what it left, as it would for prefill.
    spec = {f.name: getattr(checked, f.name) for f in dataclasses.fields(checked) if f.init}
    return {EXTRA_ARG: {"spec": spec, "backend": checked._backend, "prefix": list(prefix)}}


@dataclass
class _Continued:
    grammar: Any  # vLLM's StructuredOutputGrammar
    output_ids: list[int]  # vLLM's live list of the request's output tokens
    fed: int = 0  # of those, how many the grammar has taken
    request: str = field(default="")


class _Ended:
    """Allows only the stop tokens: the request ends at its next token. Only for a constraint prefill
    compiled and decode cannot (never seen; logged), rather than an unconstrained answer."""

    def __init__(self, stop_token_ids: set[int]) -> None:
        self.stop_token_ids = stop_token_ids

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index].fill_(0)
        for token in self.stop_token_ids:
            bit = 1 << (token % 32)
            bitmask[index, token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 words


class ContinuedGrammarLogitsProcessor(LogitsProcessor):
    """Masks the logits of decode requests that carry :data:`EXTRA_ARG` (the others untouched)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.vllm_config = vllm_config
        self.backend: Any = None  # one per engine, as vLLM's StructuredOutputManager keeps one
        self.states: dict[int, _Continued] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.states, batch_update, self._new_state)
        for state in self.states.values():
            new = state.output_ids[state.fed :]
            if new and not state.grammar.is_terminated():
                if not state.grammar.accept_tokens(state.request, list(new)):
                    log.warning("decode's grammar refused tokens %s it had allowed", list(new))
            state.fed = len(state.output_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        import xgrammar as xgr

        rows = sorted(index for index, state in self.states.items() if not state.grammar.is_terminated())
        if not rows:
            return logits
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.backend.vocab_size)
        for index in rows:
            self.states[index].grammar.fill_bitmask(bitmask, index)
        masked = logits.to(torch.float32)  # xgrammar's CPU kernel takes float32 (as vLLM converts)
        xgr.apply_token_bitmask_inplace(masked, bitmask, indices=rows)
        if masked is not logits:
            logits.copy_(masked)
        return logits

    def _new_state(self, params: Any, prompt_ids: list[int] | None, output_ids: list[int]) -> _Continued | None:
        extra = (params.extra_args or {}).get(EXTRA_ARG)
        if extra is None:
            return None
        from vllm.sampling_params import StructuredOutputsParams
        from vllm.v1.structured_output.request import get_structured_output_key

        try:
            request_type, spec = get_structured_output_key(StructuredOutputsParams(**extra["spec"]))
            grammar = self._backend(extra["backend"]).compile_grammar(
                request_type, spec, stop_token_ids=params.all_stop_token_ids or None
            )
        except Exception:  # an exception here would stop the engine core, every request with it
            log.exception("decode could not compile a grammar prefill compiled; the request ends here")
            grammar = _Ended(set(params.all_stop_token_ids or ()))
        if not grammar.accept_tokens("", list(extra["prefix"])):
            log.warning("decode's grammar refused prefill's tokens %s", extra["prefix"])
        return _Continued(grammar, output_ids)

    def _backend(self, name: str | None) -> Any:
        if self.backend is None:
            from vllm.tokenizers import cached_tokenizer_from_config
            from vllm.v1.structured_output.backend_guidance import GuidanceBackend
            from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

            backends = {"xgrammar": XgrammarBackend, "guidance": GuidanceBackend}
            if name not in backends:
                raise ValueError(f"structured outputs backend {name!r} is not continued across the split")
            model_config = self.vllm_config.model_config
            self.backend = backends[name](
                self.vllm_config,
                tokenizer=cached_tokenizer_from_config(model_config=model_config),
                vocab_size=model_config.get_vocab_size(),
            )
        return self.backend

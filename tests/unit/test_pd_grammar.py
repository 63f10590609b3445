"""decode's continuation of prefill's grammar (python_backends/pd/grammar.py) with a scripted grammar
backend: the prefix and every sampled token reach the grammar in order, only constrained rows are
masked, and a grammar decode cannot compile ends the request instead of stopping the engine. The
real backend (xgrammar, vLLM's) runs in tests/server/test_generation_features.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.v1.sample.logits_processor import BatchUpdate

from python_backends.pd.grammar import EXTRA_ARG, ContinuedGrammarLogitsProcessor

VOCAB = 64


class ScriptedGrammar:
    """Allows only the token after the last one it took (a counting grammar)."""

    def __init__(self) -> None:
        self.taken: list[int] = []

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        self.taken += tokens
        return True

    def is_terminated(self) -> bool:
        return len(self.taken) >= 6

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        allowed = (self.taken[-1] + 1) % VOCAB
        bitmask[index].fill_(0)
        bitmask[index, allowed // 32] = 1 << (allowed % 32)


class ScriptedBackend:
    vocab_size = VOCAB

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.grammars: list[ScriptedGrammar] = []
        self.compiled: list[tuple] = []

    def compile_grammar(self, request_type, spec, stop_token_ids=None):
        if self.fail:
            raise ValueError("unsupported")
        self.compiled.append((request_type, spec, stop_token_ids))
        self.grammars.append(ScriptedGrammar())
        return self.grammars[-1]


def params(extra: dict | None) -> SimpleNamespace:
    return SimpleNamespace(extra_args=extra, all_stop_token_ids={63})


def processor(backend: ScriptedBackend) -> ContinuedGrammarLogitsProcessor:
    proc = ContinuedGrammarLogitsProcessor(None, torch.device("cpu"), False)
    proc.backend = backend
    return proc


def added(index: int, extra: dict | None, outputs: list[int]) -> BatchUpdate:
    return BatchUpdate(batch_size=index + 1, removed=[], added=[(index, params(extra), [1, 2], outputs)], moved=[])


CONTINUED = {EXTRA_ARG: {"spec": {"regex": "[a-z]+"}, "backend": "xgrammar", "prefix": [10]}}


def test_the_grammar_takes_prefills_token_then_decodes_and_masks_only_its_row():
    backend = ScriptedBackend()
    proc = processor(backend)
    outputs: list[int] = []
    proc.update_state(added(1, CONTINUED, outputs))
    proc.update_state(added(0, None, []))  # an unconstrained request beside it
    (grammar,) = backend.grammars
    assert grammar.taken == [10] and backend.compiled[0][2] == {63}
    logits = proc.apply(torch.zeros(2, VOCAB))
    assert torch.isfinite(logits[0]).all()  # the other request untouched
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [11]
    outputs += [11, 12]  # vLLM appends what it sampled to the live list
    proc.update_state(None)
    assert grammar.taken == [10, 11, 12]
    assert torch.isfinite(proc.apply(torch.zeros(2, VOCAB))[1]).nonzero().flatten().tolist() == [13]
    proc.update_state(BatchUpdate(batch_size=1, removed=[1], added=[], moved=[]))
    assert proc.states == {} and torch.isfinite(proc.apply(torch.zeros(1, VOCAB))).all()


def test_a_grammar_decode_cannot_compile_allows_only_the_stop_tokens():
    proc = processor(ScriptedBackend(fail=True))
    proc.update_state(added(0, CONTINUED, []))
    logits = proc.apply(torch.zeros(1, VOCAB))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [63]


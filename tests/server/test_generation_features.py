"""Structured outputs, logprobs and n on every path that serves them, against real servers.

The paths: ``llm`` (the baseline), ``epd`` colocated and ``epd`` disaggregated (prefill -> KV
transfer -> decode: the grammar's state and the first token's logprobs come from prefill) on the
session's server, and the E|PD topology (encoder models encode, epd's one engine serves; its own
server, started with a checkpoint's generation_config.json that sets ``top_k: 1``).

A random-weight model answers validly under a grammar as long as it ends: greedy, it prefers
whitespace, which JSON allows without end, so the JSON requests bias whitespace-only tokens away
(``logit_bias``, a feature under test too; the schema and the bias are the benchmark's,
bench/generation_features.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import shutil
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import tritonclient.grpc as grpcclient

from bench.generation_features import SCHEMA, whitespace_tokens
from builders.launcher import prepare
from builders.repository import TARGETS
from builders.roles import role_models
from builders.tritonserver import REPO_ROOT, Ports, ServerOptions, TritonServer
from client.epd_client import build_inputs, chat_prompt
from tests.images import synthetic_image
from tests.server.conftest import LOG_DIR, NODE_DIR, SLOT, TEST_EXIT_TIMEOUT_S, serving
from tests.server.test_epd_paths import metrics_text, path_requests

pytestmark = pytest.mark.server

RESPONSE_TIMEOUT_S = 300.0
TWO_CORES = len(os.sched_getaffinity(0)) >= 2
REQUESTS_PER_KIND = 50
REGEX = "[a-z]{3,8}-[0-9]{2,4}"
CHOICES = ["cat", "dog", "a red car", "nothing at all"]


@dataclass
class Sequence_:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str = ""


@dataclass
class Generation:
    sequences: dict[int, Sequence_] = field(default_factory=dict)
    prompt_logprobs: list[Any] | None = None
    serving_path: str | None = None
    error: str | None = None

    def one(self) -> Sequence_:
        assert self.error is None, self.error
        assert list(self.sequences) == [0], list(self.sequences)
        return self.sequences[0]


def generate(
    server: TritonServer,
    model: str,
    prompt: str,
    images: Sequence[bytes],
    sampling: dict[str, Any] | None,
    path: str | None = None,
    stream: bool = True,
) -> Generation:
    """One request on its own gRPC stream; every response's outputs gathered per sequence."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.Queue = queue.Queue()
    answer = Generation()
    try:
        inputs = build_inputs(grpcclient, prompt, images, stream, sampling, None if stream else True)
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        parameters = None if path is None else {"path": path}
        client.async_stream_infer(model, inputs, enable_empty_final_response=True, parameters=parameters)
        while True:
            result, error = responses.get(timeout=RESPONSE_TIMEOUT_S)
            if error is not None:
                answer.error = error.message()
                return answer
            if result.as_numpy("text_output") is not None:
                index = int(result.as_numpy("output_index").reshape(-1)[0])
                sequence = answer.sequences.setdefault(index, Sequence_())
                sequence.text += "".join(t.decode() for t in result.as_numpy("text_output").reshape(-1))
                sequence.token_ids += [int(t) for t in result.as_numpy("output_token_ids").reshape(-1)]
                sequence.finish_reason = (
                    result.as_numpy("finish_reason").reshape(-1)[0].decode() or sequence.finish_reason
                )
                sequence.logprobs += json.loads(result.as_numpy("logprobs").reshape(-1)[0]) or []
                if (prompt_logprobs := json.loads(result.as_numpy("prompt_logprobs").reshape(-1)[0])) is not None:
                    answer.prompt_logprobs = prompt_logprobs
            if (served := result.as_numpy("serving_path")) is not None:
                answer.serving_path = served.reshape(-1)[0].decode()
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return answer
    finally:
        client.stop_stream()
        client.close()


@pytest.fixture(scope="module")
def greedy_checkpoint(model_dir: Path) -> Path:
    """A folder whose generation_config.json sets top_k 1 (as Qwen2-VL-2B-Instruct's does)."""
    folder = REPO_ROOT / "build" / "test-slots" / f"greedy-generation-config-{SLOT}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "top_k": 1}))
    return folder


@pytest.fixture(scope="module")
def epd_split(model_dir: Path, greedy_checkpoint: Path) -> Iterator[TritonServer]:
    """E|PD: the encoder models on CPU 0, epd's engine on CPU 1, every new image encoded by the
    encoders; sampling defaults from ``greedy_checkpoint`` (``llm`` loaded too, for them)."""
    repository = REPO_ROOT / "build" / "test-slots" / f"generation-split-{SLOT}"
    cache = dataclasses.replace(TARGETS["cpu"].cache, path=str(NODE_DIR / "generation-split-embeddings"))
    prepare("cpu", model_dir, repository, cache=cache, kv_store_path=str(NODE_DIR / "generation-split-kv"),
            cpus=["encoders=0", "engines=1"] if TWO_CORES else None, colocated_encodes="encoders",
            generation_config=str(greedy_checkpoint))  # fmt: skip
    models = (*role_models(TARGETS["cpu"], "encoder"), "epd", "llm")  # llm: the defaults on both interfaces
    options = ServerOptions(
        repository, Ports.free(), exit_timeout_s=TEST_EXIT_TIMEOUT_S,
        extra_args=("--model-control-mode=explicit", *(f"--load-model={m}" for m in models)),
    )  # fmt: skip
    with serving(options, LOG_DIR / "generation-split.log") as running:
        yield running


@pytest.fixture(scope="module")
def paths(server: TritonServer, epd_split: TritonServer) -> dict[str, tuple[TritonServer, str, str | None]]:
    """Path name -> (server, model, the ``path`` request parameter)."""
    return {
        "llm": (server, "llm", None),
        "epd colocated": (server, "epd", "colocated"),
        "epd disaggregated": (server, "epd", "disaggregated"),
        "E|PD": (epd_split, "epd", None),
    }


IMAGES = [synthetic_image(w, h, seed=7700 + w) for w, h in ((320, 240), (256, 256), (448, 224), (200, 300), (512, 384))]


def kind_requests(kind: str, model_dir: Path) -> list[tuple[str, list[bytes], dict[str, Any]]]:
    constraint = {
        "json_schema": {"json": SCHEMA},
        "json_object": {"json_object": True},
        "regex": {"regex": REGEX},
        "choice": {"choice": CHOICES},
    }[kind]
    sampling: dict[str, Any] = {"temperature": 0.0, "max_tokens": 160, "structured_outputs": constraint}
    if kind.startswith("json"):
        sampling["logit_bias"] = whitespace_tokens(model_dir, closing=kind == "json_object")
    return [
        (chat_prompt(f"Request {i}: answer about the picture as asked.", 1), [IMAGES[i % len(IMAGES)]], sampling)
        for i in range(REQUESTS_PER_KIND)
    ]


def valid(kind: str, text: str) -> bool:
    """``text`` answers the constraint. JSON strings may hold raw control characters: the tiny
    checkpoint's byte-level tokens put them there and the grammar backend (xgrammar 0.2.8) lets
    them through; Python's strict parser alone refuses them (strict=False reads them as text)."""
    try:
        if kind == "json_schema":
            jsonschema.validate(json.loads(text, strict=False), SCHEMA)
            return True
        if kind == "json_object":
            return isinstance(json.loads(text, strict=False), dict)
    except (ValueError, jsonschema.ValidationError):
        return False
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


@pytest.mark.parametrize("kind", ["json_schema", "regex", "choice", "json_object"])
def test_structured_outputs_are_valid_and_token_equal_on_every_path(paths, model_dir, kind):
    requests = kind_requests(kind, model_dir)
    answers: dict[str, list[Generation]] = {}
    with ThreadPoolExecutor(8) as pool:
        for name, (server, model, path) in paths.items():
            answers[name] = list(pool.map(generate, *zip(*[(server, model, *r, path) for r in requests], strict=True)))
    for name, generations in answers.items():
        texts = [g.one().text for g in generations]
        invalid = [t for t in texts if not valid(kind, t)]
        assert not invalid, f"{name}: {len(invalid)} of {len(texts)} invalid, e.g. {invalid[:3]}"
        if name != "llm":
            assert [g.one().token_ids for g in generations] == [g.one().token_ids for g in answers["llm"]], name
    served = {g.serving_path for name in ("epd colocated", "epd disaggregated") for g in answers[name]}
    assert served == {"colocated", "disaggregated"}


def close_logprobs(ours: Sequence[Any], theirs: Sequence[Any], tolerance: float = 1e-4) -> list[str]:
    """Where two logprobs lists differ: token sets, or values beyond ``tolerance``."""
    differ = []
    for position, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a is None or b is None:
            if a != b:
                differ.append(f"{position}: {a} vs {b}")
            continue
        common = set(a) & set(b)
        worst = max((abs(a[t]["logprob"] - b[t]["logprob"]) for t in common), default=0.0)
        # Alternatives at the edge of the top k may swap on a near tie; most must be shared.
        if len(common) < max(len(a), len(b)) - 1 or worst > tolerance:
            differ.append(f"{position}: {sorted(a)} vs {sorted(b)}, worst {worst:.2e}")
    return differ


@pytest.mark.parametrize("top", [0, 1, 5, 20])
def test_logprobs_give_that_many_alternatives_and_llms_values_on_every_path(paths, top):
    prompt, images = chat_prompt("Describe the picture.", 1), [IMAGES[1]]
    sampling = {"temperature": 0.0, "max_tokens": 8, "logprobs": top, "prompt_logprobs": top}
    answers = {
        name: generate(server, model, prompt, images, sampling, path=path)
        for name, (server, model, path) in paths.items()
    }
    llm = answers["llm"].one()
    assert len(llm.logprobs) == len(llm.token_ids) == 8
    for name, answer in answers.items():
        sequence = answer.one()
        assert sequence.token_ids == llm.token_ids, name
        for token, position in zip(sequence.token_ids, sequence.logprobs, strict=True):
            assert str(token) in position and len(position) in (top, top + 1) and len(position) >= 1, (name, position)
            assert set(range(1, top + 1)) <= {entry["rank"] for entry in position.values()}, (name, position)
        assert not close_logprobs(sequence.logprobs, llm.logprobs), (
            name,
            close_logprobs(sequence.logprobs, llm.logprobs),
        )
        prompt_logprobs = answer.prompt_logprobs
        assert prompt_logprobs is not None and prompt_logprobs[0] is None, name
        assert len(prompt_logprobs) == len(answers["llm"].prompt_logprobs or []), name
        assert not close_logprobs(prompt_logprobs, answers["llm"].prompt_logprobs or []), name


@pytest.mark.parametrize("stream", [True, False])
def test_n_3_with_a_seed_gives_3_reproducible_choices_on_every_path(paths, stream):
    prompt, images = chat_prompt("Tell a story about it.", 1), [IMAGES[2]]
    sampling = {"temperature": 1.0, "top_k": -1, "max_tokens": 10, "n": 3, "seed": 11, "logprobs": 1}
    for name, (server, model, path) in paths.items():
        first, again = (generate(server, model, prompt, images, sampling, path=path, stream=stream) for _ in range(2))
        assert first.error is None, (name, first.error)
        assert sorted(first.sequences) == [0, 1, 2], (name, sorted(first.sequences))
        runs = [[first.sequences[i].token_ids for i in range(3)], [again.sequences[i].token_ids for i in range(3)]]
        assert runs[0] == runs[1], name
        assert len({tuple(tokens) for tokens in runs[0]}) > 1, (name, runs[0])  # three samples, not one thrice
        assert all(len(first.sequences[i].logprobs) == len(first.sequences[i].token_ids) for i in range(3)), name
        if name == "epd colocated":  # the same engine semantics as llm's: the same three
            llm = generate(paths["llm"][0], "llm", prompt, images, sampling, stream=stream)
            assert [llm.sequences[i].token_ids for i in range(3)] == runs[0]


def test_logprobs_under_a_grammar_are_served_where_vllm_masks_them(paths):
    """Decode masks with a logits processor, after vLLM has computed logprobs: such a request goes to
    the colocated path (adaptive), and one forced onto the split is refused, naming the reason."""
    server, _, _ = paths["llm"]
    sampling = {"temperature": 0.0, "max_tokens": 6, "logprobs": 2, "structured_outputs": {"choice": CHOICES}}
    prompt, images = chat_prompt("Which one?", 1), [IMAGES[0]]
    llm = generate(server, "llm", prompt, images, sampling).one()
    before = path_requests(metrics_text(server), "colocated", '[^"]*')
    colocated = generate(server, "epd", prompt, images, sampling)
    assert colocated.one().token_ids == llm.token_ids and colocated.serving_path == "colocated"
    assert colocated.one().logprobs == llm.logprobs
    # counted on /metrics as served by the colocated path (by rule: pipeline.serving, unit-tested)
    assert path_requests(metrics_text(server), "colocated", '[^"]*') == before + 1
    forced = generate(server, "epd", prompt, images, sampling, path="disaggregated")
    assert forced.error is not None and "served on the colocated path only" in forced.error
    assert generate(server, "epd", prompt, images, {"max_tokens": 4}).error is None  # serves on
    greedy_n = generate(server, "epd", prompt, images, {"temperature": 0.0, "n": 2}, path="disaggregated")
    assert greedy_n.error is not None and "'n' must be 1 when sampling greedily" in greedy_n.error  # as vLLM


@pytest.mark.parametrize(
    "sampling, field_name",
    [
        ({"logprobs": 21}, "'logprobs' is 21, above this model's limit of 20 (max_logprobs)"),
        ({"n": 17}, "'n' is 17, above this model's limit of 16 (max_n)"),
        ({"structured_outputs": {"json": {"type": 7}}}, "'structured_outputs.json' is not a valid JSON schema"),
        ({"structured_outputs": {"regex": "(a"}}, "'structured_outputs.regex' is not a valid regular expression"),
    ],
)
def test_limits_are_invalid_arg_naming_the_field_and_the_server_serves_on(paths, sampling, field_name):
    for name, (server, model, path) in paths.items():
        answer = generate(server, model, chat_prompt("hi", 1), [IMAGES[0]], sampling, path=path)
        assert answer.error is not None and field_name in answer.error, (name, answer.error)
    assert generate(*paths["llm"][:2], chat_prompt("hi", 1), [IMAGES[0]], {"max_tokens": 2}).error is None


def test_the_checkpoints_top_k_1_makes_an_unset_request_greedy_and_the_request_wins(paths):
    """E|PD's server reads a generation_config.json with top_k 1: a request that sets no sampling
    answers the greedy tokens (llm's with temperature 0); one that sets top_k -1 samples."""
    server = paths["E|PD"][0]
    prompt, images = chat_prompt("What is here?", 1), [IMAGES[3]]
    greedy = generate(paths["llm"][0], "llm", prompt, images, {"temperature": 0.0, "max_tokens": 12}).one()
    for model in ("epd", "llm"):
        unset = [generate(server, model, prompt, images, {"max_tokens": 12}).one().token_ids for _ in range(2)]
        assert unset == [greedy.token_ids, greedy.token_ids], model
        sampled = {
            tuple(generate(server, model, prompt, images, {"max_tokens": 12, "top_k": -1, "seed": s}).one().token_ids)
            for s in range(3)
        }
        assert len(sampled) > 1 and tuple(greedy.token_ids) not in sampled, model


def test_the_ensemble_passes_them_to_llm(paths, model_dir):
    """``ensemble`` (encode's steps -> llm, embeddings by value) maps llm's new outputs too."""
    server = paths["llm"][0]
    prompt, images = chat_prompt("Describe the picture.", 1), [IMAGES[4]]
    sampling = {"temperature": 1.0, "seed": 5, "max_tokens": 8, "logprobs": 3, "n": 2}
    llm, ensemble = (generate(server, model, prompt, images, sampling) for model in ("llm", "ensemble"))
    assert sorted(ensemble.sequences) == [0, 1] and ensemble.error is None
    for index in (0, 1):
        assert ensemble.sequences[index].token_ids == llm.sequences[index].token_ids
        assert not close_logprobs(ensemble.sequences[index].logprobs, llm.sequences[index].logprobs)
    (prompt_text, request_images, structured) = kind_requests("json_schema", model_dir)[0]
    answer = generate(server, "ensemble", prompt_text, request_images, structured).one()
    assert valid("json_schema", answer.text)

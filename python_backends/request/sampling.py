"""Parse and check the ``sampling_parameters`` JSON input.

Only the vLLM sampling fields that make sense over the wire are accepted; anything else
is an INVALID_ARG that names the field, so a typo never silently falls back to defaults.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from python_backends import contract
from python_backends.errors import invalid_arg

DEFAULT_MAX_TOKENS = 16  # vLLM's own default
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature samples greedily


@dataclass(frozen=True)
class SamplingLimits:
    """What a request may ask (config parameters ``max_tokens_limit``, ``max_logprobs``, ``max_n``)."""

    max_tokens: int = int(contract.default_of(contract.MAX_TOKENS_LIMIT))
    max_logprobs: int = int(contract.default_of(contract.MAX_LOGPROBS))
    max_n: int = int(contract.default_of(contract.MAX_N))

    @classmethod
    def from_params(cls, params: Any) -> SamplingLimits:
        """``params``: a model's ``ModelParameters``."""
        return cls(
            params.integer(contract.MAX_TOKENS_LIMIT),
            params.integer(contract.MAX_LOGPROBS),
            params.integer(contract.MAX_N),
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    # JSON's NaN and Infinity parse to floats; no sampling parameter means anything by them.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(v) for v in value)


def _is_logit_bias(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and re.fullmatch("[0-9]{1,10}", k) is not None and _is_number(v) for k, v in value.items()
    )


# vLLM's StructuredOutputsParams: one constraint, and its options.
STRUCTURED_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
_STRUCTURED_OPTIONS = {
    "disable_any_whitespace": bool,
    "disable_additional_properties": bool,
    "whitespace_pattern": str,
}


def _structured_outputs(value: Any) -> dict[str, Any]:
    """``structured_outputs`` checked: one constraint of a known kind, well formed (a JSON schema
    that is a schema, a regex that compiles); the grammar backend checks the rest when the engine
    takes the request (then INVALID_ARG with vLLM's message)."""
    name = "structured_outputs"
    if not isinstance(value, dict):
        raise invalid_arg(
            f"sampling parameter '{name}' must be an object with one of {', '.join(STRUCTURED_CONSTRAINTS)}"
        )
    unknown = sorted(set(value) - set(STRUCTURED_CONSTRAINTS) - set(_STRUCTURED_OPTIONS))
    if unknown:
        raise invalid_arg(
            f"unknown field '{name}.{unknown[0]}'; supported: "
            f"{', '.join([*STRUCTURED_CONSTRAINTS, *_STRUCTURED_OPTIONS])}"
        )
    given = [kind for kind in STRUCTURED_CONSTRAINTS if value.get(kind) is not None]
    if len(given) != 1:
        raise invalid_arg(
            f"sampling parameter '{name}' must set exactly one of {', '.join(STRUCTURED_CONSTRAINTS)}, "
            f"got {given or 'none'}"
        )
    for option, kind in _STRUCTURED_OPTIONS.items():
        if value.get(option) is not None and not isinstance(value[option], kind):
            raise invalid_arg(f"'{name}.{option}' must be a {kind.__name__}")
    constraint = given[0]
    field = f"{name}.{constraint}"
    spec = value[constraint]
    if constraint == "json":
        _check_json_schema(spec, field)
    elif constraint == "regex":
        if not isinstance(spec, str):
            raise invalid_arg(f"'{field}' must be a string")
        try:
            re.compile(spec)
        except re.error as exc:
            raise invalid_arg(f"'{field}' is not a valid regular expression: {exc}") from None
    elif constraint == "choice":
        if not (isinstance(spec, list) and spec and all(isinstance(c, str) for c in spec)):
            raise invalid_arg(f"'{field}' must be a non-empty list of strings")
    elif constraint == "grammar":
        if not isinstance(spec, str) or not spec.strip():
            raise invalid_arg(f"'{field}' must be a grammar (EBNF text)")
    elif spec is not True:
        raise invalid_arg(f"'{field}' must be true")
    return dict(value)


def _check_json_schema(spec: Any, field: str) -> None:
    import jsonschema

    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise invalid_arg(f"'{field}' is not valid JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise invalid_arg(f"'{field}' must be a JSON schema (an object)")
    try:
        jsonschema.validators.validator_for(spec).check_schema(spec)
    except jsonschema.SchemaError as exc:
        raise invalid_arg(f"'{field}' is not a valid JSON schema: {exc.message}") from None


# field -> (type check, type name, range check or None, range description)
_FIELDS: dict[str, tuple[Callable[[Any], bool], str, Callable[[Any], bool] | None, str]] = {
    "max_tokens": (_is_int, "integer", lambda v: v >= 1, ">= 1"),
    "min_tokens": (_is_int, "integer", lambda v: v >= 0, ">= 0"),
    "temperature": (_is_number, "finite number", lambda v: v >= 0, ">= 0"),
    "top_p": (_is_number, "finite number", lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (_is_int, "integer", lambda v: v == -1 or v >= 0, "-1, 0 or >= 1"),
    "min_p": (_is_number, "finite number", lambda v: 0 <= v <= 1, "in [0, 1]"),
    # vLLM's own server bounds the seed to a 64-bit signed integer (torch's generators take no more).
    "seed": (_is_int, "integer", lambda v: -(2**63) <= v < 2**63, "a 64-bit signed integer"),
    "presence_penalty": (_is_number, "finite number", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "frequency_penalty": (_is_number, "finite number", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "repetition_penalty": (_is_number, "finite number", lambda v: v > 0, "> 0"),
    "stop": (_is_str_list, "string or list of strings", None, ""),
    "stop_token_ids": (_is_int_list, "list of integers", None, ""),
    "ignore_eos": (lambda v: isinstance(v, bool), "boolean", None, ""),
    "skip_special_tokens": (lambda v: isinstance(v, bool), "boolean", None, ""),
    "include_stop_str_in_output": (lambda v: isinstance(v, bool), "boolean", None, ""),
    "spaces_between_special_tokens": (lambda v: isinstance(v, bool), "boolean", None, ""),
    # Limits that depend on the model (max_logprobs, max_n) are checked in parse_sampling_parameters.
    "logprobs": (_is_int, "integer", lambda v: v >= 0, ">= 0"),
    "prompt_logprobs": (_is_int, "integer", lambda v: v >= 0, ">= 0"),
    "n": (_is_int, "integer", lambda v: v >= 1, ">= 1"),
    "logit_bias": (
        _is_logit_bias,
        "object of token id -> number",
        lambda v: all(-100 <= b <= 100 for b in v.values()),
        "within [-100, 100] per token",
    ),
    "allowed_token_ids": (
        _is_int_list,
        "list of integers",
        lambda v: len(v) > 0 and min(v) >= 0,
        "non-empty, ids >= 0",
    ),
    "bad_words": (lambda v: isinstance(v, list) and all(isinstance(w, str) for w in v), "list of strings", None, ""),
    "structured_outputs": (lambda v: True, "object", None, ""),
}
SUPPORTED_FIELDS = tuple(sorted(_FIELDS))


def parse_sampling_parameters(
    raw: str | bytes | None, limits: SamplingLimits, defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Validated keyword arguments for ``vllm.SamplingParams`` (max_tokens always set).
    ``defaults``: the checkpoint's (request/generation_defaults.py); what the request sets wins."""
    params: dict[str, Any] = {}
    if raw:
        try:
            loaded = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise invalid_arg(f"sampling_parameters is not valid JSON: {exc}") from None
        if not isinstance(loaded, dict):
            raise invalid_arg("sampling_parameters must be a JSON object")
        params = loaded
    for name, value in params.items():
        if name not in _FIELDS:
            raise invalid_arg(f"unknown sampling parameter '{name}'; supported: {', '.join(SUPPORTED_FIELDS)}")
        type_ok, type_name, range_ok, range_text = _FIELDS[name]
        if not type_ok(value):
            raise invalid_arg(f"sampling parameter '{name}' must be a {type_name}, got {value!r}")
        if range_ok is not None and not range_ok(value):
            raise invalid_arg(f"sampling parameter '{name}' must be {range_text}, got {value!r}")
    if "structured_outputs" in params:
        params["structured_outputs"] = _structured_outputs(params["structured_outputs"])
    params = {**(defaults or {}), **params}
    params.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    for name, limit, key in (
        ("max_tokens", limits.max_tokens, contract.MAX_TOKENS_LIMIT),
        ("logprobs", limits.max_logprobs, contract.MAX_LOGPROBS),
        ("prompt_logprobs", limits.max_logprobs, contract.MAX_LOGPROBS),
        ("n", limits.max_n, contract.MAX_N),
    ):
        if params.get(name) is not None and params[name] > limit:
            raise invalid_arg(
                f"sampling parameter '{name}' is {params[name]}, above this model's limit of {limit} ({key})"
            )
    if params.get("n", 1) > 1 and params.get("temperature", 1.0) < GREEDY_BELOW:
        raise invalid_arg("sampling parameter 'n' must be 1 when sampling greedily (temperature 0), as vLLM's")
    return params

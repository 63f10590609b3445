"""Parse and check the ``sampling_parameters`` JSON input.

Only the vLLM sampling fields that make sense over the wire are accepted; anything else
is an INVALID_ARG that names the field, so a typo never silently falls back to defaults.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from python_backends.errors import invalid_arg

DEFAULT_MAX_TOKENS = 16  # vLLM's own default


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    # JSON's NaN and Infinity parse to floats; no sampling parameter means anything by them.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(v, str) for v in value)
    )


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(v) for v in value)


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
}
SUPPORTED_FIELDS = tuple(sorted(_FIELDS))


def parse_sampling_parameters(raw: str | bytes | None, max_tokens_limit: int) -> dict[str, Any]:
    """Validated keyword arguments for ``vllm.SamplingParams`` (max_tokens always set)."""
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
            raise invalid_arg(
                f"unknown sampling parameter '{name}'; supported: {', '.join(SUPPORTED_FIELDS)}"
            )
        type_ok, type_name, range_ok, range_text = _FIELDS[name]
        if not type_ok(value):
            raise invalid_arg(f"sampling parameter '{name}' must be a {type_name}, got {value!r}")
        if range_ok is not None and not range_ok(value):
            raise invalid_arg(f"sampling parameter '{name}' must be {range_text}, got {value!r}")
    params.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    if params["max_tokens"] > max_tokens_limit:
        raise invalid_arg(
            f"sampling parameter 'max_tokens' is {params['max_tokens']}, above this model's "
            f"limit of {max_tokens_limit} (max_tokens_limit)"
        )
    return params

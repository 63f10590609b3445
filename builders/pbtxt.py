"""config.pbtxt text: templates with strict placeholders, tensors, parameters, ensemble steps.

Every model's config is ``builders/templates/<model>*.pbtxt`` with ``${name}`` placeholders;
a placeholder without a value, or one left in the result (a half-rendered fragment passed as
a value), fails the build instead of reaching Triton.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from python_backends.contract import TensorSpec

TEMPLATES = Path(__file__).resolve().parent / "templates"

_PLACEHOLDER = re.compile(r"\$\{?\w+\}?")


def render_template(template_name: str, values: Mapping[str, str], templates: Path = TEMPLATES) -> str:
    """Fill ``${name}`` placeholders; a missing value or a leftover one is an error."""
    text = (templates / template_name).read_text()
    try:
        rendered = string.Template(text).substitute(values)
    except KeyError as exc:
        raise ValueError(f"{template_name}: no value for placeholder {exc}") from None
    leftover = _PLACEHOLDER.findall(rendered)
    if leftover:
        raise ValueError(f"{template_name}: unfilled placeholders {leftover}")
    return rendered


def render_parameters(parameters: Mapping[str, Any]) -> str:
    """Triton's parameters are strings; keys sorted so that a config is the same every build."""
    entries = [
        f'  {{ key: "{key}" value: {{ string_value: {json.dumps(str(value))} }} }}'
        for key, value in sorted(parameters.items())
    ]
    return ",\n".join(entries)


def render_dims(dims: Sequence[int | str]) -> str:
    return "[ " + ", ".join(str(d) for d in dims) + " ]" if dims else "[ ]"


def render_tensor(spec: TensorSpec) -> str:
    """One ``input``/``output`` entry; ``spec`` must be sized (no named dims left)."""
    named = [d for d in (*spec.dims, *(spec.reshape or ())) if not isinstance(d, int)]
    if named:
        raise ValueError(f"tensor '{spec.name}' still has named dims {named}: size it with the encoder's facts")
    text = f'  {{ name: "{spec.name}" data_type: {spec.data_type} dims: {render_dims(spec.dims)}'
    if spec.reshape is not None:
        text += f" reshape: {{ shape: {render_dims(spec.reshape)} }}"
    if spec.ragged:
        text += " allow_ragged_batch: true"
    if spec.optional:
        text += " optional: true"
    return text + " }"


def render_tensors(tensors: Iterable[TensorSpec]) -> str:
    return ",\n".join(render_tensor(t) for t in tensors)


@dataclass(frozen=True)
class EnsembleStep:
    model: str
    inputs: dict[str, str]  # the model's input name -> ensemble tensor
    outputs: dict[str, str]  # the model's output name -> ensemble tensor

    def render(self) -> str:
        maps = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in self.inputs.items()]
        maps += [f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in self.outputs.items()]
        body = "\n".join(f"      {m}" for m in maps)
        return f'    {{\n      model_name: "{self.model}"\n      model_version: -1\n{body}\n    }}'


def render_steps(steps: Iterable[EnsembleStep]) -> str:
    return ",\n".join(step.render() for step in steps)

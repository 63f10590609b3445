"""Server roles for scale-out: which of a target's models one ``tritonserver`` serves.

- ``all`` (default): every model, today's single server.
- ``encoder``: the encode side -- ``preprocess``, (gpu) ``vit_positions``, ``vit_encoder``,
  ``encode`` and the cached encoder models ``encoder_<i>`` that write the node store.
- ``pd``: ``epd``, ``prefill``, ``decode`` and ``llm`` (the colocated baseline stays beside them).

Servers of several roles on one node may share the node store (same store path) and then pass
embeddings by reference, zero-copy, as one server does. A role server loads only its models
(Triton's explicit model control, :func:`load_model_args`), so another role's leftovers in a
shared repository folder are never loaded.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Literal

from builders.targets import PD_MODELS, Target
from python_backends import contract
from python_backends.runtime.cpus import format_cpu_list, parse_cpu_list

Role = Literal["all", "encoder", "pd"]
ROLES: tuple[Role, ...] = ("all", "encoder", "pd")


def role_models(target: Target, role: Role) -> tuple[str, ...]:
    """The models a server of ``role`` serves, in the target's order."""
    if role == "all":
        return target.models
    if role == "encoder":
        wanted = {*target.encode.models, *target.cache.encoder_models}
    elif role == "pd":
        wanted = {contract.LLM_MODEL, *PD_MODELS}
    else:
        raise ValueError(f"unknown role {role!r}; choose one of {', '.join(ROLES)}")
    return tuple(model for model in target.models if model in wanted)


def load_model_args(target: Target, role: Role) -> tuple[str, ...]:
    """tritonserver flags for ``role``: none for ``all`` (load the whole repository), else
    explicit model control loading exactly the role's models."""
    if role == "all":
        return ()
    return ("--model-control-mode=explicit", *(f"--load-model={model}" for model in role_models(target, role)))


def group_models(target: Target, group: str) -> tuple[str, ...]:
    """``--cpus GROUP=LIST``'s groups: ``encoders`` (the encoder role's models) and ``engines``
    (epd, prefill, decode: the pipeline's engines; ``llm``, the baseline, is named by itself)."""
    wanted = set(role_models(target, "encoder")) if group == "encoders" else set(PD_MODELS)
    return tuple(model for model in target.models if model in wanted)


CPU_GROUPS = ("encoders", "engines")


def model_cpu_sets(target: Target, specs: Sequence[str], role: Role = "all") -> dict[str, str]:
    """``--cpus`` values -> model name -> CPU list (``Target.cpu_sets``). Each spec is ``LIST``
    (every model the role serves), ``GROUP=LIST`` (:func:`group_models`) or ``MODEL=LIST``; a
    later spec wins, so ``0 llm=0-1`` puts every model on CPU 0 but ``llm`` on both."""
    served = role_models(target, role)
    sets: dict[str, str] = {}
    for spec in specs:
        name, equals, cpu_list = spec.rpartition("=")
        if not equals:
            models: tuple[str, ...] = served
        elif name in CPU_GROUPS:
            models = tuple(m for m in group_models(target, name) if m in served)
        elif name in served:
            models = (name,)
        else:
            groups = ", ".join((*CPU_GROUPS, *served))
            raise ValueError(f"--cpus {spec!r}: {name!r} is neither a group nor a model of this server ({groups})")
        cpus = parse_cpu_list(cpu_list)
        if not cpus:
            raise ValueError(f"--cpus {spec!r} names no CPU")
        sets.update(dict.fromkeys(models, format_cpu_list(cpus)))
    return sets


def server_cpus(specs: Sequence[str]) -> frozenset[int] | None:
    """The CPU set of the whole server among ``--cpus`` specs (the last ``LIST`` without a name),
    for ``ServerOptions.cpus``; None when no spec names the whole server."""
    whole = [spec for spec in specs if "=" not in spec]
    return parse_cpu_list(whole[-1]) if whole else None


def add_cpus_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cpus", action="append", default=[], metavar="[GROUP=]LIST",
        help="CPU set (Linux CPU list, e.g. 0 or 0-1,3) of the whole server (LIST), of a model group "
        "(encoders=LIST, engines=LIST) or of one model (MODEL=LIST); repeatable, later wins. Thread "
        "counts (OpenMP per engine, ONNX Runtime, DALI) are capped at each set's size (docs/serving-paths.md)",
    )  # fmt: skip

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

from typing import Literal

from builders.targets import PD_MODELS, Target
from python_backends import contract

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

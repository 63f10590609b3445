"""Engine args of the ``prefill`` and ``decode`` roles, and the checks that keep decode honest.

Who calls it: ``builders/model_configs.py`` writes each role's JSON with :func:`pd_engine_args`
(from the colocated ``llm`` args); ``pd/engines.py`` runs :func:`check_engine_args` before an
engine starts. Pure Python, no vLLM: the builders import it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from python_backends.pd.transfer import NIXL_CONNECTOR, TRANSFER_ID_CONNECTOR

Role = Literal["prefill", "decode"]
CONNECTOR_NAME = TRANSFER_ID_CONNECTOR
CONNECTOR_MODULE = "python_backends.pd.connector"
# The connectors a target may choose (builders/targets.py, PdServing.kv_connector) -> the module
# that holds it (None: vLLM's own). TransferIdConnector is the cpu default: files in a tmpfs
# folder, keyed by our transfer id. NixlConnector (vLLM 0.32, ``nixl`` package) moves KV
# GPU-to-GPU on one node (UCX/NVLink) without a host copy. Both serve the same epd transfer
# parameters (:class:`python_backends.pd.transfer.TransferParams`, the connector's own
# ``kv_transfer_params`` inside) and the same checks on the decode side; the node folder
# (``store_path``) holds every transfer's record (manifest, first token) and, for
# TransferIdConnector only, its KV too.
KV_CONNECTORS: dict[str, str | None] = {CONNECTOR_NAME: CONNECTOR_MODULE, NIXL_CONNECTOR: None}
# What each connector adds to kv_transfer_config: where vLLM finds ours; Nixl moves GPU to GPU.
_CONNECTOR_CONFIG: dict[str, dict[str, str]] = {
    CONNECTOR_NAME: {"kv_connector_module_path": CONNECTOR_MODULE},
    NIXL_CONNECTOR: {"kv_buffer_device": "cuda"},  # no host copy
}
_KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
# Decode continues the grammar of a structured-outputs request that prefill began
# (python_backends/pd/grammar.py; named here as text: the builders import this module, not vLLM).
GRAMMAR_PROCESSOR = "python_backends.pd.grammar:ContinuedGrammarLogitsProcessor"


def pd_engine_args(
    base: Mapping[str, Any], role: Role, store_path: str | Path, connector: str = CONNECTOR_NAME
) -> dict[str, Any]:
    """Engine args for one role from the colocated ones (``llm``'s JSON).

    Adds the connector config (``connector``: a key of :data:`KV_CONNECTORS`) and
    ``enable_mm_embeds``; the decode role also turns prefix caching off (its cached-token count
    is the proof that KV came from the connector) and loads the grammar processor.
    """
    if role not in _KV_ROLE:
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    if connector not in KV_CONNECTORS:
        raise ValueError(f"kv connector must be one of {sorted(KV_CONNECTORS)}, got {connector!r}")
    args = copy.deepcopy(dict(base))
    args["enable_mm_embeds"] = True
    ktc: dict[str, Any] = {"kv_connector": connector, "kv_role": _KV_ROLE[role], "kv_load_failure_policy": "fail"}
    # Nixl reads only the extra keys it knows; store_path is the wrappers' record folder there.
    ktc["kv_connector_extra_config"] = {"store_path": str(store_path)}
    ktc.update(_CONNECTOR_CONFIG[connector])
    args["kv_transfer_config"] = ktc
    if role == "decode":
        args["enable_prefix_caching"] = False
        args["logits_processors"] = [GRAMMAR_PROCESSOR]
    check_engine_args(args, role)
    return args


def check_engine_args(args: Mapping[str, Any], role: Role) -> Path:
    """Refuse engine args that would let decode recompute silently; returns the node's transfer
    folder (``store_path``: every connector's records, TransferIdConnector's KV too)."""
    where = f"{role} engine args"
    ktc = args.get("kv_transfer_config")
    if not isinstance(ktc, Mapping):
        raise ValueError(f"{where}: kv_transfer_config is missing (build them with pd_engine_args)")
    connector = ktc.get("kv_connector")
    if connector not in KV_CONNECTORS or ktc.get("kv_connector_module_path") != KV_CONNECTORS[connector]:
        choices = ", ".join(f"{name!r} from {module or 'vLLM'!r}" for name, module in KV_CONNECTORS.items())
        raise ValueError(f"{where}: kv_connector must be one of {choices} (see python_backends/pd/__init__.py for why)")
    if ktc.get("kv_role") != _KV_ROLE[role]:
        raise ValueError(f"{where}: kv_role must be {_KV_ROLE[role]!r}, got {ktc.get('kv_role')!r}")
    if ktc.get("kv_load_failure_policy", "fail") != "fail":
        raise ValueError(f"{where}: kv_load_failure_policy must be 'fail' (a failed load must not recompute)")
    store = (ktc.get("kv_connector_extra_config") or {}).get("store_path")
    if not store:
        raise ValueError(f"{where}: kv_connector_extra_config.store_path is missing")
    if not args.get("enable_mm_embeds"):
        raise ValueError(f"{where}: enable_mm_embeds must be true (images arrive as embeddings)")
    if role == "decode" and args.get("enable_prefix_caching", True) is not False:
        raise ValueError(f"{where}: enable_prefix_caching must be false on decode")
    if role == "decode" and GRAMMAR_PROCESSOR not in (args.get("logits_processors") or ()):
        raise ValueError(
            f"{where}: logits_processors must name {GRAMMAR_PROCESSOR} (structured outputs across the split); "
            "regenerate the repository with `python -m builders.repository`"
        )
    return Path(store)

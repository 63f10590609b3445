"""Sampling defaults from the checkpoint's ``generation_config.json``, as ``vllm serve`` applies them.

``vllm serve --generation-config auto|vllm|FOLDER`` (default ``auto``): with ``auto`` the sampling
fields of the checkpoint's ``generation_config.json`` (read by transformers' ``GenerationConfig``)
are the defaults of every request that does not set them; ``vllm``: vLLM's own defaults only;
``FOLDER``: the ``generation_config.json`` of that folder instead. :func:`sampling_defaults` gives
exactly what vLLM 0.32's ``ModelConfig.get_diff_sampling_param`` gives for a setting (the same
fields, ``max_new_tokens`` as ``max_tokens``); ``tests/unit/test_generation_defaults.py`` compares
the two.

Who calls it: the ``llm`` and ``epd`` models, once in ``initialize``
(``model_repository/{llm,epd}/1/model.py``: :func:`defaults_for_model` with their config
parameter ``generation_config`` and the checkpoint of their ``engine_args.json``), into their
``RequestLimits.sampling_defaults``; their request parsing hands them to
``python_backends.request.sampling.parse_sampling_parameters`` (``defaults``): the request's own
values win, then these, then vLLM's. ``epd`` applies them before its path is chosen, so its
colocated engine and ``prefill``/``decode`` sample with the same values.

Triton-free; transformers is imported when a config is read, vLLM never.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from python_backends import contract

if TYPE_CHECKING:
    from python_backends.runtime.model_params import ModelParameters

__all__ = [
    "AUTO",
    "GENERATION_CONFIG_FILE",
    "SAMPLING_FIELDS",
    "SETTINGS_HELP",
    "VLLM",
    "defaults_for_model",
    "resolve_setting",
    "sampling_defaults",
]

log = logging.getLogger(__name__)

AUTO = "auto"  # the checkpoint's generation_config.json
VLLM = "vllm"  # vLLM's own defaults only
GENERATION_CONFIG_FILE = "generation_config.json"
_MODEL_CONFIG_FILE = "config.json"
# What vLLM 0.32 takes from a generation config (ModelConfig.get_diff_sampling_param), in its order.
SAMPLING_FIELDS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)
# Hugging Face's max_new_tokens is vLLM's max_tokens.
_RENAMED = {"max_new_tokens": "max_tokens"}
SETTINGS_HELP = (
    f"pass '{AUTO}' (the checkpoint's {GENERATION_CONFIG_FILE}), '{VLLM}' (vLLM's own defaults only) "
    f"or the path of a folder that holds a {GENERATION_CONFIG_FILE}"
)


def resolve_setting(setting: str) -> str:
    """``setting`` checked: ``auto``, ``vllm`` or an existing folder (made absolute); ValueError
    otherwise. (vLLM would also try a hub repository id; we read local folders only.)"""
    if setting in (AUTO, VLLM):
        return setting
    folder = Path(setting).expanduser()
    if not setting or not folder.is_dir():
        raise ValueError(f"generation_config {setting!r} is neither '{AUTO}', '{VLLM}' nor a folder: {SETTINGS_HELP}")
    return str(folder.resolve())


def sampling_defaults(setting: str, model_dir: Path) -> dict[str, Any]:
    """The ``vllm.SamplingParams`` keyword defaults for ``setting`` (``auto``, ``vllm`` or a
    folder) and the checkpoint in ``model_dir``, as vLLM's ``get_diff_sampling_param`` gives them:
    the set fields of :data:`SAMPLING_FIELDS`, ``max_new_tokens`` renamed ``max_tokens``.

    Read as vLLM reads it (``try_get_generation_config``): the folder's ``generation_config.json``
    with transformers' ``GenerationConfig``; without one (or one transformers cannot read), the
    generation fields of the folder's ``config.json``; a folder with neither is a ValueError
    (vLLM refuses to start on it too), and so is a setting that is neither ``auto``/``vllm`` nor a
    folder."""
    setting = resolve_setting(setting)
    if setting == VLLM:
        return {}
    config = _generation_config(Path(model_dir) if setting == AUTO else Path(setting))
    picked = {name: config[name] for name in SAMPLING_FIELDS if config.get(name) is not None}
    return {_RENAMED.get(name, name): value for name, value in picked.items()}


def _generation_config(folder: Path) -> dict[str, Any]:
    """``GenerationConfig.to_diff_dict()`` of ``folder`` (vLLM's ``try_get_generation_config``)."""
    from transformers import GenerationConfig

    try:
        return dict(GenerationConfig.from_pretrained(str(folder)).to_diff_dict())
    except OSError as exc:  # not there, or not readable: vLLM falls back to config.json
        if (folder / GENERATION_CONFIG_FILE).is_file():
            log.warning("%s unreadable (%s); its defaults come from %s", folder / GENERATION_CONFIG_FILE, exc,
                        _MODEL_CONFIG_FILE)  # fmt: skip
    if not (folder / _MODEL_CONFIG_FILE).is_file():
        raise ValueError(
            f"generation_config: {folder} holds neither {GENERATION_CONFIG_FILE} nor {_MODEL_CONFIG_FILE}; "
            f"{SETTINGS_HELP}"
        )
    return dict(GenerationConfig.from_model_config(_model_config(folder)).to_diff_dict())


def _model_config(folder: Path) -> Any:
    """The checkpoint's model config as vLLM's ``get_config`` reads a Hugging Face one (its
    ``PretrainedConfig``; the JSON itself for a model type transformers does not know)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except (ValueError, KeyError):
        loaded: dict[str, Any] = json.loads((folder / _MODEL_CONFIG_FILE).read_text())
        return loaded


def defaults_for_model(params: ModelParameters, model_dir: Path) -> dict[str, Any]:
    """A model's sampling defaults at load: its ``generation_config`` parameter (contract's
    default ``auto``) read against its checkpoint ``model_dir`` (the ``model`` of its
    ``engine_args.json``). A default ``max_tokens`` above the model's ``max_tokens_limit`` is cut
    to it (vLLM cuts its default to what the model can generate too; a request that sets none
    must not be refused for it); a default the request checks would refuse fails the load with a
    message that names the file, as every request would fail on it."""
    from python_backends.errors import EpdError
    from python_backends.request.sampling import SamplingLimits, parse_sampling_parameters

    setting = params.string(contract.GENERATION_CONFIG)
    source = f"generation_config {setting!r} (checkpoint {model_dir})"
    try:
        defaults = sampling_defaults(setting, model_dir)
    except ValueError as exc:
        raise ValueError(f"model '{params.model_name}': {exc}") from None
    limits = SamplingLimits.from_params(params)
    if defaults.get("max_tokens", 0) > limits.max_tokens:
        log.warning("model '%s': default max_tokens %s of %s cut to %s (%s)", params.model_name,
                    defaults["max_tokens"], source, limits.max_tokens, contract.MAX_TOKENS_LIMIT)  # fmt: skip
        defaults["max_tokens"] = limits.max_tokens
    try:
        parse_sampling_parameters(json.dumps(defaults), limits)
    except EpdError as exc:
        raise ValueError(
            f"model '{params.model_name}': the sampling defaults of {source} would fail every request "
            f"({exc}); fix the file or set {contract.GENERATION_CONFIG} to '{VLLM}'"
        ) from None
    if defaults:
        log.info("model '%s': sampling defaults from %s: %s", params.model_name, source, defaults)
    return defaults

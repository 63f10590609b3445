"""The one place that reads ``parameters`` from a model's config.pbtxt.

Triton hands the config to ``initialize`` as JSON; parameters are strings there. Every
value is checked at load, with a message that says which model and key to fix. Defaults and
lower bounds come from :mod:`python_backends.contract` (one default per key); a call may
still pass its own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from python_backends import contract
from python_backends.contract import ContractError

if TYPE_CHECKING:
    from python_backends.store import KeyConfig, StoreConfig


@dataclass(frozen=True)
class ModelParameters:
    model_name: str
    values: dict[str, str]

    @classmethod
    def from_model_config(cls, model_config: str | dict[str, Any]) -> ModelParameters:
        config = json.loads(model_config) if isinstance(model_config, str) else model_config
        raw = config.get("parameters") or {}
        values = {key: str(entry.get("string_value", "")) for key, entry in raw.items()}
        return cls(config.get("name", "?"), values)

    def _fail(self, problem: str) -> ValueError:
        return ValueError(
            f"model '{self.model_name}': {problem}; set it in the model's "
            "target description under builders/ and regenerate the repository"
        )

    def _text(self, key: str) -> str | None:
        text = self.values.get(key)
        return None if text is None or text == "" else text

    def _fallback(self, key: str, default: Any) -> Any:
        """The caller's default, else the contract's; a key with neither is required."""
        if default is not None:
            return default
        declared = contract.PARAMETERS.get(key)
        if declared is None or declared.default is None or declared.default == "":
            raise self._fail(f"parameter '{key}' is required")
        return declared.default

    def string(self, key: str, default: str | None = None) -> str:
        text = self._text(key)
        return text if text is not None else str(self._fallback(key, default))

    def integer(self, key: str, default: int | None = None, minimum: int | None = None) -> int:
        text = self._text(key)
        if text is None:
            return int(self._fallback(key, default))
        try:
            return contract.parse_integer(key, text, minimum)
        except ContractError as exc:
            raise self._fail(str(exc)) from None

    def number(self, key: str, default: float | None = None, minimum: float | None = None) -> float:
        text = self._text(key)
        if text is None:
            return float(self._fallback(key, default))
        try:
            return contract.parse_number(key, text, minimum)
        except ContractError as exc:
            raise self._fail(str(exc)) from None

    def boolean(self, key: str, default: bool | None = None) -> bool:
        text = self._text(key)
        if text is None:
            return bool(self._fallback(key, default))
        try:
            return contract.parse_boolean(key, text)
        except ContractError as exc:
            raise self._fail(str(exc)) from None

    def vllm_environment(self) -> dict[str, str]:
        """``VLLM_*`` and ``OMP_*`` parameters: process environment for a vLLM engine started here."""
        return {key: value for key, value in self.values.items() if key.startswith(contract.ENGINE_ENV_PREFIXES)}

    def cache_policy(self) -> contract.CachePolicy:
        try:
            return contract.CachePolicy.from_parameters(self.values)
        except ContractError as exc:
            raise self._fail(str(exc)) from None

    def store_config(self) -> StoreConfig:
        """The node's embedding store, as every store-using model opens it."""
        from python_backends.store import StoreConfig

        policy = self.cache_policy()
        config = StoreConfig(
            path=policy.path,
            capacity_bytes=policy.capacity_bytes,
            merge_size=self.integer(contract.SPATIAL_MERGE_SIZE),
            eviction=policy.eviction,
            ttl_s=policy.ttl_s if policy.ttl_s > 0 else None,
            device=policy.device,
        )
        config.validate()  # at load, with the store's own message
        return config

    def key_config(self, repository: Path, video_sampling: Mapping[str, Any] | None) -> KeyConfig:
        """The store's content keys as every store-using model takes them: media bytes +
        preprocessing config + the served encoder file's digest (+ video sampling)."""
        from python_backends.store import KeyConfig

        return KeyConfig.from_files(
            Path(self.string(contract.PREPROCESSOR_CONFIG)),
            repository / self.string(contract.ENCODER_FILE),
            video_sampling,
            image_backend=self.string(contract.IMAGE_BACKEND),
            vit_precision=self.string(contract.VIT_PRECISION),
        )

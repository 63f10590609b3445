"""The one place that reads ``parameters`` from a model's config.pbtxt.

Triton hands the config to ``initialize`` as JSON; parameters are strings there. Every
value is checked at load, with a message that says which model and key to fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from python_backends.store import StoreConfig


@dataclass(frozen=True)
class ModelParameters:
    model_name: str
    values: dict[str, str]

    @classmethod
    def from_model_config(cls, model_config: str | dict[str, Any]) -> "ModelParameters":
        config = json.loads(model_config) if isinstance(model_config, str) else model_config
        raw = config.get("parameters") or {}
        values = {key: str(entry.get("string_value", "")) for key, entry in raw.items()}
        return cls(config.get("name", "?"), values)

    def _fail(self, key: str, problem: str) -> ValueError:
        return ValueError(
            f"model '{self.model_name}': parameter '{key}' {problem}; set it in the model's "
            "target description under builders/ and regenerate the repository"
        )

    def string(self, key: str, default: str | None = None) -> str:
        value = self.values.get(key, default)
        if value is None or value == "":
            raise self._fail(key, "is required")
        return value

    def integer(self, key: str, default: int, minimum: int = 0) -> int:
        text = self.values.get(key)
        if text is None or text == "":
            return default
        try:
            value = int(text)
        except ValueError:
            raise self._fail(key, f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise self._fail(key, f"must be >= {minimum}, got {value}")
        return value

    def number(self, key: str, default: float, minimum: float = 0.0) -> float:
        text = self.values.get(key)
        if text is None or text == "":
            return default
        try:
            value = float(text)
        except ValueError:
            raise self._fail(key, f"must be a number, got {text!r}") from None
        if not value >= minimum:  # also refuses NaN
            raise self._fail(key, f"must be >= {minimum:g}, got {text}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        text = self.values.get(key)
        if text is None or text == "":
            return default
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise self._fail(key, f"must be true or false, got {text!r}")

    def vllm_environment(self) -> dict[str, str]:
        """``VLLM_*`` parameters: process environment for a vLLM engine started here."""
        return {key: value for key, value in self.values.items() if key.startswith("VLLM_")}

    def store_config(self) -> "StoreConfig":
        """The node's embedding store, as every store-using model opens it."""
        from python_backends.store import StoreConfig  # noqa: PLC0415 - LMDB only where used

        ttl_s = self.number("store_ttl_s", 0.0)
        config = StoreConfig(
            path=self.string("store_path"),
            capacity_bytes=self.integer("store_capacity_bytes", 2 << 30, minimum=1),
            merge_size=self.integer("spatial_merge_size", 2, minimum=1),
            eviction=self.string("store_eviction", "lru"),
            ttl_s=ttl_s if ttl_s > 0 else None,
            device=self.string("store_device", "cpu"),
        )
        config.validate()  # at load, with the store's own message
        return config

"""What the BLS tests' fake responses share: an output tensor as pb_utils gives one (on the CPU)."""

from __future__ import annotations

import numpy as np


class FakeOutput:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def is_cpu(self) -> bool:
        return True

    def as_numpy(self) -> np.ndarray:
        return self._array

"""What a producer hands the store, checked before any write transaction starts.

:class:`EntryMeta` is what the producer knows besides the bytes; :class:`Payload` is an
array made ready for storing (C order, little-endian, a storable dtype, a valid layout).
How the array itself is taken (numpy only, or also a CUDA array) is the placement's part.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from python_backends.errors import invalid_arg
from python_backends.store.device_memory import DeviceArray
from python_backends.store.reference import DTYPES, check_item, check_layout


@dataclass(frozen=True)
class EntryMeta:
    """What the producer knows about an embedding besides its bytes."""

    modality: str = "image"
    mm_hash: str = ""  # "" -> the content key
    num_placeholders: int | None = None  # None -> the array's rows
    grid_thw: tuple[int, int, int] | None = None
    dtype: str | None = None  # None -> from the array; "bfloat16" for uint16 bit patterns


@dataclass(frozen=True)
class Payload:
    """An array made ready for storing: ``meta`` is complete (no None but ``grid_thw``)."""

    data: np.ndarray | DeviceArray  # C-contiguous, little-endian; a DeviceArray for GPU stores only
    dtype: str
    meta: EntryMeta

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.data.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def pointer(self) -> int:
        return self.data.pointer if isinstance(self.data, DeviceArray) else int(self.data.ctypes.data)

    @classmethod
    def of(
        cls, key: str, data: np.ndarray | DeviceArray, dtype: str, meta: EntryMeta, merge_size: int | None
    ) -> Payload:
        """Fill in ``meta``'s defaults from the array and apply the reference's layout rules."""
        rows = int(data.shape[0]) if data.shape else 0
        meta = EntryMeta(
            modality=meta.modality,
            mm_hash=meta.mm_hash or key,
            num_placeholders=rows if meta.num_placeholders is None else meta.num_placeholders,
            grid_thw=_grid_tuple(meta.grid_thw),
            dtype=dtype,
        )
        check_item(meta.modality, meta.mm_hash)
        check_layout(
            dtype=dtype,
            shape=tuple(int(d) for d in data.shape),
            nbytes=int(data.nbytes),
            num_placeholders=meta.num_placeholders or 0,
            grid_thw=meta.grid_thw,
            merge_size=merge_size,
        )
        return cls(data=data, dtype=dtype, meta=meta)


def host_array(array: np.ndarray, declared: str | None) -> tuple[np.ndarray, str]:
    """A numpy embedding in the byte order and dtype it is stored in, and that dtype's name."""
    dtype = wire_dtype(array.dtype, declared)
    return np.ascontiguousarray(array, dtype=np.dtype(DTYPES[dtype])), dtype


def wire_dtype(dtype: np.dtype, declared: str | None) -> str:
    if declared == "bfloat16":
        if dtype != np.uint16:
            raise invalid_arg("bfloat16 embeddings are stored as their uint16 bit patterns; pass a uint16 view")
        return "bfloat16"
    name = dtype.name
    if declared not in (None, name) or name not in DTYPES or name == "bfloat16":
        raise invalid_arg(f"embedding dtype {name} is not storable; use one of {sorted(DTYPES)}")
    return name


def _is_lowercase_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def check_key(key: str) -> None:
    if not isinstance(key, str) or not 16 <= len(key) <= 128 or not _is_lowercase_hex(key):
        raise invalid_arg("embedding store key must be 16-128 lowercase hex characters (use content_key)")


def _grid_tuple(grid_thw: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
    # Accept lists and numpy integers from callers; records and references hold plain ints.
    return None if grid_thw is None else tuple(int(side) for side in grid_thw)  # type: ignore[return-value]

"""GPU memory for the embedding store: one process allocates, the others map it by CUDA IPC.

``DeviceMemory`` is what the store needs from a device: allocate a block and export a
handle, map another process's block from that handle, copy bytes, free and unmap.
``CudaIpcMemory`` implements it with CUDA's runtime API through NVIDIA's ``cuda-python``
bindings (``cuda.bindings.runtime``): ``cudaMalloc`` + ``cudaIpcGetMemHandle`` in the
allocating process, ``cudaIpcOpenMemHandle`` once per block in every other process.

``DeviceView`` is what a reader gets: a pointer, shape and dtype exposed through the CUDA
Array Interface, so ``torch.as_tensor(view, device="cuda")`` (or CuPy, Numba) wraps the
store's bytes without a copy. ``DeviceArray`` reads that interface from a writer's tensor
so a producer on the GPU stores its output with one device-to-device copy.

Plain Python; imports ``cuda.bindings`` only when a ``CudaIpcMemory`` is made.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from python_backends.errors import EpdError, ErrorCode, invalid_arg

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


class DeviceMemory(Protocol):
    """Device memory that one process allocates and other processes of the node map.

    Called by the embedding store only, from whichever process opened it. ``copy`` is
    synchronous and takes any mix of host and device pointers (unified addressing)."""

    def allocate(self, nbytes: int) -> tuple[int, bytes]:
        """A new block: (pointer, handle other processes can ``open``)."""
        ...

    def open(self, handle: bytes) -> int:
        """Map a block another process allocated; its pointer here."""
        ...

    def close(self, pointer: int) -> None:
        """Unmap what ``open`` mapped."""
        ...

    def free(self, pointer: int) -> None:
        """Free what ``allocate`` made (other processes' mappings of it become invalid)."""
        ...

    def copy(self, destination: int, source: int, nbytes: int) -> None: ...


@dataclass(frozen=True)
class DeviceArray:
    """A C-contiguous array in device memory, read from its ``__cuda_array_interface__``."""

    pointer: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @classmethod
    def of(cls, array: Any) -> DeviceArray:
        """Read a device array (torch CUDA tensor, CuPy array, ...); INVALID_ARG if it is none
        or not C-contiguous."""
        interface = getattr(array, "__cuda_array_interface__", None)
        if not isinstance(interface, dict):
            raise invalid_arg(f"expected a numpy array or a CUDA array, got {type(array).__name__}")
        shape = tuple(int(d) for d in interface["shape"])
        dtype = np.dtype(interface["typestr"])
        strides = interface.get("strides")
        if strides is not None and tuple(strides) != _c_strides(shape, dtype.itemsize):
            raise invalid_arg("CUDA array must be C-contiguous; call .contiguous() first")
        pointer, _read_only = interface["data"]
        return cls(pointer=int(pointer or 0), shape=shape, dtype=dtype)


@dataclass(frozen=True)
class DeviceView:
    """An entry's bytes in device memory, for readers. Exposes the CUDA Array Interface:
    ``torch.as_tensor(view, device="cuda")`` wraps it without a copy. Read only by contract:
    the flag says writeable because torch refuses read-only interfaces."""

    pointer: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.pointer, False),
            "strides": None,
            "version": 3,
        }


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides: list[int] = []
    step = itemsize
    for side in reversed(shape):
        strides.append(step)
        step *= side
    return tuple(reversed(strides))


class CudaIpcMemory:
    """``DeviceMemory`` on one CUDA device, shared by legacy CUDA IPC (``cudaIpc*MemHandle``).

    Legacy IPC because it needs nothing beyond the runtime: no file-descriptor passing
    between processes (which the VMM API's shareable handles need) and no driver mempool
    setup; the cost is that a block dies with the process that allocated it, which the
    store handles (see ``arena.py``)."""

    def __init__(self, device: int = 0) -> None:
        try:
            from cuda.bindings import runtime  # only GPU stores need it
        except ImportError as exc:
            raise EpdError(
                "a GPU embedding store needs NVIDIA's cuda-python bindings (pip install cuda-bindings)",
                ErrorCode.UNAVAILABLE,
            ) from exc
        self._rt = runtime
        self._device = device
        self._call("cudaSetDevice", device)

    def _call(self, name: str, *args: Any) -> Any:
        result = getattr(self._rt, name)(*args)
        error, values = result[0], result[1:]
        if error != self._rt.cudaError_t.cudaSuccess:
            raise EpdError(f"CUDA {name} failed on device {self._device}: {error.name}", ErrorCode.UNAVAILABLE)
        return values[0] if len(values) == 1 else None

    def allocate(self, nbytes: int) -> tuple[int, bytes]:
        self._call("cudaSetDevice", self._device)
        pointer = int(self._call("cudaMalloc", nbytes))
        handle = self._call("cudaIpcGetMemHandle", pointer)
        return pointer, ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)

    def open(self, handle: bytes) -> int:
        if len(handle) != IPC_HANDLE_BYTES:
            raise EpdError("CUDA IPC handle has the wrong length", ErrorCode.INTERNAL)
        self._call("cudaSetDevice", self._device)
        ipc_handle = self._rt.cudaIpcMemHandle_t()
        # cuda-python exposes the handle's bytes only through its address.
        ctypes.memmove(ipc_handle.getPtr(), handle, IPC_HANDLE_BYTES)
        return int(self._call("cudaIpcOpenMemHandle", ipc_handle, self._rt.cudaIpcMemLazyEnablePeerAccess))

    def close(self, pointer: int) -> None:
        self._call("cudaIpcCloseMemHandle", pointer)

    def free(self, pointer: int) -> None:
        self._call("cudaFree", pointer)

    def copy(self, destination: int, source: int, nbytes: int) -> None:
        self._call("cudaMemcpy", destination, source, nbytes, self._rt.cudaMemcpyKind.cudaMemcpyDefault)


def cuda_device_index(device: str) -> int | None:
    """None for "cpu"; the index for "cuda" (0) or "cuda:N"; INVALID_ARG otherwise."""
    if device == "cpu":
        return None
    name, colon, index = device.partition(":")
    if name != "cuda" or (colon and not index.isdigit()):
        raise invalid_arg(f"embedding store device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return int(index or 0)

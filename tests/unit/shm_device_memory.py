"""A stand-in for CUDA IPC memory in unit tests: POSIX shared memory, mapped by name.

It behaves like ``CudaIpcMemory`` where the store's logic can tell: one process allocates
a block and exports a handle, other processes map it from the handle, copies are
synchronous. Unlike CUDA, a block outlives a crashed owner; the store must not rely on
that (it judges by the owner's liveness), which the tests check. The real thing is tested
in tests/gpu/test_cuda_store.py.
"""

from __future__ import annotations

import ctypes
import uuid
from multiprocessing import shared_memory

HANDLE_BYTES = 64


class ShmDeviceMemory:
    def __init__(self) -> None:
        self._blocks: dict[int, tuple[shared_memory.SharedMemory, ctypes.Array]] = {}
        self.allocations = 0
        self.frees = 0
        self.names: list[str] = []

    def _keep(self, block: shared_memory.SharedMemory) -> int:
        window = (ctypes.c_char * block.size).from_buffer(block.buf)
        pointer = ctypes.addressof(window)
        self._blocks[pointer] = (block, window)
        return pointer

    def allocate(self, nbytes: int) -> tuple[int, bytes]:
        name = f"epd-test-{uuid.uuid4().hex[:16]}"
        block = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        self.allocations += 1
        self.names.append(name)
        return self._keep(block), name.encode().ljust(HANDLE_BYTES, b"\0")

    def open(self, handle: bytes) -> int:
        name = handle.rstrip(b"\0").decode()
        return self._keep(shared_memory.SharedMemory(name=name))

    def _drop(self, pointer: int) -> shared_memory.SharedMemory:
        block, window = self._blocks.pop(pointer)
        del window
        block.close()
        return block

    def close(self, pointer: int) -> None:
        self._drop(pointer)

    def free(self, pointer: int) -> None:
        self._drop(pointer).unlink()
        self.frees += 1

    def copy(self, destination: int, source: int, nbytes: int) -> None:
        ctypes.memmove(destination, source, nbytes)


class HostArrayAsDevice:
    """A numpy array presented through the CUDA Array Interface, as a GPU tensor would be."""

    def __init__(self, array) -> None:
        self.array = array
        self.__cuda_array_interface__ = {
            "shape": array.shape,
            "typestr": array.dtype.str,
            "data": (int(array.ctypes.data), False),
            "strides": None if array.flags.c_contiguous else array.strides,
            "version": 3,
        }

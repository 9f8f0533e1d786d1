"""System shared memory for the ensemble's calls over the server's own gRPC endpoint
(`triton_vlm.loopback`): the tensors a request's steps exchange stay out of gRPC messages.

A `Region` is a POSIX shared-memory file registered with tritonserver (its system shared-memory
extension: the server maps the file at registration); the file is unlinked at once, so nothing is
left in /dev/shm whatever becomes of this process. An `Arena` is one request's memory: each input
and output of its calls gets the next free slot (bump allocation over the arena's regions; a new,
larger region is added when one is full), and an output that lands there is read in place and may
go on as the next call's input without a copy. `reset` makes the whole arena free for the next
request and gives back to the system the pages a large request touched beyond `keep_bytes`.
"""
from __future__ import annotations

import itertools
import mmap
import os
import secrets
from dataclasses import dataclass
from typing import Callable

import numpy as np

ALIGN = 64
MIN_REGION = 16 << 20
_names = itertools.count()


class Region:
    """`size` bytes of shared memory, registered as `name` through `register(name, key, size)`."""

    def __init__(self, size: int, register: Callable[[str, str, int], None]) -> None:
        self.name = f"triton_vlm_{os.getpid()}_{secrets.token_hex(4)}_{next(_names)}"
        path = f"/dev/shm/{self.name}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
            register(self.name, "/" + self.name, size)
        finally:
            os.close(fd)
            os.unlink(path)
        self.size = size
        self.bytes = np.frombuffer(self.mm, dtype=np.uint8)
        self.address = self.bytes.ctypes.data

    def view(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        return self.bytes[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)


@dataclass(frozen=True)
class Slot:
    """`size` bytes of `region` from `offset`."""
    region: Region
    offset: int
    size: int

    def view(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        return self.region.view(self.offset, dtype, shape)


class Arena:
    """One request's shared memory (one thread at a time)."""

    def __init__(self, register: Callable[[str, str, int], None], unregister: Callable[[str], None],
                 keep_bytes: int = MIN_REGION) -> None:
        self._register, self._unregister = register, unregister
        self.keep_bytes = keep_bytes
        self.regions: list[Region] = []
        self.used: list[int] = []

    def alloc(self, nbytes: int) -> Slot:
        """A free slot of at least `nbytes`."""
        nbytes = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for i, region in enumerate(self.regions):
            if self.used[i] + nbytes <= region.size:
                self.used[i] += nbytes
                return Slot(region, self.used[i] - nbytes, nbytes)
        last = self.regions[-1].size if self.regions else MIN_REGION // 2
        size = max(2 * last, 1 << (nbytes - 1).bit_length())
        self.regions.append(Region(size, self._register))
        self.used.append(nbytes)
        return Slot(self.regions[-1], 0, nbytes)

    def put(self, array: np.ndarray) -> Slot:
        """`array` in the arena: where it already is, else copied into a new slot."""
        slot = self.locate(array)
        if slot is None:
            slot = self.alloc(array.nbytes)
            slot.view(array.dtype, array.shape)[...] = array
        return slot

    def locate(self, array: np.ndarray) -> Slot | None:
        """Where a C-contiguous `array` lies in the arena's regions, if it does."""
        if not array.flags.c_contiguous:
            return None
        start = array.__array_interface__["data"][0]
        for region in self.regions:
            if region.address <= start and start + array.nbytes <= region.address + region.size:
                return Slot(region, start - region.address, array.nbytes)
        return None

    def mark(self) -> list[int]:
        return list(self.used)

    def rollback(self, mark: list[int]) -> None:
        """Free what was allocated since `mark` (a call that is tried again)."""
        self.used[:len(mark)] = mark
        self.used[len(mark):] = [0] * (len(self.used) - len(mark))

    def reset(self) -> None:
        """Everything free again. Several regions become one of their total size, so that the next
        request of this size fits in one; pages beyond `keep_bytes` go back to the system."""
        if len(self.regions) > 1:
            size = sum(region.size for region in self.regions)
            for region in self.regions:
                self._unregister(region.name)  # its mapping goes with the last array viewing it
            self.regions, self.used = [Region(size, self._register)], [0]
            return
        for region, used in zip(self.regions, self.used):
            start = -(-self.keep_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
            if used > start:
                region.mm.madvise(mmap.MADV_REMOVE, start, region.size - start)
        self.used = [0] * len(self.regions)

    def close(self) -> None:
        for region in self.regions:
            self._unregister(region.name)
        self.regions, self.used = [], []

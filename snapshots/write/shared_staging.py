"""Staging memory another process can map: the writer process (``_writer_process``) reads
a save's staged tensors straight from it, with no copy and no pickling of their bytes.

A ``SharedArena`` hands out CPU tensors carved from a few large blocks of anonymous shared
memory (``memfd_create``; its file descriptor is what gets passed to the writer process).
Allocation is a bump pointer: staging buffers live as long as their ``Stager`` and are
reused by every save, so nothing is freed one buffer at a time. Large buffers start on a
page (``DIRECT_ALIGN``: their bytes may go to the disk with ``O_DIRECT``), small ones on 64
bytes, as torch's allocator does. An arena holds its blocks; once it is gone, each
block's descriptor is closed and it leaves the registry (``live_blocks`` tells the writer
process which mappings it may drop), while its memory lives on as long as a tensor uses it.

Linux only (``os.memfd_create``); elsewhere ``available()`` is False and staging stays on
private pages (``serialization.staging_buffer``).
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import weakref
from dataclasses import dataclass

import torch

from snapshots.storage.local import DIRECT_ALIGN

# Blocks come in at least this size (or one buffer's, if larger): a ResNet-18 state with its
# optimizer (~90 MB) takes two, so a save refers to a handful of descriptors, not one per
# tensor (a large model has thousands of tensors, past the default limit of 1024 open files).
BLOCK_BYTES = 64 << 20
# Buffers from this size up start on a page (``O_DIRECT``); smaller ones on a cache line.
PAGE_ALIGNED_FROM = 1 << 16
SMALL_ALIGN = 64

_ids = itertools.count(1)
_blocks: weakref.WeakValueDictionary[int, _Block] = weakref.WeakValueDictionary()
_lock = threading.Lock()


_works: bool | None = None


def available() -> bool:
    """Whether this platform gives shared staging memory (``memfd_create``, not refused by a
    sandbox's seccomp filter): checked once, by creating one."""
    global _works
    if _works is None:
        try:
            os.close(os.memfd_create("elastic-train-probe", os.MFD_CLOEXEC))
            _works = True
        except (AttributeError, OSError):
            _works = False
    return _works


@dataclass(frozen=True)
class Place:
    """Where a tensor's bytes are: ``offset`` bytes into block ``block``."""

    block: int
    offset: int


class _Block:
    """One memfd mapping. Tensors carved from it keep the mapping alive (their storage holds
    its buffer); the arena keeps this object, and so its descriptor and registry entry."""

    def __init__(self, size: int) -> None:
        self.id = next(_ids)
        self.size = size
        self.used = 0
        self.fd = os.memfd_create(f"elastic-train-staging-{self.id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.pages = mmap.mmap(self.fd, size, mmap.MAP_SHARED)
        except BaseException:
            os.close(self.fd)
            raise
        self.base = int(torch.frombuffer(self.pages, dtype=torch.uint8, count=1).data_ptr())
        weakref.finalize(self, os.close, self.fd)

    def carve(self, nbytes: int, align: int) -> tuple[memoryview, int] | None:
        start = -(-self.used // align) * align
        if start + nbytes > self.size:
            return None
        self.used = start + nbytes
        return memoryview(self.pages)[start : start + nbytes], start


class SharedArena:
    """Page- or cache-line-aligned tensors on shared memory, for one ``Stager``."""

    def __init__(self) -> None:
        self._blocks: list[_Block] = []
        self._current: _Block | None = None

    def tensor(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = shape.numel() * itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        align = DIRECT_ALIGN if nbytes >= PAGE_ALIGNED_FROM else SMALL_ALIGN
        carved = self._current.carve(nbytes, align) if self._current is not None else None
        if carved is None:
            block = _Block(max(BLOCK_BYTES, -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN))
            with _lock:
                _blocks[block.id] = block
            self._blocks.append(block)
            if nbytes < block.size // 2 or self._current is None:
                self._current = block  # a huge one-off buffer does not strand the current block
            carved = block.carve(nbytes, align)
        if carved is None:  # unreachable: a fresh block is sized for the buffer
            raise MemoryError(f"cannot carve {nbytes} bytes from a fresh staging block")
        view, _ = carved
        return torch.frombuffer(view, dtype=dtype, count=shape.numel()).view(shape)


def locate(tensor: torch.Tensor) -> Place | None:
    """Where ``tensor``'s storage lies in a live block, or None (not shared staging memory).
    Only a storage that starts exactly at a carved range and a tensor that covers it whole,
    contiguously, from offset 0 qualifies: the writer process rebuilds exactly that."""
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized:
        return None
    if tensor.storage_offset() != 0 or not tensor.is_contiguous() or tensor.numel() == 0:
        return None
    storage = tensor.untyped_storage()
    if storage.nbytes() != tensor.numel() * tensor.element_size():
        return None
    ptr = storage.data_ptr()
    with _lock:
        blocks = list(_blocks.values())
    for block in blocks:
        if block.base <= ptr and ptr + storage.nbytes() <= block.base + block.size:
            return Place(block.id, ptr - block.base)
    return None


def descriptor(block_id: int) -> tuple[int, int] | None:
    """(fd, size) of a live block, or None once it was freed."""
    with _lock:
        block = _blocks.get(block_id)
    return None if block is None else (block.fd, block.size)


def live_blocks() -> set[int]:
    with _lock:
        return set(_blocks.keys())

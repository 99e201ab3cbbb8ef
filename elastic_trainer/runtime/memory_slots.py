"""A slot file of the in-memory tier (``runtime.memory_tier``), kept mapped across copies.

A copy is written with one memory copy straight into the slot's shared mapping: no staging
buffer, no ``write()`` (on tmpfs that costs ~3x the copy into mapped pages), no writer thread
competing with training. The mapping is made once and reused while the file is the same file
(same inode) and big enough; it is re-made only when the copy's size changes that much, or
the file was removed (its folder cleared, the copy forgotten).

Pages are reserved with ``posix_fallocate`` when the file is sized: on a full tmpfs that
fails with ENOSPC (the copy is skipped, storage remains the fallback) where touching an
unbacked page of the mapping would kill the process with SIGBUS.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import torch

# A slot's size: the copy's rounded up, so a copy that grows by a few bytes (its skeleton's
# numbers) keeps the mapping. Re-made when the copy needs more, or under half of it.
GRAIN_BYTES = 1 << 16
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # map the pages at once, not one fault each


def capacity(size: int) -> int:
    return max(GRAIN_BYTES, -(-size // GRAIN_BYTES) * GRAIN_BYTES)


def fits(current: int, size: int) -> bool:
    """Whether a slot of ``current`` bytes is kept for a copy of ``size`` bytes."""
    return size <= current <= 2 * capacity(size)


class MappedFile:
    def __init__(self, path: str) -> None:
        self.path = path
        self.maps = 0  # how many times the file was (re)mapped: once per size, not per copy
        self._mm: mmap.mmap | None = None
        self._tensor: torch.Tensor | None = None
        self._ino: int | None = None

    def tensor(self, size: int) -> torch.Tensor:
        """The mapped file as a uint8 tensor of at least ``size`` bytes (the same memory as
        the previous call when it still fits); OSError when the pages cannot be had."""
        if self._tensor is None or not self._same_file() or not fits(len(self._tensor), size):
            self._tensor = self._map(capacity(size))
        return self._tensor

    def _same_file(self) -> bool:
        try:
            return os.stat(self.path).st_ino == self._ino
        except FileNotFoundError:
            return False

    def _map(self, nbytes: int) -> torch.Tensor:
        self.close()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
            self._mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
            self._ino = os.fstat(fd).st_ino
        finally:
            os.close(fd)  # the mapping holds the file
        self.maps += 1
        return torch.frombuffer(self._mm, dtype=torch.uint8)

    def close(self) -> None:
        """Unmap (before the file is removed: a mapping keeps a removed file's pages)."""
        self._tensor, mm, self._mm, self._ino = None, self._mm, None, None
        if mm is not None:
            # BufferError: a tensor on it is still referenced (an exception's traceback);
            # the mapping then goes with the last reference.
            with contextlib.suppress(BufferError):
                mm.close()

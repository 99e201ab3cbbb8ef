"""A node's copies of the in-memory tier (``worker.memory.tier``): two slot files, kept
mapped across copies, and the markers that commit their parts.

A copy is written with one memory copy straight into the slot's shared mapping: no staging
buffer, no ``write()`` (on tmpfs that costs several times the copy into mapped pages), no
writer thread
competing with training. The mapping is made once and reused while the file is the same file
(same inode) and big enough; it is re-made only when the copy's size changes that much, or
the file was removed (its folder cleared, the copy forgotten).

The ranks of a node split each copy (``plan.part_bounds``): each copies about 1/L of
the bytes into the same slot, so the copy on the critical path (the ranks meet at the next
all-reduce) is 1/L of it, and commits its part without a collective: it removes its part's
marker before overwriting those bytes and renames a new one (step, byte range, checksum) into
place after. A copy is whole only when every part names its step (``plan.whole_copy``)
and every part's bytes match their checksum; a crash at any instant leaves the other slot's
copy whole, and the slot being written is never used.

Pages are reserved with ``posix_fallocate`` when the file is sized: on a full tmpfs that
fails with ENOSPC (the copy is skipped, storage remains the fallback) where touching an
unbacked page of the mapping would kill the process with SIGBUS.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch

from elastic_trainer.contract.events import emit
from elastic_trainer.private_files import NotOursError, open_file, open_private, private_dirs
from elastic_trainer.worker.memory import byte_layout, checked_read, pinning
from elastic_trainer.worker.memory.plan import (
    SLOTS,
    Copy,
    newest_copy,
    next_slot,
    parse_part_marker,
    part_bounds,
    part_marker,
    stale_file,
    whole_copy,
)
from snapshots.storage import faults

# A slot's size: the copy's rounded up, so a copy that grows by a few bytes (its skeleton's
# numbers) keeps the mapping. Re-made when the copy needs more, or under half of it.
GRAIN_BYTES = 1 << 16
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # map the pages at once, not one fault each


class StaleRead(Exception):
    """A copy's source changed while it was read (``NodeCopies.write``'s ``valid``)."""


class FailureStreak:
    """``snapshot.memory_failed`` once per streak of failed copies (a full tmpfs fails every
    step), not once per step; a copy that succeeds ends the streak. The copy is not made;
    storage snapshots stay the fallback."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.failing = False

    def failed(self, step: int, exc: Exception, what: str = "") -> None:
        if not self.failing:
            emit(
                "snapshot.memory_failed",
                level="warning",
                step=step,
                dir=self.directory,
                error=f"{what}{type(exc).__name__}: {exc}"[:500],
            )
        self.failing = True

    def succeeded(self) -> None:
        self.failing = False


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
        self._pin_tried = False  # this mapping was offered to the GPU (``pinning.register``)
        self.pinned = False

    def tensor(self, size: int, *, pin: bool = False) -> torch.Tensor:
        """The mapped file as a uint8 tensor of at least ``size`` bytes (the same memory as
        the previous call when it still fits); OSError when the pages cannot be had.
        ``pin``: page-lock the mapping for the GPU, once per mapping (a state on the device
        is copied into it at the link's speed: ``pinning``)."""
        if self._tensor is None or not self._same_file() or not fits(len(self._tensor), size):
            self._tensor = self._map(capacity(size))
        if pin and not self._pin_tried:
            self._pin_tried = True
            self.pinned = pinning.register(self._tensor)
        return self._tensor

    def _same_file(self) -> bool:
        """Still the file mapped, and still as long (another process may have sized it
        anew: a mapping past its end would fault)."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return False
        mapped = 0 if self._tensor is None else len(self._tensor)
        return st.st_ino == self._ino and st.st_size >= mapped

    def _map(self, nbytes: int) -> torch.Tensor:
        self.close()
        fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
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
        tensor, mm = self._tensor, self._mm
        self._tensor, self._mm, self._ino = None, None, None
        if self.pinned and tensor is not None:
            pinning.unregister(tensor)  # while its memory is still mapped
        self.pinned, self._pin_tried = False, False
        if mm is not None:
            # BufferError: a tensor on it is still referenced (an exception's traceback);
            # the mapping then goes with the last reference.
            with contextlib.suppress(BufferError):
                mm.close()


class NodeCopies:
    """One node's copies in a node-local folder, as rank ``part`` of the node's ``parts``
    ranks sees them: two slot files overwritten in place through mappings kept from copy to
    copy (a fresh tmpfs file per copy pays its page allocation again, more than the copy
    itself), and per
    slot one marker per part, replaced atomically."""

    def __init__(self, directory: str, *, part: int = 0, parts: int = 1) -> None:
        self.directory, self.part, self.parts = directory, part, parts
        self.slots = {slot: MappedFile(os.path.join(directory, slot)) for slot in SLOTS}

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def newest_copy(self) -> Copy | None:
        markers: dict[str, dict[int, Any]] = {slot: {} for slot in SLOTS}
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.directory):
                parsed = parse_part_marker(name)
                if parsed is not None:
                    markers[parsed[0]][parsed[1]] = _load_json(self._path(name))
        return newest_copy([whole_copy(slot, markers[slot]) for slot in SLOTS])

    def newest(self) -> int | None:
        newest = self.newest_copy()
        return newest.step if newest is not None else None

    def read(self, step: int) -> dict[str, Any]:
        """The copy of ``step``: every part checked against its checksum, then its skeleton
        read (``weights_only``)."""
        return byte_layout.read(self.read_bytes(step))

    def read_bytes(self, step: int) -> bytearray | mmap.mmap:
        """The bytes of the copy of ``step``, every part checked against its checksum."""
        copy = self.newest_copy()
        if copy is None or copy.step != step:
            raise FileNotFoundError(f"no whole in-memory copy of step {step}")
        path, size = self._path(copy.slot), copy.size
        if os.path.getsize(path) < size:  # a slot is rounded up to its mapping's size
            raise ValueError(f"{copy.slot} has {os.path.getsize(path)} bytes, not {size}")
        ranges = [(part["start"], part["stop"]) for part in copy.parts]
        data, digests = checked_read.read_file(path, size, ranges, what=copy.slot)
        for part, digest in zip(copy.parts, digests, strict=True):
            what = f"{copy.slot} (bytes {part['start']}-{part['stop']})"
            byte_layout.compare(digest, part.get(byte_layout.CHECKSUM_ALGORITHM), what)
        return data

    def write(
        self,
        step: int,
        payload: Mapping[str, Any],
        replicated: Callable[[torch.Tensor], bool] | None = None,
        *,
        defer: bool = False,
        valid: Callable[[], bool] | None = None,
    ) -> Callable[[], None] | None:
        """Copy this rank's part into the slot not holding the newest whole copy, then commit
        the part by replacing its marker. ``replicated``: ``byte_layout.plan``'s. ``valid``:
        asked after the copy, before the commit; False raises ``StaleRead``, nothing committed.

        ``defer``: copy now only the tensors ``replicated`` does not select (they go first in
        the layout; the others change only at the optimizer's step) and return the rest of
        the work (copying those, checksumming, committing) for the caller to run before that
        step, on another thread; None when all is done. Until then no copy of this slot is
        whole: its marker is gone."""
        layout = byte_layout.plan(payload, replicated)  # before the slot is touched
        private_dirs(self.directory)
        slot = next_slot(self.newest_copy())
        bounds = part_bounds(
            layout.offsets, layout.split_from, layout.skeleton_offset, layout.size, self.parts
        )
        start, stop = bounds[self.part], bounds[self.part + 1]
        marker = self._path(part_marker(slot, self.part))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(marker)  # before its bytes change: a torn part is never whole
        mapped = self.slots[slot].tensor(layout.size, pin=layout.on_device)
        copied_below = layout.split_from if defer else 0
        if defer:
            byte_layout.copy_into(layout, mapped, start, stop, copied_below)

        def finish() -> None:
            digest = byte_layout.write_into(layout, mapped, start, stop, copied_below=copied_below)
            _mid_write(step, mapped, start, stop)
            if valid is not None and not valid():
                raise StaleRead(f"the state of step {step} changed while it was copied")
            body = {
                "step": step, "slot": slot, "bytes": layout.size, "part": self.part,
                "parts": self.parts, "start": start, "stop": stop,
                byte_layout.CHECKSUM_ALGORITHM: digest,
            }  # fmt: skip
            tmp = f"{marker}.{uuid.uuid4().hex}.tmp"
            with open_file(tmp, "w") as f:
                json.dump(body, f)
            os.replace(tmp, marker)

        if defer:
            return finish
        finish()
        return None

    def reserve(self, size: int, *, pin: bool = False) -> None:
        """Map the slot the next copy goes into, with the pages of a ``size``-byte copy, now:
        that copy (a just-in-time one, in a failure's downtime) then neither allocates nor
        maps them, nor (``pin``: a state on the GPU) page-locks them. OSError (ENOSPC) where
        tmpfs cannot hold it."""
        private_dirs(self.directory)
        self.slots[next_slot(self.newest_copy())].tensor(size, pin=pin)

    def unmap(self) -> None:
        """Let go of the slot mappings (the next copy maps its slot again)."""
        for mapped in self.slots.values():
            mapped.close()

    def keep_only(self, step: int | None) -> None:
        """Forget every copy but ``step``'s (None: all); the slot files stay for the next copy
        (``plan.stale_file``). Only while no rank of the node writes (after a restore, before
        training goes on)."""
        keep = self.newest_copy()
        if keep is not None and keep.step != step:
            keep = None
        self.unmap()  # else a removed file's pages stay with its mapping
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.directory):
                if stale_file(name, keep):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._path(name))


def _load_json(path: str) -> Any:
    try:
        with open_file(path, "r") as f:
            return json.load(f)
    except NotOursError as exc:
        refused(exc)
        return None
    except (OSError, ValueError):
        return None


_refused: set[str] = set()


def refused(exc: NotOursError) -> None:
    """``snapshot.memory_refused`` for a folder or file of the tier that is not ours alone
    (never read, written or followed), once per reason in this process."""
    if str(exc) not in _refused:
        _refused.add(str(exc))
        emit("snapshot.memory_refused", level="warning", path=exc.path, reason=str(exc))


def _mid_write(step: int, mapped: torch.Tensor, start: int, stop: int) -> None:
    def torn() -> None:  # what a kill halfway through the part leaves
        mapped[(start + stop) // 2 : stop] = 0xEE

    faults.hit("mid_memory_write", step=step, torn=torn)

"""One rank's in-memory copies in a folder of its node's memory (``worker.memory.shards``,
``worker.memory.mirror``): two slot files and a marker listing the committed copies, in
the byte layout of ``byte_layout``; and the thread that sends them to their mirror.

A copy goes the replicated tier's way (``slots``): one copy per tensor straight into
the slot's mapping, kept from copy to copy, checksummed while cache-hot (no staging buffer,
no ``write()``, which on tmpfs costs several times the copy into mapped pages); a mirror's
copy is
received straight into its slot's mapping. A slot file is rounded up to its mapping's size
(``slots.capacity``): the marker says how many of its bytes are the copy."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from elastic_trainer.private_files import NotOursError, open_file, private_dirs
from elastic_trainer.worker.memory import byte_layout, checked_read
from elastic_trainer.worker.memory import shard_plan as plan_
from elastic_trainer.worker.memory.plan import SLOTS
from elastic_trainer.worker.memory.slots import FailureStreak, MappedFile, refused

T = TypeVar("T")


class RankSlots:
    """One rank's copies in its own folder: two slot files overwritten in place through
    mappings kept across copies, and a marker listing the committed ones, replaced
    atomically (``shard_plan``)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.slots = {slot: MappedFile(self._path(slot)) for slot in SLOTS}

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def copies(self) -> list[plan_.RankCopy]:
        try:
            with open_file(self._path(plan_.MARKER), "r") as f:
                return plan_.copies_of(json.load(f))
        except NotOursError as exc:
            refused(exc)
            return []
        except (OSError, ValueError):
            return []

    def write(
        self,
        step: int,
        world_size: int,
        payload: Mapping[str, Any],
        replicas: tuple[int, ...] = (),
    ) -> plan_.RankCopy:
        """The copy, with one memory copy per tensor into the slot's mapping; ``replicas``:
        the ranks whose shards are the same (``shard_plan.RankCopy``)."""
        layout = byte_layout.plan(payload)  # before the slot is touched
        return self._write(
            step,
            world_size,
            layout.size,
            lambda slot: byte_layout.write_into(layout, slot),
            replicas,
            pin=layout.on_device,  # shards on the GPU: the slot page-locked (``pinning``)
        )

    def slot_to_write(self) -> str:
        """The slot the next copy overwrites (``shard_plan.slot_to_write``)."""
        return plan_.slot_to_write(self.copies())[0]

    def receive(
        self,
        step: int,
        world_size: int,
        nbytes: int,
        digest: str,
        fill: Callable[[torch.Tensor], None],
    ) -> plan_.RankCopy:
        """A copy received whole from its rank (a mirror): ``fill`` puts its ``nbytes`` bytes
        into the uint8 tensor it is given (the slot's mapping); ``digest``: their checksum."""

        def put(slot: torch.Tensor) -> str:
            fill(slot[:nbytes])
            return digest

        return self._write(step, world_size, nbytes, put)

    def committed(self, copy: plan_.RankCopy) -> torch.Tensor:
        """The bytes of ``copy`` (committed by this object) in its slot's mapping: not copied,
        not checked; valid until the slot is written again."""
        return self.slots[copy.slot].tensor(copy.nbytes)[: copy.nbytes]

    def _write(
        self,
        step: int,
        world_size: int,
        size: int,
        put: Callable[[torch.Tensor], str],
        replicas: tuple[int, ...] = (),
        *,
        pin: bool = False,
    ) -> plan_.RankCopy:
        private_dirs(self.directory)
        slot, kept = plan_.slot_to_write(self.copies())
        self._commit(kept)  # the slot about to be overwritten is no longer listed
        digest = put(self.slots[slot].tensor(size, pin=pin))
        new = plan_.RankCopy(
            step=step,
            slot=slot,
            nbytes=size,
            digest=digest,
            world_size=world_size,
            replicas=replicas,
        )
        self._commit(plan_.after_write(kept, new))
        return new

    def _commit(self, copies: list[plan_.RankCopy]) -> None:
        tmp = self._path(f".{plan_.MARKER}.{uuid.uuid4().hex}")
        with open_file(tmp, "w") as f:
            f.write(plan_.marker_json(copies))
        os.replace(tmp, self._path(plan_.MARKER))

    def read(self, step: int) -> dict[str, Any]:
        """The copy of ``step``, checked against its checksum before anything is unpickled."""
        copy, data = self.raw(step)
        byte_layout.verify(data, copy.digest, f"{os.path.basename(self.directory)}/{copy.slot}")
        return byte_layout.read(data)

    def raw(self, step: int) -> tuple[plan_.RankCopy, bytearray | mmap.mmap]:
        """The committed copy of ``step`` and its bytes, not checked (``read`` checks)."""
        found = [c for c in self.copies() if c.step == step]
        if not found:
            raise FileNotFoundError(f"no committed in-memory copy of step {step}")
        copy = found[0]
        path = self._path(copy.slot)
        if os.path.getsize(path) < copy.nbytes:  # a slot is rounded up to its mapping's
            raise ValueError(f"{copy.slot} has {os.path.getsize(path)} bytes, not {copy.nbytes}")
        data, _ = checked_read.read_file(path, copy.nbytes, what=copy.slot)
        return copy, data

    def keep_only(self, step: int | None) -> None:
        """Forget every copy but ``step``'s (None: all); free the slots no copy uses."""
        kept = [c for c in self.copies() if c.step == step]
        for mapped in self.slots.values():
            mapped.close()  # else a removed file's pages stay with its mapping
        if os.path.isdir(self.directory):
            self._commit(kept)
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.directory):
                stale = name.startswith(f".{plan_.MARKER}.")
                if stale or (name in SLOTS and name not in {c.slot for c in kept}):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._path(name))


class BackgroundWriter:
    """One transfer at a time on a thread of its own; a failure (tmpfs full, folder removed:
    storage stays the fallback) is reported once per streak of failures, the same for a copy
    made on the caller's thread (``attempt``)."""

    def __init__(self, directory: str, *, name: str) -> None:
        self.directory, self.name = directory, name
        self._thread: threading.Thread | None = None
        self._failures = FailureStreak(directory)

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, step: int, write: Callable[[], Any]) -> None:
        self._thread = threading.Thread(
            target=self.attempt, args=(step, write), name=self.name, daemon=True
        )
        self._thread.start()

    def attempt(self, step: int, write: Callable[[], T]) -> T | None:
        """``write()`` on this thread: its result, or None when it failed (reported)."""
        try:
            result = write()
        except Exception as exc:  # any failure: this copy is not made, storage still is
            self._failures.failed(step, exc)
            return None
        self._failures.succeeded()
        return result

    def flush(self) -> None:
        if self._thread is not None:
            self._thread.join()

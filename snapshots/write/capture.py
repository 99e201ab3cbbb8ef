"""Capturing a save's state into reused staging buffers, on the training thread.

With an optimizer to overlap with (CheckFreq), its parameters and state are copied later, on
the writer thread (``copy_deferred``), and ``optimizer.step()`` copies in a pre-hook whatever
the writer has not copied yet: the only place an overlapped save makes training wait, and it
never waits for the writer thread to be scheduled (a busy node, its lower priority).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from snapshots.errors import UnsafeStateError
from snapshots.format import layout
from snapshots.format.serialization import Stager
from snapshots.write import commit, sharded_commit


class Capturer:
    def __init__(self, *, shared: bool = False) -> None:
        """``shared``: stage on shared memory, for the writer process."""
        self.stager = Stager(shared=shared)
        self.copy_done = threading.Event()  # overlapped capture: deferred copies finished
        self.copy_done.set()
        self._hooked: set[int] = set()
        self.last_hook_wait_ms = 0.0

    def capture(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        epoch: int,
        world_size: int,
        meta: dict[str, Any],
        per_rank: Sequence[Any] | None,
        started: float,
        overlap: torch.optim.Optimizer | None = None,
        shards: Callable[[], sharded_commit.ShardPart] | None = None,
        token: str | None = None,
    ) -> commit.SaveJob:
        if overlap is not None:
            self._hook_optimizer(overlap)
            self.copy_done.clear()
            entries = self.stager.capture_overlapped(state, overlap)
        else:
            entries = self.stager.capture(state)
        ranks = None
        if per_rank is not None:
            ranks = [self.stager.copy_tree(v, ("__rank__", r)) for r, v in enumerate(per_rank)]
        part = shards() if shards is not None else None
        if part is not None:
            # One list of deferred copies, shared by the writer and the optimizer.step() hook:
            # the hook must copy the shards' tensors too before the step changes them.
            self.stager.deferred.extend(part.staged.deferred)
            part.staged.deferred.clear()
        return commit.SaveJob(
            step=step,
            epoch=epoch,
            world_size=world_size,
            metadata=meta,
            entries=entries,
            per_rank=ranks,
            stall_ms=(time.perf_counter() - started) * 1000,
            token=token or layout.new_token(),
            overlapped=overlap is not None,
            shards=part,
        )

    def finish_deferred(self, job: commit.SaveJob) -> None:
        """On the writer thread: the deferred copies of an overlapped save."""
        if not job.overlapped:
            return
        try:
            self.stager.copy_deferred()  # a sharded save's too (see ``capture``)
        finally:
            self.copy_done.set()  # never leave optimizer.step() waiting

    def _hook_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._hooked:
            return
        self._hooked.add(id(optimizer))
        optimizer.register_step_pre_hook(self.before_optimizer_step)

    def before_optimizer_step(self, *_: Any) -> None:
        """The only place an overlapped save makes training wait: weights are about to change.
        Copies what the writer has not copied yet itself, rather than wait for the writer."""
        if self.copy_done.is_set():
            return
        begun = time.perf_counter()
        self.stager.copy_deferred()
        self.copy_done.set()
        self.last_hook_wait_ms = (time.perf_counter() - begun) * 1000


def json_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    meta = dict(metadata or {})
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as exc:
        raise UnsafeStateError(f"snapshot metadata must be JSON-serialisable: {exc}") from exc
    return meta

"""Snapshots under DDP: replicated state written once (rank 0), per-rank state gathered.

Every collective runs in the caller's (training) thread: collectives issued from a background
thread on the training group crash gloo ("collective mismatch"). So:
- ``save``: rank 0 broadcasts its last committed step (the previous save's outcome), every
  rank's per-rank state (e.g. RNG) is gathered to rank 0, and rank 0 hands everything to its
  SnapshotStore, whose background thread does the I/O (no collectives there).
- ``wait``/``close``: rank 0 flushes, then broadcasts the step now committed; all ranks agree.
- ``load``: rank 0 picks the step (newest verified), broadcasts it; every rank loads that same
  step from the shared storage and gets its own per-rank entry (None if its rank >= the saved
  world size).
Per-rank files are named ``rank-<5 digits>.<token>.pt`` in the step folder, which leaves room
for sharded state (one file per rank) later.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from snapshots.errors import NoValidSnapshotError, SnapshotError
from snapshots.events import emit
from snapshots.info import LoadedSnapshot, SaveHandle
from snapshots.serialization import is_stateful
from snapshots.store import SnapshotStore, restore_into

_NONE = -1


class DistributedSnapshotter:
    def __init__(self, store: SnapshotStore, group: Any = None) -> None:
        self.store = store
        self.group = group
        # Without a process group (a single process) it acts as rank 0 of 1, no collectives.
        self._dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self._dist else 0
        self.world_size = dist.get_world_size(group) if self._dist else 1
        self.last_committed_step: int | None = None  # agreed by all ranks at sync points

    # ------------------------------------------------------------------ save
    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        per_rank: Mapping[str, Any] | None = None,
        epoch: int = 0,
        metadata: Mapping[str, Any] | None = None,
        blocking: bool | None = None,
        overlap_with: Any = None,
    ) -> SaveHandle | None:
        """Collective. ``state`` is replicated (only rank 0's is written); ``per_rank`` is this
        rank's own state. ``overlap_with``: see ``SnapshotStore.save`` (used on rank 0).
        Returns rank 0's SaveHandle, None on other ranks."""
        if self.rank == 0 and self.store.when_busy == "wait":
            # rank 0 would wait inside store.save anyway; waiting first lets the broadcast
            # below carry the previous save's outcome (its error still surfaces once, later).
            self.store._settle_pending()
        self._agree_on_committed()
        mine = {k: (v.state_dict() if is_stateful(v) else v) for k, v in (per_rank or {}).items()}
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        if self._dist:
            dist.gather_object(mine, gathered, group=self.group, group_dst=0)
        else:
            gathered = [mine]
        if self.rank != 0:
            return None
        return self.store.save(
            step,
            state,
            epoch=epoch,
            world_size=self.world_size,
            metadata=metadata,
            blocking=blocking,
            per_rank=gathered,
            overlap_with=overlap_with,
        )

    def wait(self) -> int | None:
        """Collective. Flush rank 0's save; every rank learns the last committed step.
        Rank 0 re-raises a save failure after the broadcast, so no rank is left waiting."""
        error: SnapshotError | None = None
        if self.rank == 0:
            try:
                self.store.wait()
            except SnapshotError as exc:
                error = exc
        self._agree_on_committed()
        if error is not None:
            raise error
        return self.last_committed_step

    def close(self) -> None:
        """Collective: wait(), then stop rank 0's writer."""
        try:
            self.wait()
        finally:
            if self.rank == 0:
                self.store.close()

    def _agree_on_committed(self) -> None:
        info = self.store.last_committed if self.rank == 0 else None
        box = [info.step if info is not None else _NONE]
        self._broadcast(box)
        self.last_committed_step = None if box[0] == _NONE else int(box[0])

    def _broadcast(self, box: list[Any]) -> None:
        if self._dist:
            dist.broadcast_object_list(box, group=self.group, group_src=0)

    # ------------------------------------------------------------------ load
    def load(
        self,
        step: int | None = None,
        *,
        into: Mapping[str, Any] | None = None,
        rank_into: Mapping[str, Any] | None = None,
    ) -> LoadedSnapshot | None:
        """Collective. None on every rank when nothing is committed (a fresh start)."""
        chosen = self._agree_on_step(step)
        if chosen is None:
            return None
        loaded = self.store.load(chosen, into=into, rank=self.rank)
        if rank_into is not None and isinstance(loaded.rank_state, Mapping):
            restore_into(rank_into, loaded.rank_state, step=chosen)
        emit(
            "snapshot.restored",
            step=chosen,
            saved_world_size=loaded.info.world_size,
            world_size=self.world_size,
        )
        return loaded

    def _agree_on_step(self, step: int | None) -> int | None:
        box: list[Any] = [None]
        if self.rank == 0:
            box[0] = self._pick_step(step)
        self._broadcast(box)
        answer = box[0]
        if isinstance(answer, tuple):  # rank 0 failed: every rank fails the same way
            kind, message = answer
            raise (NoValidSnapshotError if kind == "invalid" else SnapshotError)(message)
        return None if answer == _NONE else int(answer)

    def _pick_step(self, step: int | None) -> int | tuple[str, str]:
        # Never raise before the broadcast: the other ranks would wait for it forever.
        try:
            if step is not None:
                result = self.store.verify(step)
                if not result.ok:
                    problems = "; ".join(result.problems)
                    return ("invalid", f"snapshot of step {step} fails verification: {problems}")
                return step
            latest = self.store.latest()
        except NoValidSnapshotError as exc:
            return ("invalid", str(exc))
        except SnapshotError as exc:
            return ("error", str(exc))
        return latest.step if latest is not None else _NONE

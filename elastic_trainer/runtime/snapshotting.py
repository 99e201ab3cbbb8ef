"""The session's snapshots, through ``snapshots.distributed.DistributedSnapshotter``.

Shared state (model, optimizer, sampler, session counters: identical on every rank under
DDP) is written once by rank 0; per-rank state (RNG streams) is gathered to rank 0 and stored
as per-rank entries. Every rank restores the same step; a rank that did not exist in the saved
world keeps its own RNG.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from snapshots import RNGState, SnapshotError, SnapshotInfo, SnapshotSaveError, SnapshotStore
from snapshots.distributed import DistributedSnapshotter


@dataclass(frozen=True, kw_only=True)
class Restored:
    info: SnapshotInfo
    state: dict[str, Any]  # entry name -> saved value (also for entries restored in place)


class SessionSnapshots:
    def __init__(self, url: str, *, keep: int | None) -> None:
        self.store = SnapshotStore(url, keep=keep, async_save=True)
        self.url = self.store.url
        self._snapshotter = DistributedSnapshotter(self.store)
        self.last_saved_step: int | None = None  # saved or restored: never save it again

    def restore(self, into: Mapping[str, Any]) -> Restored | None:
        """Collective: load the newest verified snapshot (chosen by rank 0) on every rank."""
        loaded = self._snapshotter.load(into=into, rank_into={"rng": RNGState()})
        if loaded is None:
            return None
        self.last_saved_step = loaded.info.step
        return Restored(info=loaded.info, state=loaded.state)

    def save(self, step: int, state: Mapping[str, Any], *, epoch: int, blocking: bool) -> None:
        """Collective. A blocking save returns on every rank only once the snapshot is
        committed, so no rank exits (or is stopped) before the final snapshot exists."""
        try:
            self._snapshotter.save(
                step,
                state,
                per_rank={"rng": RNGState()},
                epoch=epoch,
                blocking=blocking,
                overlap_with=None if blocking else sole_optimizer(state),
            )
        except SnapshotSaveError as exc:
            if exc.handle is None:
                raise  # this save itself failed
            # An earlier async save failed (already logged as snapshot.failed); this one runs.
        self.last_saved_step = step
        if blocking:
            self._snapshotter.wait()

    def close(self) -> None:
        """Collective: flush the in-flight save and stop the writer."""
        self._snapshotter.close()

    def close_local(self) -> None:
        """No collective: only this process's writer (rank 0's) is flushed and stopped."""
        with contextlib.suppress(SnapshotError):
            self.store.close()  # a failure was already logged as snapshot.failed


def sole_optimizer(state: Mapping[str, Any]) -> torch.optim.Optimizer | None:
    """The optimizer whose step() an asynchronous snapshot may overlap (CheckFreq).

    With exactly one optimizer, its parameters and state change only in ``step()``: their copy
    runs in the background during the next forward/backward, and ``step()`` waits for it.
    With none or several, everything is copied at the call (still asynchronous to persist).
    """
    optimizers = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
    return optimizers[0] if len(optimizers) == 1 else None

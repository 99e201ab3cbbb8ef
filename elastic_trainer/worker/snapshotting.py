"""The session's snapshots, through ``snapshots.distributed.DistributedSnapshotter``.

Shared state (model, optimizer, sampler, session counters: identical on every rank under
DDP) is written once by rank 0; per-rank state (RNG streams) is gathered to rank 0 and stored
as per-rank entries. Every rank restores the same step; a rank that did not exist in the saved
world keeps its own RNG.

Storage outages: periodic saves are skipped (``snapshot.skipped``) while storage is down,
never waited for; a blocking (final) save takes ``deadline_s`` and raises SnapshotSaveError
on every rank once it passes (rank 0 decides, the others learn it at the closing broadcast;
a sharded save: the ranks agree before starting it, so none is left in its commit).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_trainer.contract import protocol
from elastic_trainer.errors import ConfigError
from elastic_trainer.private_files import NotOursError, private_dirs
from elastic_trainer.worker import distributed as D
from elastic_trainer.worker import run_liveness
from elastic_trainer.worker.context import WorkerContext
from elastic_trainer.worker.memory.interface import InMemoryTier
from elastic_trainer.worker.memory.on_failure import (
    Capture,
    Failed,
    FailureCopy,
    Write,
    WriteChecked,
)
from elastic_trainer.worker.memory.plan import Source
from elastic_trainer.worker.memory.shards import ShardedMemoryTier
from elastic_trainer.worker.memory.slots import refused
from elastic_trainer.worker.memory.tier import MemoryTier
from snapshots import (
    Owner,
    RNGState,
    SnapshotError,
    SnapshotInfo,
    SnapshotOwnerError,
    SnapshotSaveError,
    SnapshotStore,
)
from snapshots.distributed import DistributedSnapshotter


@dataclass(frozen=True, kw_only=True)
class Restored:
    info: SnapshotInfo
    state: dict[str, Any]  # entry name -> saved value (also for entries restored in place)


class SessionSnapshots:
    def __init__(
        self,
        url: str,
        *,
        keep: int | None,
        owner: Owner | None = None,
        storage_timeout: float | None = None,
        storage_options: Mapping[str, Any] | None = None,
        owner_probe: Any = None,
    ) -> None:
        """``owner``: the job and supervisor run writing ``url`` (``snapshots.ownership``),
        ``owner_probe`` asked whether the run recorded there lives (``run_liveness``);
        ``storage_timeout``: seconds per storage operation, retries included (default 30)."""
        self.store = SnapshotStore(
            url,
            keep=keep,
            async_save=True,
            owner=owner,
            owner_probe=owner_probe,
            storage_timeout=storage_timeout,
            storage_options=storage_options,
        )
        self.url = self.store.url
        self._snapshotter = DistributedSnapshotter(self.store)
        self.last_saved_step: int | None = None  # saved or restored: never save it again

    def restore(
        self,
        into: Mapping[str, Any],
        *,
        fallback_reason: str | None = None,
        source: Source = Source.STORAGE,
    ) -> Restored | None:
        """Collective: load the newest verified snapshot (chosen by rank 0) on every rank.
        ``fallback_reason``: why the in-memory tier could not serve (in snapshot.restored);
        ``source``: MIRROR when the snapshot was just rebuilt from in-memory copies."""
        fields = {"source": source.value}
        if fallback_reason is not None:
            fields["fallback_reason"] = fallback_reason
        loaded = self._snapshotter.load(
            into=into, rank_into={"rng": RNGState()}, event_fields=fields
        )
        if loaded is None:
            return None
        self.last_saved_step = loaded.info.step
        return Restored(info=loaded.info, state=loaded.state)

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        epoch: int,
        blocking: bool,
        deadline_s: float | None = None,
    ) -> None:
        """Collective. A blocking save returns on every rank only once the snapshot is
        committed, so no rank exits (or is stopped) before the final snapshot exists; it
        raises SnapshotSaveError on every rank if it failed or ``deadline_s`` passed.

        A blocking save first flushes the save in flight and skips the step if that one
        committed it; ``last_saved_step`` only counts saves known to be committed (a periodic
        save may have been skipped while storage was down: the final one must still run)."""
        error: SnapshotError | None = None
        with self.store.deadline(deadline_s if blocking else None):
            if blocking and self._committed_after_flush() == step:
                self.last_saved_step = step
                return
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
                    error = exc  # this save itself failed (rank 0)
                # else: an earlier async save failed (already logged); this one runs.
            if blocking:
                error = self._closing_broadcast(step, error)
        if error is not None:
            raise error
        if blocking:
            self.last_saved_step = step

    def _committed_after_flush(self) -> int | None:
        """Collective: wait for the save in flight; the step every rank agrees is committed."""
        try:
            return self._snapshotter.wait()
        except SnapshotError:  # that save failed, and said so (snapshot.failed)
            return self._snapshotter.last_committed_step

    def _closing_broadcast(self, step: int, error: SnapshotError | None) -> SnapshotError | None:
        """Every rank takes part in the broadcast, even when rank 0's save already failed
        (if rank 0 raised first, the other ranks would wait in it until the collective
        timeout). A rank learns of a failure when the committed step is not the one saved."""
        try:
            committed = self._snapshotter.wait()
        except SnapshotError as exc:
            return error or exc
        if error is None and committed != step:
            return SnapshotSaveError(
                f"the snapshot of step {step} was not committed (rank 0 logged why as "
                "snapshot.failed)",
                step=step,
            )
        return error

    def newest_step(self) -> int | None:
        """Rank 0: the newest committed step (None when none, or storage does not answer:
        the in-memory tier then serves if it can)."""
        try:
            steps = self.store.committed_steps()
        except SnapshotError:
            return None
        return max(steps) if steps else None

    def close(self) -> None:
        """Collective: flush the in-flight save and stop the writer."""
        self._snapshotter.close()

    def release_reserved(self) -> None:
        """Collective, once training has ended: close, then rank 0 frees the disk space kept
        for the next save (``snapshot.reserved_released``)."""
        self.close()
        if D.rank() == 0:
            self.store.release_reserved()

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


def open_memory_tier(
    directory: str | None, every: int | str | None, state: Mapping[str, Any]
) -> InMemoryTier | None:
    """Collective when it opens one. None: no folder (not under elastic-train), no process
    group, or sharded state with ``every`` 0. Sharded (FSDP2) state: each rank keeps its own
    shards every ``every`` steps (``shards``; unset: ``DEFAULT_SHARDED_MEMORY_SNAPSHOT_EVERY``);
    replicated state: one copy per node (``tier``), every ``every`` steps, and unset or 0 only
    just in time, when the group ends (``open_failure_copy``; HSDP shards too)."""
    from snapshots.sharded.state import has_dtensors

    if not (directory and dist.is_initialized()):
        return None
    sharded = has_dtensors(state)
    if every is None:
        every = protocol.DEFAULT_SHARDED_MEMORY_SNAPSHOT_EVERY if sharded else 0
    if every == "auto":  # sharded: from every step on, until the session measures a copy
        every = 1 if sharded else 0
    if sharded and every == 0:
        return None
    # every rank opens it or none does (opening is collective)
    if D.all_reduce_ints([int(_private_folder(directory))], op=dist.ReduceOp.MIN) != [1]:
        return None
    if sharded:
        return ShardedMemoryTier(directory, every=every, state=state)
    return MemoryTier(directory, every=every)


def opens_before_handoff(state: Mapping[str, Any]) -> bool:
    """Whether the tier may open while a joining node's previous workers still train
    (``worker.handoff``): a replicated state's tier only names its folder and checks it is
    private; a sharded state's tier links its mirrors and rank folders, which are the
    previous workers' until they stop."""
    from snapshots.sharded.state import has_dtensors

    return not has_dtensors(state)


def open_failure_copy(
    memory: InMemoryTier | None,
    state: Mapping[str, Any],
    capture: Capture,
    context: WorkerContext,
) -> FailureCopy | None:
    """The just-in-time copy (``on_failure``), when the state names its optimizer: only its
    hooks tell a consistent state from one torn by a step. Replicated state: unless periodic
    copies (``every`` > 0) are the node's copies. Sharded state: only where every shard is
    also held by another rank (HSDP), beside the periodic copies: a lost rank's replica
    copies it just in time for it. The same decision on every rank."""
    optimizers = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
    write_held: WriteChecked | None = None  # the state as a step began: a GPU behind the host
    failed: Failed | None = None
    if isinstance(memory, MemoryTier) and memory.every == 0:
        write: Write = memory.dump
        write_held, failed = memory.dump, memory.failed
    elif isinstance(memory, ShardedMemoryTier) and memory.replicated_shards:
        write = memory.dump  # DCP's optimizer state dict needs the optimizer itself: no hold
    else:
        return None
    if not optimizers:
        return None
    copy = FailureCopy(capture, write, write_held=write_held, failed=failed)
    copy.attach(optimizers)
    copy.watch(context.control_dir, context.local_rank)
    return copy


def _private_folder(directory: str) -> bool:
    """Whether the tier's folder is ours alone (made so when missing): a folder someone else
    can write is never used, ``snapshot.memory_refused`` says so, storage stays."""
    try:
        private_dirs(directory)
    except NotOursError as exc:
        refused(exc)
        return False
    return True


_NO_STORAGE = "no snapshot directory to write the survivors' in-memory copies to"


def restore_state(
    memory: InMemoryTier | None,
    snapshots: SessionSnapshots | None,
    into: Mapping[str, Any],
) -> tuple[int, dict[str, Any]] | None:
    """Collective: (step, saved state) from the memory tier, else from storage; None when
    there is nothing to restore (a fresh start). Sharded state after a node loss: the
    survivors' in-memory copies are first written to storage, then loaded from there."""
    reason, source = None, Source.STORAGE
    if memory is not None:
        newest = snapshots.newest_step if snapshots is not None else None
        plan, restored = memory.restore(into, {"rng": RNGState()}, newest)
        if restored is not None:
            return restored.step, restored.state
        reason = plan.reason
        if plan.source is Source.MIRROR and isinstance(memory, ShardedMemoryTier):
            reason = memory.rebuild(snapshots.store) if snapshots is not None else _NO_STORAGE
            source = Source.STORAGE if reason is not None else Source.MIRROR
    if snapshots is None:
        return None
    loaded = snapshots.restore(into, fallback_reason=reason, source=source)
    return None if loaded is None else (loaded.info.step, loaded.state)


# Set by the supervisor (supervisor/rendezvous/handler.py, same name) for the workers it starts.
ENV_RDZV_LINEAGE = protocol.ENV_RDZV_LINEAGE


def open_snapshots(url: str, keep: int, context: WorkerContext, attempt: int) -> SessionSnapshots:
    """The folder belongs to this job (``snapshots.ownership``): the run token is the
    group's attempt, agreed by every rank, so a later attempt or a requeued run adopts the
    folder and a concurrent run of the same job takes it over from this one. The lineage
    (the supervisor's rendezvous store, ``ENV_RDZV_LINEAGE``) tells a re-form of this job
    from a run formed on another store, which a live run's folder refuses -- only while that
    run demonstrably lives (``run_liveness``: a job killed hard and started again adopts its
    own folder at once)."""
    job_id = context.job_id
    lineage = os.environ.get(ENV_RDZV_LINEAGE, "")
    owner = run_liveness.this_run(job_id, f"{attempt:x}", lineage) if job_id else None
    try:
        return SessionSnapshots(
            url,
            keep=keep,
            owner=owner,
            owner_probe=run_liveness.probe,
            storage_timeout=context.settings.storage_timeout_s,
            storage_options=context.settings.snapshot_storage_options(),
        )
    except SnapshotOwnerError as exc:  # a restart cannot fix it: exit 2 with this line
        raise ConfigError(str(exc)) from exc

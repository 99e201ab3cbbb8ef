"""Snapshots under DDP: replicated state written once (rank 0), per-rank state gathered.

Every collective runs in the caller's (training) thread: collectives issued from a background
thread on the training group crash gloo ("collective mismatch"). So:
- ``save``: rank 0 broadcasts its last committed step (the previous save's outcome), every
  rank's per-rank state (e.g. RNG) is gathered to rank 0, and rank 0 hands everything to its
  SnapshotStore, whose background thread does the I/O (no collectives there).
- ``wait``/``close``: rank 0 flushes, then broadcasts the step now committed; all ranks agree.
- ``load``: rank 0 lists the committed steps and broadcasts them; all ranks try the newest
  together (each loads it from the shared storage with its own per-rank entry, None if its
  rank >= the saved world size), agree on the outcome with one all-gather, and move on to
  the next older step together if any rank failed.
Per-rank files are named ``rank-<5 digits>.<token>.pt`` in the step folder.

Sharded saves (``sharded=True``, or by default whenever the state holds an FSDP2 model):
every rank writes its own shards (``snapshots.format.sharding`` describes the format). In the
training thread, one all-gather carries each rank's skip reason (the ranks skip together or
not at all; a blocking save: whether its deadline passed while the save in flight still
ran, and then every rank gives up together), its DCP write plan, its per-rank state and
rank 0's token and committed step; every rank then works out the same deduplicated plan,
stages its share (the only wait; with ``overlap_with=optimizer`` the optimizer's parameters
and state are copied on the writer thread instead, and ``optimizer.step()`` waits for that
copy), and its writer thread writes and commits over the snapshot's own gloo group
(``snapshots.write.sharded_commit``). Loading needs nothing new here:
every rank reads only the chunks overlapping its current shards, and any rank's failure
makes all fall back together.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from snapshots.errors import NoValidSnapshotError, SnapshotError, SnapshotSaveError
from snapshots.events import emit
from snapshots.format import layout
from snapshots.format.serialization import is_stateful
from snapshots.info import LoadedSnapshot, SaveHandle
from snapshots.store import SnapshotStore, restore_into

_NONE = -1  # no committed step, in a broadcast


class DistributedSnapshotter:
    # Seconds a sharded commit's collectives on the snapshot group may wait for a rank (a
    # dead rank is usually noticed at once: gloo sees its connection close).
    commit_timeout_s: float = 900.0

    def __init__(
        self, store: SnapshotStore, group: Any = None, *, sharded: bool | None = None
    ) -> None:
        """``sharded``: every rank writes (True), rank 0 alone writes replicated state
        (False), or sharded exactly when the state holds a DTensor (FSDP2) model (None)."""
        self.store = store
        self.group = group
        self.sharded = sharded
        self._snapshot_group: Any = None
        self._stager: Any = None
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
        rank's own state. ``overlap_with``: see ``SnapshotStore.save`` (used on rank 0; on
        every rank for a sharded save).
        Returns rank 0's SaveHandle, None on other ranks (sharded: every rank's handle)."""
        if self._is_sharded(state):
            return self._save_sharded(
                step, state, per_rank=per_rank, epoch=epoch, metadata=metadata,
                blocking=blocking, overlap_with=overlap_with,
            )  # fmt: skip
        if self.rank == 0 and self.store.when_busy == "wait":
            # rank 0 would wait inside store.save anyway; waiting first lets the broadcast
            # below carry the previous save's outcome (its error still surfaces once, later).
            self.store._settle_pending()
        self._agree_on_committed()
        mine = _mine(per_rank)
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

    def _is_sharded(self, state: Mapping[str, Any]) -> bool:
        if self.sharded is not None:
            return self.sharded
        from snapshots.sharded.state import has_dtensors

        return has_dtensors(state)

    def _save_sharded(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        per_rank: Mapping[str, Any] | None,
        epoch: int,
        metadata: Mapping[str, Any] | None,
        blocking: bool | None,
        overlap_with: Any = None,
    ) -> SaveHandle | None:
        from snapshots.sharded.shards import ShardStager, local_plan, my_items, step_tensors
        from snapshots.sharded.state import split_state
        from snapshots.write.sharded_commit import ShardPart

        blocking = (not self.store.async_save) if blocking is None else blocking
        skeletons, tensors = split_state(state)
        planner, plan = local_plan(tensors)
        reason = self._why_not_now(step, blocking)
        answers = self._all_gather((reason, plan, self._rank0_facts(), _mine(per_rank)))
        token, committed = answers[0][2]
        self.last_committed_step = committed
        reasons = [a[0] for a in answers if a[0] is not None]
        if reasons and blocking:  # every rank gives up together, none is left in a collective
            raise SnapshotSaveError(_gave_up(step, answers), step=step)
        if reasons:
            if self.rank == 0:
                emit("snapshot.skipped", step=step, reason=reasons[0])
            return SaveHandle(step, skipped_reason=reasons[0])
        mine = my_items(planner, [a[1] for a in answers], self.rank)
        stager = self._stager = self._stager or ShardStager()
        group = self._group_for_commits()
        overlap = None if blocking else overlap_with
        defer = step_tensors(overlap) if overlap is not None else frozenset()

        def part() -> ShardPart:  # runs inside the store's capture: counted as stall
            staged = stager.stage(planner, mine, tensors, defer=defer)
            return ShardPart(rank=self.rank, world_size=self.world_size, staged=staged, group=group)

        return self.store.save(
            step, skeletons, epoch=epoch, world_size=self.world_size, metadata=metadata,
            blocking=blocking, per_rank=[a[3] for a in answers] if self.rank == 0 else None,
            shards=part, token=token, overlap_with=overlap,
        )  # fmt: skip

    def _why_not_now(self, step: int, blocking: bool) -> str | None:
        """Why this rank cannot start the save now: storage down or busy (asynchronous: the
        ranks skip together), or the deadline passed while the save in flight still ran
        (blocking: the ranks give up together)."""
        if not blocking:
            return self.store.why_skip()
        late = self.store.flush_before_blocking(step)
        return None if late is None else str(late)

    def _rank0_facts(self) -> tuple[str, int | None] | None:
        if self.rank != 0:
            return None
        info = self.store.last_committed
        return layout.new_token(), (info.step if info is not None else None)

    def _all_gather(self, value: Any) -> list[Any]:
        if not self._dist:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _group_for_commits(self) -> Any:
        """The snapshot's own gloo group, made once (a collective, on the training thread)."""
        if self._dist and self._snapshot_group is None:
            ranks = dist.get_process_group_ranks(self.group) if self.group is not None else None
            self._snapshot_group = dist.new_group(
                ranks, backend="gloo", timeout=dt.timedelta(seconds=self.commit_timeout_s)
            )
        return self._snapshot_group

    def wait(self) -> int | None:
        """Collective. Flush rank 0's save; every rank learns the last committed step.
        Rank 0 re-raises a save failure after the broadcast, so no rank is left waiting."""
        error: SnapshotError | None = None
        if self.rank == 0 or self._snapshot_group is not None:  # sharded: every rank writes
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
            if self.rank == 0 or self._snapshot_group is not None:
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
        event_fields: Mapping[str, Any] | None = None,
    ) -> LoadedSnapshot | None:
        """Collective. None on every rank when nothing is committed (a fresh start).

        Without ``step``, committed snapshots are tried newest first, all ranks together:
        every rank loads (checksums, weights-only deserialisation, restore) the same step,
        the ranks agree on the outcome, and if any rank failed all move on to the next older
        step (``snapshot.corrupt`` names the rank and the problem). NoValidSnapshotError on
        every rank when none loads; no rank is ever left waiting in a collective.
        ``event_fields``: added to ``snapshot.restored`` (e.g. why a caller's other source
        could not serve).
        """
        candidates = self._agree_on_candidates(step)
        if not candidates:
            return None
        problems = []
        for chosen in candidates:
            loaded, problem = self._try_load(chosen, into, rank_into)
            failures = self._failures(problem)
            if not failures:
                emit(
                    "snapshot.restored",
                    step=chosen,
                    saved_world_size=loaded.info.world_size,  # type: ignore[union-attr]
                    world_size=self.world_size,
                    **{"source": "storage", **(event_fields or {})},
                )
                return loaded
            text = "; ".join(f"rank {r}: {p}" for r, p in failures)
            if self.rank == 0:  # one report per snapshot, not one per rank
                emit(
                    "snapshot.corrupt",
                    step=chosen,
                    url=f"{self.store.url}/{layout.step_dir(chosen)}",
                    problem=text,
                )
            problems.append(f"step {chosen}: {text}")
        raise NoValidSnapshotError(
            f"{len(problems)} snapshot(s) at {self.store.url} but none loads "
            f"({' | '.join(problems)[:1000]}); run 'elastic-train snapshots verify --deep "
            f"{self.store.url}', then repair or remove them, or point to another snapshot URL"
        )

    def _try_load(
        self, step: int, into: Mapping[str, Any] | None, rank_into: Mapping[str, Any] | None
    ) -> tuple[LoadedSnapshot | None, str | None]:
        # Any failure, of any type, is an answer to share: raising here would leave the
        # other ranks waiting in the next collective forever.
        try:
            loaded = self.store.load(step, into=into, rank=self.rank)
            if rank_into is not None and isinstance(loaded.rank_state, Mapping):
                restore_into(rank_into, loaded.rank_state, step=step)
        except Exception as exc:  # every load failure, whatever its type, means "try an older one"
            return None, " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
        return loaded, None

    def _failures(self, problem: str | None) -> list[tuple[int, str]]:
        """Every rank's problem with the step just tried (one all-gather), by rank."""
        answers: list[Any] = [problem]
        if self._dist:
            answers = [None] * self.world_size
            dist.all_gather_object(answers, problem, group=self.group)
        return [(r, p) for r, p in enumerate(answers) if p is not None]

    def _agree_on_candidates(self, step: int | None) -> list[int]:
        """Rank 0 lists the steps to try, newest first; every rank gets the same list."""
        box: list[Any] = [None]
        if self.rank == 0:
            box[0] = self._candidates(step)
        self._broadcast(box)
        answer = box[0]
        if isinstance(answer, tuple):  # rank 0 failed: every rank fails the same way
            kind, message = answer
            raise (NoValidSnapshotError if kind == "invalid" else SnapshotError)(message)
        return [int(s) for s in answer]

    def _candidates(self, step: int | None) -> list[int] | tuple[str, str]:
        # Never raise before the broadcast: the other ranks would wait for it forever.
        try:
            committed = self.store.committed_steps()
        except SnapshotError as exc:
            return ("error", str(exc))
        if step is None:
            return sorted(committed, reverse=True)
        if step not in committed:
            return ("invalid", f"no committed snapshot of step {step} at {self.store.url}")
        return [step]


def _gave_up(step: int, answers: list[Any]) -> str:
    why = "; ".join(f"rank {r}: {a[0]}" for r, a in enumerate(answers) if a[0] is not None)
    return f"the blocking save of step {step} was given up on every rank ({why})"[:1000]


def _mine(per_rank: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: (v.state_dict() if is_stateful(v) else v) for k, v in (per_rank or {}).items()}

"""The in-memory tier for sharded (FSDP2) state: each rank's own shards, in its node's memory.

Every ``memory_snapshot_every`` steps each rank copies (the only time the loop waits) its
local shards (``DTensor.to_local()``), the state's replicated tensors and plain values, its
RNG streams and a description of each DTensor (global shape, dtype, placements, mesh shape,
this rank's offsets) into its own folder in its node's memory folder
(``WorkerSettings.memory_dir``): one copy per tensor into a slot file kept mapped across
steps, in the byte layout of ``byte_layout``, checksummed while cache-hot (read back
weights-only after the check; ``rank_slots``). Two slots and a marker per rank: see
``shard_plan`` for why two copies stay committed.

A restore (same world size and layout: a worker crash on a node that survives) is
collective: the ranks agree on the newest step every rank holds, each loads and checks its
copy, they agree that every rank succeeded, then each restores its shards through
``set_state_dict``; any rank's failure sends every rank to storage, with the reason.

Each copy is also mirrored on the next node (``mirror``; a background thread sends
it from the committed slot's mapping): when the world changed (a
node lost, or replaced), the survivors' own copies and mirrors are written as a sharded
storage snapshot of the newest step they make whole, which the caller then loads with the
normal resharding load (``snapshotting.restore_state``; ``snapshot.restored`` says
``source=mirror``). Without a mirror of every lost rank, storage serves, with the reason.

Under HSDP (a replicate dimension in the mesh) the ranks holding the same shards are found
when the tier opens (``replicas``); each copy names them, every rank also copies its shards
just in time when the group ends (``dump``, from ``on_failure``), and a replica's copy stands
in for a lost rank's (``shard_plan.plan_rebuild``). A rank with a replica on another node
needs no mirror.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.tensor import DTensor

from elastic_trainer.contract.events import emit
from elastic_trainer.worker.distributed import gather_problems
from elastic_trainer.worker.memory import mirror
from elastic_trainer.worker.memory import shard_plan as plan_
from elastic_trainer.worker.memory.plan import RestorePlan, Source
from elastic_trainer.worker.memory.rank_slots import BackgroundWriter, RankSlots
from elastic_trainer.worker.memory.tier import MemoryRestored
from snapshots.format import sharding
from snapshots.format.serialization import is_stateful
from snapshots.sharded.state import is_sharded_module, split_state
from snapshots.store import restore_into


def describe(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """JSON-able description of each DTensor: global shape, dtype, placements, mesh shape,
    this rank's local shape and offsets (from DCP's save planner, which knows them)."""
    dtensors = {n: t for n, t in tensors.items() if isinstance(t, DTensor)}
    planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    planner.set_up_planner(dtensors, is_coordinator=False)
    offsets: dict[str, list[int]] = {}
    for item in planner.create_local_plan().items:
        if item.tensor_data is not None:
            offsets[item.index.fqn] = list(item.tensor_data.chunk.offsets)
    return {
        name: {
            "shape": list(t.shape),
            "dtype": str(t.dtype),
            "placements": repr(tuple(t.placements)),
            "mesh": list(t.device_mesh.shape),
            "local_shape": list(t.to_local().shape),
            "offsets": offsets.get(name, []),
        }
        for name, t in dtensors.items()
    }


class ShardedMemoryTier:
    """Collective: every rank of the group calls ``save`` and ``restore`` at the same step.
    The same interface as ``tier.MemoryTier`` (the session uses either)."""

    def __init__(
        self, directory: str, *, every: int, state: Mapping[str, Any] | None = None
    ) -> None:
        self.every, self.directory = every, directory
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.slots = RankSlots(mirror.own_folder(directory, self.rank))
        gathered = self._all_gather((os.path.realpath(directory), _shards_key(state)))
        self.node_keys = [node for node, _ in gathered]
        holding: dict[str, list[int]] = {}  # the ranks holding each set of shards
        for rank, (_, key) in enumerate(gathered):
            holding.setdefault(key or f"rank {rank}", []).append(rank)
        groups = [holding[key or f"rank {rank}"] for rank, (_, key) in enumerate(gathered)]
        # the ranks holding the same shards as this one (HSDP replicas; () without a state)
        self.replicas = tuple(groups[self.rank]) if gathered[self.rank][1] else ()
        # the same on every rank: each rank's shards are held by another rank too (HSDP)
        self.replicated_shards = all(len(group) > 1 for group in groups)
        self.targets = plan_.mirror_targets(self.node_keys, groups)
        self._link = mirror.MirrorLink(directory, self.targets, self.rank)
        self.rebuild_plan: plan_.RebuildPlan | None = None  # set by restore: see rebuild()
        self.skipped = 0  # steps whose copy was skipped because the previous write still ran
        self._writer = BackgroundWriter(self.slots.directory, name="memory-shards")
        self._layout: tuple[Any, dict[str, Any]] | None = None  # (key, description), reused
        # one slot write at a time: the training thread's periodic copy, or the copy made
        # just in time from the watcher thread (``dump``)
        self._writing = threading.Lock()
        self._sending: str | None = None  # the slot the writer thread sends to the mirror

    # --- save -------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int, state: Mapping[str, Any], per_rank: Mapping[str, Any]) -> None:
        """No collective: this rank copies its shards into its slot's mapping (one copy per
        tensor, checksummed while hot) and hands the committed copy to its thread, which
        sends it to the mirror rank; while the previous send still runs, this step's copy is
        skipped, never waited for (its slot is the one the next copy would overwrite)."""
        with self._writing:
            if self._writer.busy():
                self.skipped += 1
                return
            payload = self._payload(step, state, per_rank)
            copy = self._writer.attempt(step, lambda: self._write(step, payload))
            if copy is not None and self._link.target is not None:
                self._sending = copy.slot
                self._writer.start(step, lambda: self._link.send(self.slots, copy))

    def dump(self, step: int, state: Mapping[str, Any], per_rank: Mapping[str, Any]) -> bool:
        """No collective, from any thread: this rank's copy of ``step`` written now, not sent
        to the mirror (under HSDP the lost ranks' replicas hold theirs): the copy made just
        in time when the group ends (``on_failure``). Declined (False) where it would
        overwrite the slot the writer thread is sending, and for an optimizer without state
        (not stepped yet, or stateless): DCP's optimizer state dict would create it with a
        zero-gradient step of its own, on this thread, under the training's feet (checked
        first: a periodic copy being written then steps it too, and its hooks wait for the
        copy that called this). A failure is reported, never raised."""
        if any(isinstance(v, torch.optim.Optimizer) and not v.state for v in state.values()):
            return False
        with self._writing:
            if any(c.step == step for c in self.slots.copies()):
                return True
            if self._writer.busy() and self.slots.slot_to_write() == self._sending:
                return False
            payload = self._payload(step, state, per_rank)
            return self._writer.attempt(step, lambda: self._write(step, payload)) is not None

    def _payload(
        self, step: int, state: Mapping[str, Any], per_rank: Mapping[str, Any]
    ) -> dict[str, Any]:
        skeletons, tensors = split_state(state)
        return {
            "step": step,
            "world_size": self.world_size,
            "rank": self.rank,
            "layout": self._describe(tensors),
            "skeletons": skeletons,
            "tensors": {n: _local(t) for n, t in tensors.items()},  # empty shards too
            "per_rank": {k: v.state_dict() if is_stateful(v) else v for k, v in per_rank.items()},
        }

    def _write(self, step: int, payload: Mapping[str, Any]) -> plan_.RankCopy:
        return self.slots.write(step, self.world_size, payload, self.replicas)

    def _describe(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The description changes only with the layout: worked out again only then."""
        key = tuple((n, tuple(t.shape), tuple(_local(t).shape)) for n, t in tensors.items())
        if self._layout is None or self._layout[0] != key:
            self._layout = (key, describe(tensors))
        return self._layout[1]

    def flush(self) -> None:
        """Local: wait for the copy being written (and sent to its mirror)."""
        self._writer.flush()

    def holds(self, step: int) -> bool:
        """Local: this rank's copy of ``step`` is committed (waits for the one being written;
        a copy skipped because the previous write still ran, or a failed one, is not)."""
        self._writer.flush()
        return any(copy.step == step for copy in self.slots.copies())

    def close(self) -> None:
        """Every rank at once (the session's close): flush, then end the mirror transfers."""
        self._writer.flush()
        self._link.close()

    # --- restore ----------------------------------------------------------------------------
    def restore(
        self,
        into: Mapping[str, Any],
        rank_into: Mapping[str, Any],
        storage_newest: Callable[[], int | None] | None,
    ) -> tuple[RestorePlan, MemoryRestored | None]:
        """Collective: agree on a step (``shard_plan.plan_sharded``), load and check on
        every rank, agree on success, restore. Any rank's failure: storage on every rank.
        ``storage_newest`` None: no storage (nothing to rebuild into)."""
        held = tuple((c.step, c.world_size) for c in self.slots.copies())
        node = mirror.held_on_node(self.directory)
        newest = storage_newest() if self.rank == 0 and storage_newest is not None else None
        facts = self._all_gather((held, node, newest))
        own = [plan_.RankFacts(copies=f[0]) for f in facts]
        plan, self.rebuild_plan = plan_.plan_sharded(
            own,
            [f[1] for f in facts],
            self.world_size,
            facts[0][2],
            storage=storage_newest is not None,
        )
        if plan.source is not Source.MEMORY or plan.step is None:
            return plan, None  # MIRROR: the caller rebuilds the snapshot (``rebuild``)
        try:  # never raise before the agreement: the peers wait in it
            state, streams, problem = self._load(plan.step, into)
        except Exception as exc:
            state, streams, problem = {}, {}, _one_line(exc)
        problems = gather_problems(problem)
        if problems:
            text = "; ".join(f"rank {r}: {p}" for r, p in problems)[:500]
            reason = f"the in-memory copy of step {plan.step} did not load ({text})"
            return RestorePlan(source=Source.STORAGE, step=None, reason=reason), None
        restore_into(into, state, step=plan.step)
        restore_into(rank_into, streams, step=plan.step)
        emit(
            "snapshot.restored",
            step=plan.step,
            saved_world_size=self.world_size,
            world_size=self.world_size,
            source=Source.MEMORY,
        )
        return plan, MemoryRestored(step=plan.step, state=state, source=Source.MEMORY)

    def _load(self, step: int, into: Mapping[str, Any]) -> tuple[dict, dict, str | None]:
        """(the state to restore, this rank's streams, None) or (.., .., the problem)."""
        payload = self.slots.read(step)
        if (payload.get("step"), payload.get("rank")) != (step, self.rank):
            return {}, {}, f"the copy says step {payload.get('step')} of rank {payload.get('rank')}"
        _, current = split_state({k: v for k, v in into.items() if k in payload["skeletons"]})
        problem = plan_.layout_problem(payload["layout"], describe(current))
        if problem is not None:
            return {}, {}, problem
        tensors = {n: _rebuild(t, current.get(n)) for n, t in payload["tensors"].items()}
        state = {k: sharding.fill(v, tensors) for k, v in payload["skeletons"].items()}
        return state, payload["per_rank"], None

    def rebuild(self, store: Any) -> str | None:
        """Collective, after a MIRROR plan: the survivors' copies of the plan's step written
        to ``store`` as a sharded snapshot at the old world size (the normal resharding load
        then restores it). None once committed, else why not (the same on every rank)."""
        if self.rebuild_plan is None:
            return "no rebuild was planned"
        return mirror.rebuild(
            self.rebuild_plan, self.directory, store, rank=self.rank, world_size=self.world_size
        )

    def after_restore(self, step: int | None) -> None:
        """Collective-free (every rank has read what it needed once restore_state returns):
        drop copies other than the restored step's (a newer copy belongs to an abandoned
        future); the node's lowest rank removes folders of ranks the node no longer runs or
        mirrors (memory stays bounded across world changes)."""
        self.slots.keep_only(step)
        mine = self.node_keys[self.rank]
        node = [r for r, key in enumerate(self.node_keys) if key == mine]
        if node[0] == self.rank:
            sources = [r for r, target in enumerate(self.targets) if target in node]
            mirror.prune(self.directory, node, sources)

    def _all_gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out


def _shards_key(state: Mapping[str, Any] | None) -> str | None:
    """A digest of where this rank's shards lie (global shape, placements, offsets of each
    sharded parameter): ranks with the same one hold the same shards, replicas under HSDP.
    None without a state (each rank then counts as holding its own)."""
    if state is None:
        return None
    params = {
        f"{key}.{name}": p
        for key, value in state.items()
        if is_sharded_module(value)
        for name, p in value.named_parameters()
    }
    text = json.dumps(describe(params), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _rebuild(saved: torch.Tensor, template: torch.Tensor | None) -> torch.Tensor:
    """A tensor of its own (the copy's bytes are a buffer read once), as a DTensor on the
    template's mesh and placements where the template is one."""
    if not isinstance(template, DTensor):
        device = template.device if template is not None else saved.device
        return saved.to(device=device, copy=True)
    local = saved.to(device=template.to_local().device, copy=True)
    return DTensor.from_local(
        local,
        template.device_mesh,
        template.placements,
        shape=template.shape,
        stride=template.stride(),
    )


def _one_line(exc: Exception) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]

"""Pure decisions of the in-memory tier for sharded (FSDP2) state (``worker.memory.shards``).

Under FSDP2 every rank's local shards are its own: no other rank of the node holds them, so
each rank keeps its own copies (its shards, the replicated values, its RNG) in its node's
memory folder. A rank's folder holds two slots and a marker listing the committed copies
(at most two, newest first). Keeping the previous copy committed while the next one is
written matters here: the ranks write in the background, each at its own pace, so a crash
usually finds one rank with step ``s`` committed and another still writing it; both still
hold ``s - 1``, and the group restores the newest step every rank holds.

A restore in place needs the same world size (the same shards per rank). Otherwise (a node
lost or joined), or when a newer step survives elsewhere, the survivors' copies are rebuilt
into a storage snapshot (``plan_rebuild``): a rank's copy counts wherever it is, its own
folder or its mirror on the next node, and under HSDP (a replicate dimension in the mesh)
the copy of any rank holding the same shards stands in for it (``RankCopy.replicas``); that
is what makes the copy made just in time when the group ends (``on_failure``) useful for
sharded state, since the lost ranks' replicas make it too.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elastic_trainer.worker.memory.plan import SLOTS, RestorePlan, Source

MARKER = "committed.json"  # {"copies": [RankCopy as JSON, newest first]}: replaced atomically
KEPT = 2  # copies a rank keeps committed: never more than its two slots


@dataclass(frozen=True, kw_only=True)
class RankCopy:
    """One committed copy of a rank: which slot holds it, how long it is, its checksum."""

    step: int
    slot: str
    nbytes: int
    digest: str
    world_size: int
    # the ranks (of that world) whose shards are the same as this rank's, itself included
    # (HSDP replicas); empty: not known (a mirror's copy), only the rank's own
    replicas: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "slot": self.slot,
            "bytes": self.nbytes,
            "digest": self.digest,
            "world_size": self.world_size,
            "replicas": list(self.replicas),
        }


def copies_of(marker: Any) -> list[RankCopy]:
    """The committed copies a marker lists, newest first; anything malformed is ignored (a
    copy that cannot be described exactly is not used)."""
    raw = marker.get("copies") if isinstance(marker, Mapping) else None
    out: list[RankCopy] = []
    for entry in raw if isinstance(raw, list) else []:
        copy = _copy(entry)
        if copy is not None and copy.slot not in {c.slot for c in out}:
            out.append(copy)
    return sorted(out, key=lambda c: -c.step)[:KEPT]


def _copy(entry: Any) -> RankCopy | None:
    if not isinstance(entry, Mapping):
        return None
    step, slot, size = entry.get("step"), entry.get("slot"), entry.get("bytes")
    digest, world = entry.get("digest"), entry.get("world_size")
    replicas = entry.get("replicas", [])
    ints = all(_int(v) for v in (step, size, world))
    if not (ints and slot in SLOTS and isinstance(digest, str)):
        return None
    if not (isinstance(replicas, list) and all(_int(r) and 0 <= r < world for r in replicas)):
        return None
    return RankCopy(
        step=step,
        slot=slot,
        nbytes=size,
        digest=digest,
        world_size=world,
        replicas=tuple(sorted(set(replicas))),
    )


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def marker_json(copies: Sequence[RankCopy]) -> str:
    return json.dumps({"copies": [c.to_json() for c in copies]})


def slot_to_write(copies: Sequence[RankCopy]) -> tuple[str, list[RankCopy]]:
    """(the slot the next copy overwrites, the copies still committed while it is written):
    never the newest copy's slot; the older copy in that slot is uncommitted first, so a
    crash halfway leaves only whole copies listed."""
    newest = copies[0] if copies else None
    slot = SLOTS[1] if newest is not None and newest.slot == SLOTS[0] else SLOTS[0]
    return slot, [c for c in copies if c.slot != slot]


def after_write(kept: Sequence[RankCopy], new: RankCopy) -> list[RankCopy]:
    """The marker's copies once ``new`` is written (newest first, at most ``KEPT``)."""
    return [new, *[c for c in kept if c.step != new.step]][:KEPT]


@dataclass(frozen=True, kw_only=True)
class RankFacts:
    """What one rank of the (re)started group holds: (step, saved world size) per copy."""

    copies: tuple[tuple[int, int], ...]


def plan_restore(
    facts: Sequence[RankFacts], world_size: int, storage_newest: int | None
) -> RestorePlan:
    """The newest step every rank holds a copy of, saved at this world size, unless storage
    has a newer snapshot; else storage, with the reason."""
    common = _common(facts, world_size)
    if not common:
        return _storage(_why_none(facts, world_size))
    newest = max(common)
    if storage_newest is not None and storage_newest > newest:
        return _storage(
            f"the storage snapshot of step {storage_newest} is newer than the newest "
            f"in-memory copy every rank holds (step {newest})"
        )
    return RestorePlan(source=Source.MEMORY, step=newest)


def _why_none(facts: Sequence[RankFacts], world_size: int) -> str:
    if not any(f.copies for f in facts):
        return "no rank holds an in-memory copy of its shards (none made yet, or lost)"
    worlds = sorted({w for f in facts for _, w in f.copies if w != world_size})
    if worlds:
        return (
            f"the world size changed ({'/'.join(map(str, worlds))} -> {world_size}): the "
            "in-memory copies of sharded state serve the same world size only (restoring a "
            "lost node's shards from a mirror is not implemented)"
        )
    missing = [r for r, f in enumerate(facts) if not f.copies]
    if missing:
        return f"rank(s) {_ranks(missing)} hold no in-memory copy of their shards"
    held = "; ".join(f"rank {r}: {[s for s, _ in f.copies]}" for r, f in enumerate(facts))
    return f"no step is held in memory by every rank ({held})"[:500]


def _common(facts: Sequence[RankFacts], world_size: int) -> set[int]:
    sets = [{s for s, w in f.copies if w == world_size} for f in facts]
    return set.intersection(*sets) if sets else set()


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _storage(reason: str) -> RestorePlan:
    return RestorePlan(source=Source.STORAGE, step=None, reason=reason)


def layout_problem(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """Why a rank's saved shards do not fit its current DTensors (None: they do). Both map
    each DTensor's fqn to its description (``shards.describe``)."""
    if set(saved) != set(current):
        extra = sorted(set(saved) ^ set(current))[:3]
        return f"the sharded tensors differ from the saved ones (e.g. {', '.join(extra)})"
    for fqn, was in saved.items():
        now = current[fqn]
        if was != now:
            return f"tensor {fqn[:120]} was saved as {was} but is now {now}"[:400]
    return None


# --- mirrors: each rank's copy also lives on another node -------------------------------------
def mirror_targets(
    node_keys: Sequence[str], replicas: Sequence[Sequence[int]] | None = None
) -> list[int | None]:
    """Per rank: the rank (of another node) that keeps a mirror of its copies. Nodes in order
    of their lowest rank form a ring; a rank's mirror is the rank with the same local index
    on the next node (modulo that node's size). None when there is one node, and for a rank
    whose shards another node holds already (``replicas[rank]``: HSDP across nodes)."""
    if replicas is not None:
        out = mirror_targets(node_keys)
        for rank, group in enumerate(replicas):
            if any(node_keys[r] != node_keys[rank] for r in group):
                out[rank] = None
        return out
    nodes: dict[str, list[int]] = {}
    for rank, key in enumerate(node_keys):
        nodes.setdefault(key, []).append(rank)
    ring = list(nodes.values())
    if len(ring) < 2:
        return [None] * len(node_keys)
    out: list[int | None] = [None] * len(node_keys)
    for n, ranks in enumerate(ring):
        following = ring[(n + 1) % len(ring)]
        for index, rank in enumerate(ranks):
            out[rank] = following[index % len(following)]
    return out


@dataclass(frozen=True, kw_only=True)
class RebuildPlan:
    """The shards of ``step``'s world (``saved_world_size``) from the survivors' copies: per
    old rank, which rank of the new world reads (``holders``) which old rank's copy
    (``sources``: its own, or under HSDP a replica's), and whether its shards are written
    (``writes``: replicas' shards are the same bytes, written once, by the lowest of them)."""

    step: int | None
    saved_world_size: int | None = None
    holders: tuple[int, ...] = ()
    sources: tuple[int, ...] = ()
    writes: tuple[bool, ...] = ()
    reason: str | None = None


# What a node holds, per copy: (old rank, step, saved world size[, replicas]) (``held_on_node``)
Held = Sequence[Sequence[tuple[Any, ...]]]


def plan_rebuild(held: Held, storage_newest: int | None) -> RebuildPlan:
    """``held[r]``: the copies rank r's node holds. The newest step whose copies of every old
    rank (or of a replica of it) survive somewhere, newer than storage's; each old rank's
    copy is read by the lowest rank holding it, its own copy before a replica's."""
    by_old: dict[tuple[int, int], dict[int, int]] = {}
    groups: dict[tuple[int, int], dict[int, tuple[int, ...]]] = {}
    for rank, copies in enumerate(held):
        for old, step, world, *rest in copies:
            by_old.setdefault((step, world), {}).setdefault(old, rank)
            for member in rest[0] if rest else ():
                groups.setdefault((step, world), {}).setdefault(member, tuple(rest[0]))
    readers = {k: _readers(k[1], by_old[k], groups.get(k, {})) for k in by_old}
    complete = [k for k, (found, _) in readers.items() if found is not None]
    if not complete:
        return RebuildPlan(step=None, reason=_why_not_rebuilt(readers))
    step, world = max(complete)
    if storage_newest is not None and storage_newest >= step:
        return RebuildPlan(
            step=None,
            reason=f"the storage snapshot of step {storage_newest} is as new as the newest "
            f"step the survivors' in-memory copies make whole (step {step})",
        )
    found, _ = readers[(step, world)]
    return dataclasses.replace(found, step=step, saved_world_size=world)  # type: ignore[arg-type]


def _readers(
    world: int, by_old: Mapping[int, int], groups: Mapping[int, tuple[int, ...]]
) -> tuple[RebuildPlan | None, list[int]]:
    """(who reads what for one step: a plan without its step, or None; the old ranks whose
    copies, and their replicas', are all lost)."""
    holders, sources, writes, lost = [], [], [], []
    for old in range(world):
        group = groups.get(old, (old,))
        source = old if old in by_old else next((r for r in group if r in by_old), None)
        if source is None:
            lost.append(old)
            continue
        holders.append(by_old[source])
        sources.append(source)
        writes.append(old == min(group))
    if lost:
        return None, lost
    plan = RebuildPlan(
        step=None, holders=tuple(holders), sources=tuple(sources), writes=tuple(writes)
    )
    return plan, []


def _why_not_rebuilt(readers: Mapping[tuple[int, int], tuple[Any, list[int]]]) -> str:
    if not readers:
        return "no rank holds an in-memory copy of its shards (none made yet, or lost)"
    step, world = max(readers)
    lost = readers[(step, world)][1]
    return (
        f"the in-memory copies of step {step} (world size {world}) of rank(s) {_ranks(lost)} "
        "were lost with their nodes, mirrors and replicas included"
    )


def plan_sharded(
    own: Sequence[RankFacts],
    node_held: Held,
    world_size: int,
    storage_newest: int | None,
    *,
    storage: bool = True,
) -> tuple[RestorePlan, RebuildPlan | None]:
    """Every rank's own copies at this world size (a worker crash: restored in place), unless
    the survivors' copies, mirrors and replicas make a newer step whole, or the world
    changed: then those are rebuilt into a storage snapshot (``Source.MIRROR``); else
    storage, with the reason. Without ``storage`` to rebuild into, the own copies only."""
    plan = plan_restore(own, world_size, storage_newest)
    rebuild = plan_rebuild(node_held, storage_newest)
    newer = rebuild.step is not None and (plan.step is None or rebuild.step > plan.step)
    if newer and storage:
        return RestorePlan(source=Source.MIRROR, step=rebuild.step), rebuild
    if plan.source is Source.MEMORY:
        return plan, None
    changed = any(not f.copies for f in own) or any(
        w != world_size for f in own for _, w in f.copies
    )
    if not changed or rebuild.reason is None:
        return plan, None
    return RestorePlan(source=Source.STORAGE, step=None, reason=rebuild.reason), None

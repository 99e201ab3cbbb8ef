"""Pure decisions of the in-memory snapshot tier (``worker.memory.tier``): which rank of a
node copies which part of its copy, when a copy is whole, and where a (re)started group
restores from.

Replicated (DDP) state is the same on every rank, so one copy per node holds everything (the
state plus every rank's RNG): node B's copy *is* the mirror of node A's. A node that lost
its copy (its agent was replaced, its tmpfs cleared) receives the newest copy from a rank
of a node that still holds it, over the training group; when no node holds one newer than
the storage's newest snapshot, the storage snapshot is restored, and the event says why.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SLOTS = ("slot-0.pt", "slot-1.pt")  # a node's two copies: the newest whole one, the next one
# The commit of one part of a copy: {"step", "slot", "bytes", "part", "parts", "start", "stop",
# and the checksum of bytes [start, stop)}, renamed into place once those bytes are copied.
PART_MARKER = "{slot}.part-{part}.json"


class Source(str, enum.Enum):  # snapshot.restored.source
    MEMORY = "memory"  # this node's own in-memory copy
    MIRROR = "mirror"  # another node's in-memory copy, received over the training group
    STORAGE = "storage"  # the storage snapshot (snapshot_dir)


def part_marker(slot: str, part: int) -> str:
    return PART_MARKER.format(slot=slot, part=part)


def parse_part_marker(name: str) -> tuple[str, int] | None:
    """(slot, part) of a part marker's file name; None for any other name."""
    slot, sep, rest = name.partition(".part-")
    index = rest.removesuffix(".json")
    if not (sep and slot in SLOTS and rest.endswith(".json") and index.isdigit()):
        return None
    return slot, int(index)


@dataclass(frozen=True, kw_only=True)
class Copy:
    """A whole copy in a slot: every part's marker names its step (and the same layout)."""

    step: int
    slot: str
    size: int
    parts: tuple[Mapping[str, Any], ...]  # the part markers, in order: their ranges tile it


def whole_copy(slot: str, markers: Mapping[int, Any]) -> Copy | None:
    """The copy in ``slot`` when its parts 0..P-1 (P named by every part) all name the same
    step and size and their byte ranges tile [0, size); else None: a part is missing, torn
    (its marker is removed before its bytes are overwritten) or of another step."""
    first = markers.get(0)
    if not isinstance(first, Mapping):
        return None
    step, size, parts = first.get("step"), first.get("bytes"), first.get("parts")
    if not (_count(step) and _count(size) and _count(parts) and parts >= 1):
        return None
    end, found = 0, []
    for part in range(parts):
        m = markers.get(part)
        same = isinstance(m, Mapping) and (m.get("step"), m.get("bytes")) == (step, size)
        if not (same and (m.get("slot"), m.get("part"), m.get("parts")) == (slot, part, parts)):
            return None
        if not (m.get("start") == end and _count(m.get("stop")) and m["stop"] >= end):
            return None
        end = m["stop"]
        found.append(m)
    return Copy(step=step, slot=slot, size=size, parts=tuple(found)) if end == size else None


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def stale_file(name: str, keep: Copy | None) -> bool:
    """Whether the file ``name`` of a node's folder goes when only ``keep`` is kept: the other
    slot's part markers, leftover temporary markers, parts beyond ``keep``'s. The slot files
    stay: without its markers a slot is no copy, and the next copy writes into the pages it
    already has (a fresh file's pages cost ~2x the copy itself: bench/memory_copy_cost.py)."""
    if name in SLOTS:
        return False
    marker, temporary, _ = name.partition(".json.")  # a marker's temporary file
    parsed = parse_part_marker(marker + ".json" if temporary else name)
    if parsed is None:
        return False  # not ours (the ranks' streams folder)
    slot, part = parsed
    if keep is None or slot != keep.slot or not name.endswith(".json"):
        return True
    return part >= len(keep.parts)


def newest_copy(copies: Sequence[Copy | None]) -> Copy | None:
    whole = [c for c in copies if c is not None]
    return max(whole, key=lambda c: c.step) if whole else None


def next_slot(newest: Copy | None) -> str:
    """The slot the next copy overwrites: never the one holding the newest whole copy (a crash
    while writing leaves that copy whole). Every rank of a node reads the same answer before
    it writes its part: the slot being written cannot become whole before all have."""
    return SLOTS[0] if newest is None or newest.slot == SLOTS[1] else SLOTS[1]


def part_bounds(
    offsets: Sequence[int], split_from: int, end: int, size: int, parts: int
) -> list[int]:
    """Where each of ``parts`` parts of a copy starts (and the last ends). Part 0 holds the
    bytes before ``split_from`` (tensors that may differ between ranks, such as DDP's buffers:
    the node's first rank copies them all); the others start at the tensor starts at or after
    it (``offsets``; ``end``: where the skeleton starts) nearest to equal shares of ``size``
    bytes, so that each of the node's ranks copies about 1/parts of them."""
    candidates = [o for o in offsets if o >= split_from] + [end]
    bounds = [0]
    for i in range(1, parts):
        target = i * size / parts
        nearest = min(candidates, key=lambda c: abs(c - target))
        bounds.append(max(bounds[-1], nearest))
    return [*bounds, size]


def shares(node_keys: Sequence[str]) -> list[tuple[int, int]]:
    """Per rank: (its part, the node's number of parts): the ranks of one node (one node key)
    split its copy among them, in rank order."""
    count = {key: node_keys.count(key) for key in node_keys}
    seen: dict[str, int] = {}
    out = []
    for key in node_keys:
        out.append((seen.get(key, 0), count[key]))
        seen[key] = seen.get(key, 0) + 1
    return out


@dataclass(frozen=True, kw_only=True)
class RestorePlan:
    source: Source
    step: int | None  # None: storage's newest loadable snapshot (or a fresh start)
    src_rank: int | None = None  # the rank whose node copy the others receive (MIRROR)
    reason: str | None = None  # why storage, when an in-memory copy was looked for

    def source_of(self, rank: int, held: Sequence[int | None]) -> Source:
        """What ``rank`` restores from: its own node's copy or another node's."""
        if self.source is Source.STORAGE:
            return Source.STORAGE
        return Source.MEMORY if held[rank] == self.step else Source.MIRROR


def plan_restore(held: Sequence[int | None], storage_newest: int | None) -> RestorePlan:
    """``held[r]``: the newest committed copy of rank r's node (None: none). The newest step
    any node holds wins unless storage has a newer snapshot; ranks whose node lacks it get
    the lowest holding rank's copy."""
    steps = [s for s in held if s is not None]
    if not steps:
        return RestorePlan(
            source=Source.STORAGE,
            step=None,
            reason="no node holds an in-memory copy (lost with their nodes, or none made yet)",
        )
    newest = max(steps)
    if storage_newest is not None and storage_newest > newest:
        return RestorePlan(
            source=Source.STORAGE,
            step=None,
            reason=f"the storage snapshot of step {storage_newest} is newer than the newest "
            f"in-memory copy (step {newest})",
        )
    if all(s == newest for s in held):
        return RestorePlan(source=Source.MEMORY, step=newest)
    return RestorePlan(source=Source.MIRROR, step=newest, src_rank=held.index(newest))

"""Pure decisions of the in-memory snapshot tier (``runtime.memory_tier``): which rank of a
node writes its copy, and where a (re)started group restores from.

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

SLOTS = ("slot-0.pt", "slot-1.pt")  # a node's two copies: the committed one, the next one
MARKER = "committed.json"  # {"step", "slot", "bytes"}: renamed into place = the commit


class Source(str, enum.Enum):  # snapshot.restored.source
    MEMORY = "memory"  # this node's own in-memory copy
    MIRROR = "mirror"  # another node's in-memory copy, received over the training group
    STORAGE = "storage"  # the storage snapshot (snapshot_dir)


SOURCES = tuple(s.value for s in Source)


def committed_copy(marker: Mapping[str, Any] | None) -> tuple[int, str, int] | None:
    """(step, slot file, bytes) of a node's commit marker; None without a valid one."""
    if not isinstance(marker, Mapping):
        return None
    step, slot, size = marker.get("step"), marker.get("slot"), marker.get("bytes")
    if not (isinstance(step, int) and slot in SLOTS and isinstance(size, int)):
        return None
    return step, slot, size


def next_slot(marker: Mapping[str, Any] | None) -> str:
    """The slot the next copy overwrites: never the committed one (a crash while writing
    leaves the committed copy whole, and the marker still names it)."""
    committed = committed_copy(marker)
    return SLOTS[0] if committed is None or committed[1] == SLOTS[1] else SLOTS[1]


def writers(node_keys: Sequence[str]) -> list[bool]:
    """Per rank: does it write its node's copy? The lowest rank of each node key does (one
    copy per node; the key is the node's memory folder, so it holds for any rank layout)."""
    seen: set[str] = set()
    out = []
    for key in node_keys:
        out.append(key not in seen)
        seen.add(key)
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

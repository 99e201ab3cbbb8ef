"""Mirrors of sharded in-memory copies on another node, and a lost node's shards rebuilt from
them (``worker.memory.shards``).

After each rank writes its copy, its writer thread sends the copy's bytes (and checksum) to
its mirror rank on the next node (``shard_plan.mirror_targets``) over a gloo group of
its own, made once; the mirror rank's receiver thread writes them into its node's folder
(``shards/mirror-<rank>``: two slots and a marker, as the rank's own copies). Training never
waits for it: a copy whose write and send are still running makes the next one be skipped.
A copy is committed on the mirror only once received whole, so a sender killed halfway
leaves the previous mirror in place.

When the world changed (a node lost), the survivors hold every old rank's copy of some step
(their own and their mirrors): ``rebuild`` writes them as an ordinary sharded storage
snapshot of that step at the old world size (every survivor writes the old ranks it holds as
its shard file; one commit by rank 0 after all report), which the normal resharding load
then restores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import os
import re
import shutil
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from elastic_trainer.contract.events import emit
from elastic_trainer.worker.memory import shard_plan as plan_
from elastic_trainer.worker.memory.rank_slots import RankSlots
from elastic_trainer.worker.memory.slots import FailureStreak
from snapshots import SnapshotError
from snapshots.format import layout
from snapshots.sharded.shards import Piece, StagedShard
from snapshots.storage import faults
from snapshots.write.sharded_commit import ShardPart

_FOLDER = re.compile(r"^(rank|mirror)-(\d{5})$")
_CLOSING = -1  # a header's step: the sender is closing, the receiver thread ends
# Seconds the group's collectives and transfers may wait for a rank before failing (a dead
# peer is usually noticed at once: gloo sees its connection close).
TIMEOUT_S = 300.0


def own_folder(directory: str, rank: int) -> str:
    return os.path.join(directory, "shards", f"rank-{rank:05d}")


def mirror_folder(directory: str, rank: int) -> str:
    return os.path.join(directory, "shards", f"mirror-{rank:05d}")


def held_on_node(directory: str) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """(old rank, step, saved world size, its replicas) of every copy in the node's folder,
    own or mirror (``shard_plan.RankCopy``)."""
    out = set()
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(os.path.join(directory, "shards")):
            match = _FOLDER.match(name)
            if match is not None:
                slots = RankSlots(os.path.join(directory, "shards", name))
                old = int(match[2])
                out.update((old, c.step, c.world_size, c.replicas) for c in slots.copies())
    return sorted(out)


def prune(directory: str, node_ranks: Sequence[int], sources: Sequence[int]) -> None:
    """Remove the folders of ranks this node no longer runs or mirrors (left by a world of
    another size): only the node's own ranks' and its mirrored ranks' copies are kept."""
    keep = {os.path.basename(own_folder(directory, r)) for r in node_ranks}
    keep |= {os.path.basename(mirror_folder(directory, r)) for r in sources}
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(os.path.join(directory, "shards")):
            if _FOLDER.match(name) is not None and name not in keep:
                shutil.rmtree(os.path.join(directory, "shards", name), ignore_errors=True)


def read_any(directory: str, old_rank: int, step: int) -> dict[str, Any]:
    """``old_rank``'s copy of ``step`` from this node: its own folder, else its mirror."""
    for folder in (own_folder(directory, old_rank), mirror_folder(directory, old_rank)):
        slots = RankSlots(folder)
        if any(c.step == step for c in slots.copies()):
            payload = slots.read(step)
            if (payload.get("step"), payload.get("rank")) != (step, old_rank):
                raise ValueError(f"{folder} holds a copy that says step {payload.get('step')}")
            return payload
    raise FileNotFoundError(f"no copy of rank {old_rank} at step {step} on this node")


class MirrorLink:
    """This rank's sends to its mirror rank and receptions from the ranks it mirrors.
    Collective to create (a new group); the transfers run on the writer and receiver threads."""

    def __init__(self, directory: str, targets: Sequence[int | None], rank: int) -> None:
        self.directory, self.rank = directory, rank
        self.target = targets[rank]
        self.group = None
        self._broken = False
        self._receivers: list[threading.Thread] = []
        if any(t is not None for t in targets):  # every rank creates it, or none does
            self.group = dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=TIMEOUT_S))
        for source in (r for r, t in enumerate(targets) if t == rank):
            thread = threading.Thread(
                target=self._receive, args=(source,), name=f"mirror-from-{source}", daemon=True
            )
            thread.start()
            self._receivers.append(thread)

    def send(self, slots: RankSlots, copy: plan_.RankCopy) -> None:
        """On the writer thread, right after ``copy`` was committed. A failure (the mirror
        rank gone) ends this link's sends: storage stays the fallback."""
        if self.target is None or self._broken:
            return
        try:
            digest = torch.tensor(list(copy.digest.encode("ascii")), dtype=torch.uint8)
            header = [copy.step, copy.world_size, len(digest), copy.nbytes]
            dist.send(torch.tensor(header, dtype=torch.int64), self.target, group=self.group)
            dist.send(digest, self.target, group=self.group)
            faults.hit("mid_mirror_send", step=copy.step)
            # From the slot's mapping, not a copy of it: the next copy, which would overwrite
            # this slot, is skipped while this send runs (ShardedMemoryTier.save).
            dist.send(slots.committed(copy), self.target, group=self.group)
        except Exception as exc:  # the link is given up, never retried against a dead peer
            self._broken = True
            emit(
                "snapshot.memory_failed",
                level="warning",
                step=copy.step,
                dir=self.directory,
                error=f"mirror to rank {self.target}: {type(exc).__name__}: {exc}"[:500],
            )

    def _receive(self, source: int) -> None:
        """Until the sender closes or dies. A copy that cannot be written (tmpfs full) is
        received and dropped, and the loop goes on: a sender must never be left waiting for
        a receiver."""
        slots = RankSlots(mirror_folder(self.directory, source))
        failures = FailureStreak(slots.directory)
        while True:
            try:
                step, world, digest, nbytes = self._take_header(source)
            except Exception:  # the sender died, or the group is gone: this mirror ends
                return
            if step == _CLOSING:
                return
            stage: list[str] = []  # "recv" once the body is being received, "done" after
            fill = functools.partial(self._recv_into, source, stage)
            try:
                slots.receive(step, world, nbytes, digest, fill)
                failures.succeeded()
            except Exception as exc:  # reported once per streak, as the rank's own copies
                if stage == ["recv"] or (not stage and not self._drain(source, nbytes)):
                    return  # the sender died mid-transfer (its slot stays uncommitted)
                failures.failed(step, exc, what=f"mirror of rank {source}: ")

    def _take_header(self, source: int) -> tuple[int, int, str, int]:
        """(step, saved world size, checksum, bytes to come); step ``_CLOSING`` ends."""
        header = torch.zeros(4, dtype=torch.int64)
        dist.recv(header, source, group=self.group)
        step, world, digest_len, nbytes = (int(v) for v in header.tolist())
        if step == _CLOSING:
            return step, 0, "", 0
        digest = torch.empty(digest_len, dtype=torch.uint8)
        dist.recv(digest, source, group=self.group)
        return step, world, bytes(digest.tolist()).decode("ascii", "replace"), nbytes

    def _recv_into(self, source: int, stage: list[str], into: torch.Tensor) -> None:
        stage.append("recv")
        dist.recv(into, source, group=self.group)  # straight into the slot's mapping
        stage.append("done")

    def _drain(self, source: int, nbytes: int) -> bool:
        """Receive a body that has nowhere to go; False when the sender is gone."""
        try:
            dist.recv(torch.empty(nbytes, dtype=torch.uint8), source, group=self.group)
        except Exception:
            return False
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Every rank at once (the session's close): tell the mirror rank, then wait for the
        ranks this one mirrors to say the same, so no transfer outlives the group."""
        if self.target is not None and not self._broken:
            closing = torch.tensor([_CLOSING, 0, 0, 0], dtype=torch.int64)
            with contextlib.suppress(Exception):
                dist.send(closing, self.target, group=self.group)
        for thread in self._receivers:
            thread.join(timeout_s)


# --- a lost node's shards, rebuilt into a storage snapshot ------------------------------------
def rebuild(
    rebuild_plan: plan_.RebuildPlan, directory: str, store: Any, *, rank: int, world_size: int
) -> str | None:
    """Collective: write the copies of ``rebuild_plan.step`` as a sharded storage snapshot at
    the old world size; None once committed, else the reason (the same on every rank)."""
    step, sources = rebuild_plan.step, rebuild_plan.sources
    mine = [old for old, holder in enumerate(rebuild_plan.holders) if holder == rank]
    staged, per_rank, skeletons, problem = None, {}, None, None
    try:
        wanted = {sources[old] for old in mine}  # a replica's copy may stand in for several
        read = {s: read_any(directory, s, step) for s in wanted}  # type: ignore[arg-type]
        payloads = {old: read[sources[old]] for old in mine}
        staged = stage({old: payloads[old] for old in mine if rebuild_plan.writes[old]})
        per_rank = {old: p["per_rank"] for old, p in payloads.items()}
        skeletons = payloads[0]["skeletons"] if 0 in payloads else None
    except Exception as exc:  # never raise before the agreement: the peers wait in it
        problem = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    token = layout.new_token() if rank == 0 else None
    answers: list[Any] = [None] * world_size
    dist.all_gather_object(answers, (problem, per_rank, skeletons, token))
    problems = [f"rank {r}: {a[0]}" for r, a in enumerate(answers) if a[0] is not None]
    if problems:
        return f"the in-memory copies of step {step} did not load ({'; '.join(problems)})"[:500]
    ranks = {old: state for a in answers for old, state in a[1].items()}
    skeleton = next(a[2] for a in answers if a[2] is not None)
    group = dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=TIMEOUT_S))
    try:
        store.save(
            step, skeleton, epoch=_epoch(skeleton), world_size=rebuild_plan.saved_world_size,
            per_rank=[ranks[old] for old in range(len(ranks))] if rank == 0 else None,
            shards=lambda: ShardPart(
                rank=rank, world_size=world_size, staged=staged, group=group  # type: ignore[arg-type]
            ),
            token=answers[0][3], blocking=True,
        )  # fmt: skip
    except SnapshotError as exc:  # the commit's outcome is the same on every rank
        return f"the in-memory copies of step {step} could not be written to storage: {exc}"[:500]
    return None


def _epoch(skeleton: Mapping[str, Any]) -> int:
    session = skeleton.get("elastic_session")  # worker.session.SESSION_KEY
    epoch = session.get("epoch") if isinstance(session, Mapping) else None
    return epoch if isinstance(epoch, int) else 0


def stage(payloads: Mapping[int, Mapping[str, Any]]) -> StagedShard:
    """One shard file of the old ranks' copies this rank writes: each old rank's local
    shards at their global offsets (a replica's copy stands in for a lost rank: the same
    shards at the same offsets); the replicated tensors once, from old rank 0's copy."""
    found: list[tuple[Piece, torch.Tensor]] = []
    for old, payload in sorted(payloads.items()):
        described = payload["layout"]
        for fqn, tensor in payload["tensors"].items():
            if fqn in described:
                found.append((_piece(fqn, described[fqn], tensor), tensor))
            elif old == 0:
                found.append((_piece(fqn, None, tensor), tensor))
    data = memoryview(bytearray(sum(p.nbytes for p, _ in found)))
    pieces, offset = [], 0
    for piece, tensor in found:  # one copy of each tensor's bytes, straight into the file's
        data[offset : offset + piece.nbytes] = (
            tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        )
        pieces.append(dataclasses.replace(piece, byte_offset=offset))
        offset += piece.nbytes
    return StagedShard(pieces=pieces, data=data)


def _piece(fqn: str, described: Mapping[str, Any] | None, tensor: torch.Tensor) -> Piece:
    shape = tuple(described["shape"]) if described else tuple(tensor.shape)
    offsets = tuple(described["offsets"]) if described else (0,) * tensor.dim()
    placements = (
        f"{described['placements']} on mesh {tuple(described['mesh'])}" if described else None
    )
    return Piece(
        fqn=fqn, dtype=str(tensor.dtype), shape=shape, offsets=offsets,
        sizes=tuple(tensor.shape), byte_offset=0,
        nbytes=tensor.numel() * tensor.element_size(), placements=placements,
    )  # fmt: skip

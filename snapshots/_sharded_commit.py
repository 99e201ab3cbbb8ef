"""One sharded save on the writer thread of every rank: own shard file, report, one commit.

Every rank writes its shard file, then all ranks meet in a gather to rank 0 over the
snapshot's own gloo group (never the training group: collectives from a background thread
on the training group crash gloo; one writer thread per rank runs saves in order, so the
snapshot group's collectives match). Rank 0 writes the skeleton and per-rank files, the
shard table and, last, the manifest, then broadcasts the outcome. A rank that failed reports
its error instead of a file (it never skips the gather), so rank 0 commits only when every
rank's file is there; a rank that died makes the gather fail (gloo notices the closed
connection, or its timeout passes): no manifest either way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from snapshots import _faults, _shards, layout, sharding
from snapshots.errors import SnapshotSaveError
from snapshots.info import SnapshotInfo
from snapshots.manifest import SHARDED_VERSION, FileEntry, checksum

if TYPE_CHECKING:
    from snapshots._commit import Committer, SaveJob


@dataclass(frozen=True, kw_only=True)
class ShardPart:
    """This rank's part of a sharded save."""

    rank: int
    world_size: int
    chunks: list[_shards.StagedChunk]
    group: Any = None  # the snapshot gloo group; None in a single process


@dataclass(frozen=True, kw_only=True)
class _Report:
    rank: int
    entry: FileEntry | None = None
    records: dict[str, sharding.TensorRecord] | None = None
    error: str | None = None


def commit(committer: Committer, job: SaveJob, part: ShardPart) -> SnapshotInfo:
    report = _write_own(committer, job, part)
    reports = _gather(part, report)
    outcome: dict[str, Any] | str | None = None
    if part.rank == 0:
        outcome = _commit_all(committer, job, part, reports or [report])
    outcome = _broadcast(part, outcome)
    if isinstance(outcome, str):
        raise SnapshotSaveError(outcome, step=job.step)
    return SnapshotInfo(**outcome)


def _write_own(committer: Committer, job: SaveJob, part: ShardPart) -> _Report:
    """Never raises: a failure is this rank's report (the gather must not miss a rank)."""
    try:
        if job.cancelled.is_set():
            raise SnapshotSaveError(f"the save of step {job.step} was cancelled (deadline)")
        if not part.chunks:
            return _Report(rank=part.rank, records={})
        name = sharding.shard_file_name(part.rank, job.token)
        data, entry, records = _shards.encode(part.chunks, name, shard=part.rank)
        _faults.hit("before_data")
        committer.storage.write(f"{layout.step_dir(job.step)}/{name}", data)
        return _Report(rank=part.rank, entry=entry, records=records)
    except Exception as exc:  # every failure is reported to rank 0, whatever its type
        return _Report(rank=part.rank, error=f"{type(exc).__name__}: {exc}"[:500])


def _gather(part: ShardPart, report: _Report) -> list[_Report] | None:
    if part.group is None:
        return [report]
    out: list[Any] | None = [None] * part.world_size if part.rank == 0 else None
    dist.gather_object(report, out, dst=_global(part, 0), group=part.group)
    return out


def _broadcast(part: ShardPart, outcome: dict[str, Any] | str | None) -> dict[str, Any] | str:
    box = [outcome]
    if part.group is not None:
        dist.broadcast_object_list(box, src=_global(part, 0), group=part.group)
    return box[0]  # type: ignore[return-value]


def _global(part: ShardPart, group_rank: int) -> int:
    return dist.get_global_rank(part.group, group_rank)


def _commit_all(
    committer: Committer, job: SaveJob, part: ShardPart, reports: list[_Report]
) -> dict[str, Any] | str:
    """Rank 0: the commit, or the reason there is none (a string, for every rank)."""
    failed = [f"rank {r.rank}: {r.error}" for r in reports if r.error is not None]
    if failed:
        return f"step {job.step} not committed: {'; '.join(failed)}"[:1000]
    try:
        shard_files = [r.entry for r in reports if r.entry is not None]
        table = _shards.merge(part.world_size, [r.records or {} for r in reports])
        body = sharding.to_json(table)
        name = sharding.table_file_name(job.token)
        committer.storage.write(f"{layout.step_dir(job.step)}/{name}", body)
        table_entry = FileEntry(name=name, size=len(body), checksum=checksum(body), table=True)
        info = committer.commit_files(
            job, extra=[*shard_files, table_entry], format_version=SHARDED_VERSION
        )
    except Exception as exc:  # reported to every rank; rank 0's store reports it too
        return f"step {job.step} not committed: {type(exc).__name__}: {exc}"[:1000]
    return asdict(info)

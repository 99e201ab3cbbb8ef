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

import concurrent.futures as cf
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from snapshots.errors import SnapshotCorruptError, SnapshotSaveError
from snapshots.format import layout, sharding
from snapshots.format.manifest import SHARDED_VERSION, FileEntry, checksum
from snapshots.info import SnapshotInfo
from snapshots.read import reader
from snapshots.sharded import shards
from snapshots.storage import RetryingStorage, faults
from snapshots.storage.local import LocalStorage

if TYPE_CHECKING:
    from snapshots.write.commit import Committer, SaveJob


@dataclass(frozen=True, kw_only=True)
class ShardPart:
    """This rank's part of a sharded save."""

    rank: int
    world_size: int
    staged: shards.StagedShard
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
        if not part.staged.pieces:
            return _Report(rank=part.rank, records={})
        name = sharding.shard_file_name(part.rank, job.token)
        faults.hit("before_data")
        path = f"{layout.step_dir(job.step)}/{name}"
        with cf.ThreadPoolExecutor(1, thread_name_prefix="snapshot-hash") as pool:
            # BLAKE3 releases the GIL: the hashing runs while the file is written and fsynced
            # (both only read the staging buffer, which nothing changes during the save).
            hashed = pool.submit(shards.encode, part.staged, name, shard=part.rank)
            committer.storage.write(path, _writable(committer.storage, part.staged.data))
            entry, records = hashed.result()
        # No read-back: the checksums are of the very buffer handed to storage, which nothing
        # changes during the save. Reading a local file back (from the page cache, or the disk
        # after an O_DIRECT write, a second pass over every byte) proves only that the kernel
        # kept its own copy; an object store's PUT is whole. Rank 0 commits only once every
        # rank reported its file (size, checksums) and a listing shows each at that size
        # (``_verify_commit``); damage after that is caught at load, where every chunk is
        # verified before use and the ranks fall back together.
        return _Report(rank=part.rank, entry=entry, records=records)
    except Exception as exc:  # every failure is reported to rank 0, whatever its type
        return _Report(rank=part.rank, error=f"{type(exc).__name__}: {exc}"[:500])


def _writable(storage: RetryingStorage, data: memoryview) -> Any:
    """Local files take the staging buffer itself; any other backend gets bytes of its own
    (it may keep what it is given, and the buffer is reused by the next save)."""
    return data if isinstance(storage.inner, LocalStorage) else bytes(data)


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
        table = shards.merge(part.world_size, [r.records or {} for r in reports])
        body = sharding.to_json(table)
        if len(body) > sharding.MAX_TABLE_BYTES:
            problem = sharding.table_size_problem(len(body))
            raise SnapshotSaveError(f"{problem}: the state has too many chunks to save")
        name = sharding.table_file_name(job.token)
        committer.storage.write(f"{layout.step_dir(job.step)}/{name}", body)
        table_entry = FileEntry(name=name, size=len(body), checksum=checksum(body), table=True)
        checked = {f.name for f in shard_files}
        info = committer.commit_files(
            job,
            extra=[*shard_files, table_entry],
            format_version=SHARDED_VERSION,
            verify=lambda step: _verify_commit(committer.storage, step, checked),
        )
    except Exception as exc:  # reported to every rank; rank 0's store reports it too
        return f"step {job.step} not committed: {type(exc).__name__}: {exc}"[:1000]
    return asdict(info)


def _verify_commit(storage: RetryingStorage, step: int, checked: set[str]) -> SnapshotInfo:
    """Rank 0's ``full`` verification of the commit: the manifest parses, every file it lists
    is there at its size (one listing), and rank 0's own files pass their checksums. The
    shard files in ``checked`` are checked by size only (see ``_write_own``): their chunks
    were hashed from the buffer that was written, and every load verifies them."""
    manifest = reader.read_manifest(storage, step)
    problems = reader.check_sizes(storage, step, manifest.files)
    if not problems:
        own = [f for f in manifest.files if f.name not in checked]
        problems = reader.check_files(storage, step, manifest, own)[0]
    if problems:
        raise SnapshotCorruptError(
            f"step {step} failed verification right after writing: {'; '.join(problems)}"
        )
    return SnapshotInfo.from_manifest(manifest, f"{storage.url}/{layout.step_dir(step)}")

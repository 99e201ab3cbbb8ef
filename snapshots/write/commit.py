"""Writing one captured save to storage: data files, then the manifest (the commit point).

Data files get names no other save uses (the job's random token), so two writers of one step
never overwrite each other's data; only the exclusive create of the manifest decides which
of them committed. Runs on the writer thread (or the caller's, for blocking saves).

After the commit the save is *verified*, and only a verified save lets retention delete
older snapshots. What "verified" means depends on the verification mode (``"auto"`` picks
``"listing"`` for object stores, ``"written"`` for local disk, ``"full"`` for everything
else):

- ``"written"`` (what ``"auto"`` picks for local disk, whose files are streamed: serialised
  straight into the file and hashed on the way; but with ``keep=1``, where a damaged new
  snapshot would leave nothing older to fall back on): the manifest is read back byte for byte
  and one listing shows every file at the manifest's size; nothing else is read back. Each
  checksum is of the very buffer handed to the kernel, which nothing changed during the
  save, and the large tensors go to the disk past the page cache, so a read-back would come
  from the disk (a read and a second hash of every byte, CPU taken from training) to
  prove only that the kernel kept its copy. Damage after that is caught where it matters:
  every load checks every checksum before unpickling, and falls back to an older snapshot.
- ``"full"`` (``memory://``, any other non-object-store backend, and on request): the
  manifest is read back and parses; every file it lists appears in the step folder's
  listing at the manifest's size; every file is read back and its checksum equals the
  manifest's. The shard files of a sharded save are the exception: listed at their size,
  not read back (their chunks are hashed from the very buffer written, and written past the
  page cache; see ``sharded_commit._write_own``); every load verifies each chunk it uses.
- ``"listing"`` (object stores: s3, gs, az...; reading back would double the traffic): the
  manifest is read back and is byte for byte the one this save wrote; one listing of the
  step folder shows every file at the manifest's size; on S3 each file's listed ETag must
  equal the ETag computed locally from the uploaded bytes (a hash the server computed over
  what it stored). A file whose ETag differs (SSE-KMS/SSE-C encryption, another multipart
  layout, damage) is downloaded and its sha256 checked. On object stores whose listing has
  no comparable hash (gs, az through fsspec today) a file passes on its size: an object PUT
  is all-or-nothing.

``latest()``, ``load()`` and ``verify()`` always check every checksum, whatever the mode.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from snapshots.errors import (
    SnapshotCorruptError,
    SnapshotError,
    SnapshotExistsError,
    SnapshotSaveError,
)
from snapshots.format import layout
from snapshots.format.manifest import (
    CHECKSUM_ALGORITHM,
    FORMAT_VERSION,
    FileEntry,
    Manifest,
    checksum,
    now_iso,
    to_json,
)
from snapshots.format.serialization import serialize, serialize_into
from snapshots.info import SnapshotInfo
from snapshots.read import reader
from snapshots.read.catalog import Catalog
from snapshots.storage import RetryingStorage, faults
from snapshots.write import sharded_commit, writer_process

VerifyMode = Literal["auto", "full", "listing"]


@dataclass(frozen=True, kw_only=True)
class SaveJob:
    step: int
    epoch: int
    world_size: int
    metadata: dict[str, Any]
    entries: dict[str, Any]  # captured (staged) values, ready to serialise
    per_rank: list[Any] | None
    stall_ms: float
    token: str
    overlapped: bool = False
    # A sharded save (format 2): this rank's part; every rank's writer runs the commit.
    shards: sharded_commit.ShardPart | None = None
    # Set when the caller stopped waiting (its deadline passed): the save stops before its
    # next write and never commits, so an exiting process is not held by it.
    cancelled: threading.Event = field(default_factory=threading.Event)


class Committer:
    def __init__(
        self,
        storage: RetryingStorage,
        catalog: Catalog,
        verify: VerifyMode = "auto",
        *,
        guard: Callable[[], None] | None = None,
        sole_copy: bool = False,
    ) -> None:
        """``guard``: raises when this writer may no longer write (the folder's owner check);
        called before the first write and again right before the commit. ``sole_copy``:
        retention keeps one snapshot, so ``"auto"`` reads local files back (``"full"``)."""
        if verify not in ("auto", "full", "listing"):
            raise ValueError(
                f"verify_after_write must be 'auto', 'full' or 'listing', got {verify!r}"
            )
        self._storage = storage
        self._catalog = catalog
        self._verify = verify
        self._guard = guard or (lambda: None)
        self._sole_copy = sole_copy

    def mode(self) -> Literal["full", "listing", "written"]:
        """Resolved per save: the storage behind the store may be wrapped after start-up."""
        if self._verify == "auto":
            if self._storage.object_store:
                return "listing"
            return "written" if self._storage.streams and not self._sole_copy else "full"
        return self._verify

    @property
    def storage(self) -> RetryingStorage:
        return self._storage

    def commit(self, job: SaveJob) -> SnapshotInfo:
        """Write the job's files and manifest, then verify the commit before anyone prunes.
        A sharded job: every rank writes its shards, rank 0 commits (``sharded_commit``)."""
        if job.shards is not None:
            return sharded_commit.commit(self, job, job.shards)
        return self.commit_files(job)

    def commit_files(
        self,
        job: SaveJob,
        *,
        extra: Sequence[FileEntry] = (),
        format_version: int = FORMAT_VERSION,
        verify: Callable[[int], SnapshotInfo] | None = None,
    ) -> SnapshotInfo:
        """``extra``: files already written (other ranks' shards, the shard table), listed
        in the manifest beside this job's own. ``verify``: the ``full`` verification to run
        instead of reading every file back (a sharded save: each rank checked its own)."""
        self._guard()
        if reader.has_manifest(self._storage, job.step):
            raise SnapshotExistsError(
                f"step {job.step} is already committed at {self._catalog.step_url(job.step)}; "
                "committed snapshots are never overwritten (save a later step, or delete it "
                "first)",
                step=job.step,
            )
        faults.hit("before_data")
        mode = self.mode()
        listing = mode == "listing"
        written = self._write_files(job, etags=listing)
        files = [entry for entry, _ in written] + list(extra)
        manifest = _manifest_for(job, files, format_version)
        faults.hit("before_manifest")
        _stop_if_cancelled(job)
        self._guard()
        body = self._put_manifest(job, manifest)
        faults.hit("after_manifest")
        if mode == "full":
            return (verify or self._verify_fully)(job.step)
        # "written": the manifest as written and every file at its size, from one listing.
        etags = {entry.name: etag for entry, etag in written if etag is not None}
        return self._verify_listed(manifest, body, etags)

    def _write_files(self, job: SaveJob, *, etags: bool) -> list[tuple[FileEntry, str | None]]:
        files = [
            self._put(job, layout.entry_file_name(i, key, job.token), value, etags, key=key)
            for i, (key, value) in enumerate(job.entries.items())
        ]
        for rank, value in enumerate(job.per_rank or []):
            name = layout.rank_file_name(rank, job.token)
            files.append(self._put(job, name, value, etags, rank=rank))
        return files

    def _put(
        self,
        job: SaveJob,
        name: str,
        value: Any,
        etags: bool,
        *,
        key: str | None = None,
        rank: int | None = None,
    ) -> tuple[FileEntry, str | None]:
        _stop_if_cancelled(job)
        path = f"{layout.step_dir(job.step)}/{name}"
        if self._storage.streams and not etags:
            # Serialised straight into the file and hashed on the way: no in-memory copy.
            size, digest = self._storage.write_streamed(path, lambda sink: _fill(job, value, sink))
            return FileEntry(name=name, size=size, checksum=digest, key=key, rank=rank), None
        data = serialize(value)
        entry = FileEntry(name=name, size=len(data), checksum=checksum(data), key=key, rank=rank)
        # An MD5 pass only where a listing can be checked against it (object stores).
        etag = self._storage.etag_of(data) if etags else None
        self._storage.write(path, data)
        return entry, etag

    def _put_manifest(self, job: SaveJob, manifest: Manifest) -> bytes:
        body = to_json(manifest)
        try:
            self._storage.write(layout.manifest_path(job.step), body, exclusive=True)
        except FileExistsError as exc:
            # A retried PUT whose first attempt landed reads as "exists": is it ours?
            if self.manifest_is_ours(job):
                return body
            raise SnapshotExistsError(
                f"step {job.step} was committed by another writer while this save ran "
                f"({self._catalog.step_url(job.step)}); this save was discarded",
                step=job.step,
            ) from exc
        return body

    def manifest_is_ours(self, job: SaveJob, storage: RetryingStorage | None = None) -> bool:
        try:
            manifest = reader.read_manifest(storage or self._storage, job.step)
        except (FileNotFoundError, SnapshotError):
            return False
        return all(job.token in f.name for f in manifest.files) and bool(manifest.files)

    def _verify_fully(self, step: int) -> SnapshotInfo:
        if self._storage.streams:
            return self._verify_streamed(step)
        result = self._catalog.verify(step)
        if not result.ok or result.info is None:
            raise _unverified(step, result.problems)
        return result.info

    def _verify_streamed(self, step: int) -> SnapshotInfo:
        """The checks of ``Catalog.verify``, each file hashed in chunks as it is read back
        (no whole copy in memory): the manifest parses, every file is listed at its size,
        and its sha256 read back from storage equals the manifest's."""
        try:
            manifest = reader.read_manifest(self._storage, step)
        except (SnapshotCorruptError, FileNotFoundError) as exc:
            raise _unverified(step, [f"{layout.MANIFEST_NAME}: {exc}"]) from exc
        problems = reader.check_sizes(self._storage, step, manifest.files)
        for f in [] if problems else manifest.files:
            path = f"{layout.step_dir(step)}/{f.name}"
            try:
                size, digest = self._storage.digest(path, manifest.checksum_algorithm)
            except (FileNotFoundError, SnapshotCorruptError) as exc:
                problems.append(f"file {f.name}: {exc}")
                continue
            if size != f.size or digest != f.checksum:
                problems.append(f"file {f.name} does not read back as written (damaged)")
        if problems:
            raise _unverified(step, problems)
        return SnapshotInfo.from_manifest(manifest, self._catalog.step_url(step))

    def _verify_listed(
        self, manifest: Manifest, body: bytes, etags: dict[str, str]
    ) -> SnapshotInfo:
        step = manifest.step
        try:
            stored = self._storage.read(layout.manifest_path(step))
        except FileNotFoundError:
            stored = None
        if stored != body:
            raise _unverified(step, [f"{layout.MANIFEST_NAME} is not the one this save wrote"])
        problems = reader.check_written(self._storage, step, manifest, etags)
        if problems:
            raise _unverified(step, problems)
        return SnapshotInfo.from_manifest(manifest, self._catalog.step_url(step))

    def abandon(self, job: SaveJob) -> None:
        """Best effort: remove this save's data files unless its manifest committed them.
        One attempt per call, no retries: it runs off the training path after a failure,
        often while storage is down; retention cleans what it leaves (orphans, strays)."""
        storage = self._storage.single_attempt()
        if self.manifest_is_ours(job, storage):
            return
        folder = layout.step_dir(job.step)
        try:
            for entry in storage.list(folder):
                if job.token in entry.name:
                    storage.delete(f"{folder}/{entry.name}")
        except SnapshotError:
            pass  # storage is failing; retention cleans the orphan later


def _manifest_for(job: SaveJob, files: list[FileEntry], format_version: int) -> Manifest:
    return Manifest(
        step=job.step,
        epoch=job.epoch,
        world_size=job.world_size,
        torch_version=torch.__version__,
        created_at=now_iso(),
        files=tuple(files),
        metadata=job.metadata,
        format_version=format_version,
    )


def _fill(job: SaveJob, value: Any, sink: Any) -> tuple[int, str]:
    """Serialise ``value`` into ``sink``: through the writer process where it takes the save
    (``writer_process``), else here; from the start again here if the process was lost."""
    try:
        done = writer_process.try_write(
            value, sink, CHECKSUM_ALGORITHM, lambda: _stop_if_cancelled(job)
        )
    except writer_process.WriterProcessLost:
        sink.restart()
        done = None
    return done if done is not None else serialize_into(value, sink, CHECKSUM_ALGORITHM)


def _stop_if_cancelled(job: SaveJob) -> None:
    if job.cancelled.is_set():
        raise SnapshotSaveError(
            f"the save of step {job.step} was cancelled: its caller's deadline passed",
            step=job.step,
        )


def _unverified(step: int, problems: list[str]) -> SnapshotCorruptError:
    return SnapshotCorruptError(
        f"step {step} failed verification right after writing: {'; '.join(problems)}"
    )

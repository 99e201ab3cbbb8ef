"""SnapshotStore: save / latest / load / list / verify / prune on any fsspec URL.

A small facade over single-purpose modules: ``commit`` writes one save (data files, then
the manifest), ``writer`` runs saves on one background thread, ``catalog`` reads and
verifies, ``_housekeeping`` carries out the pure ``retention`` rules.

Commit protocol: data files go to a fresh ``step-<12 digits>/`` folder under names no other
save uses; the manifest (sizes + checksums) is written last with an exclusive create, and is
the commit point. A committed snapshot is never overwritten: saving a step that is already
committed fails with SnapshotExistsError (we chose an error over a silent no-op because two
writers of one step mean two generations of a job believe they own it).

Asynchronous saves: the caller blocks only while tensors are copied into reused staging
buffers; one background thread serialises, checksums, writes, verifies and prunes. At most
one save is in flight; the next waits for it (``when_busy="wait"``) or is skipped
(``"skip"``, event ``snapshot.skipped``). A failed save never raises into the training loop
by itself: it emits ``snapshot.failed``, its handle's ``result()`` raises, and the next
``save()`` (after starting its own save), ``wait()`` or ``close()`` raises SnapshotSaveError
once; catching and ignoring it is safe. Its clean-up runs on a second thread, best effort.

Storage outages. While storage is down (the save in flight is failing or retrying, or the
last one failed and storage has not answered since; ``snapshots.storage.health``) an asynchronous
save is skipped (``snapshot.skipped`` with the reason) whatever ``when_busy`` says, so the
training loop never waits on a failing storage; a background probe notices when storage
answers again. A blocking save (a preemption's final snapshot) takes ``deadline_s`` (or a
``deadline()`` block) and raises SnapshotSaveError naming it once it passes; the save is
then cancelled before its next write and never commits.

Ownership: with ``owner=Owner(job_id=..., run_token=...)`` the folder belongs to one job
(``snapshots.ownership``); without it the store neither checks nor records an owner.
"""

from __future__ import annotations

import atexit
import contextlib
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch

from snapshots import ownership
from snapshots.errors import (
    SnapshotError,
    SnapshotSaveError,
)
from snapshots.events import emit
from snapshots.format import layout
from snapshots.info import SaveHandle, SnapshotInfo
from snapshots.ownership import Owner
from snapshots.read import catalog
from snapshots.read.store_reading import StoreReading
from snapshots.read.store_reading import restore_into as restore_into  # re-exported
from snapshots.storage import (
    RetryingStorage,
    Storage,
    check_reachable,
    open_storage,
    redact_url,
)
from snapshots.storage.deadline import Deadline
from snapshots.storage.retry import RetryPolicy
from snapshots.write import commit, sharded_commit, writer
from snapshots.write.capture import Capturer, json_metadata

WhenBusy = Literal["wait", "skip"]


class SnapshotStore(StoreReading):
    # Strays (unlisted files in committed folders, see ``retention``) younger than this are
    # left to the writer that may still be running; wall-clock seconds against file mtimes.
    stray_grace_s: float = 60.0

    def __init__(
        self,
        url: str,
        *,
        keep: int | None = 3,
        keep_every: int | None = None,
        async_save: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        when_busy: WhenBusy = "wait",
        retry: RetryPolicy | None = None,
        create: bool = True,
        verify_after_write: commit.VerifyMode = "auto",
        storage_timeout: float | None = None,
        owner: Owner | None = None,
        storage: Storage | None = None,
        owner_probe: ownership.Probe | None = None,
    ) -> None:
        """``create=False``: a missing local folder is an error instead of being created.

        ``storage_timeout``: seconds within which every storage operation succeeds or fails,
        retries included (default 30; ``snapshots.storage.retry``). It overrides
        ``retry.deadline_s``.

        ``owner``: the job and run writing this folder; another job's folder is refused with
        SnapshotOwnerError, an earlier run's is adopted (``snapshots.ownership``);
        ``owner_probe``: asked whether the run recorded there still lives before a folder is
        refused as a live run's (``ownership.claim``).

        ``verify_after_write``: how a save is verified before retention may delete anything
        older. ``"auto"``: ``"listing"`` (sizes and server-side ETags from one listing) on
        object stores, ``"written"`` on local disk (the manifest read back, sizes from one
        listing; the checksums are of the very buffers written, and every load checks
        them) unless ``keep=1`` (nothing older would be left to fall back on), ``"full"``
        (read everything back, check every checksum) elsewhere and on request. The
        ``snapshots.write.commit`` docstring says exactly what each one proves.

        ``storage``: the backend to use instead of the one ``url`` names (a test's
        fault-injecting wrapper, a backend of your own), rooted where ``url`` points; its
        ``url`` names the store in messages. Retries, the deadline and health tracking are
        added on top as for any backend; ``storage_options`` do not apply to it.

        Args:
            url: The snapshot folder: a local path or an fsspec URL (``s3://``, ``gs://``,
                ``memory://``). Credentials stay with fsspec; they are redacted in events.
            keep: Default 3. The newest committed snapshots kept after each save; None: all.
            keep_every: Default None. Also keep every snapshot whose step is a multiple of
                this (long-term milestones), beyond ``keep``.
            async_save: Default True: ``save`` returns once the state is copied in memory
                and a background thread writes it; False: every save blocks until committed.
            storage_options: Default None. Passed to fsspec's file system (credentials,
                endpoint), plus this package's own: ``writer_process`` (write large local
                saves from a process of their own) and ``group_access`` (folders 0750,
                files 0640 instead of 0700/0600).
            when_busy: Default ``"wait"``: an asynchronous save waits for the one in flight;
                ``"skip"``: it is skipped instead (``snapshot.skipped``).
            retry: Default None: ``RetryPolicy()``. Backoff for transient storage errors
                (``snapshot.storage_retry``).
            create: Default True: a missing local folder is created.
            verify_after_write: Default ``"auto"``; ``"listing"``, ``"written"`` or
                ``"full"`` as above.
            storage_timeout: Default None: 30 s (``DEFAULT_STORAGE_TIMEOUT_S``). Seconds
                within which every storage operation succeeds or fails, retries included.
            owner: Default None: no ownership check. The job and run writing this folder.
            storage: Default None: the backend ``url`` names. A backend to use instead.
            owner_probe: Default None. Whether the run recorded in the folder still lives.

        Raises:
            ValueError: ``keep``, ``keep_every`` or ``when_busy`` out of range.
            StorageError: The folder cannot be reached or created (``create=False``: it does
                not exist).
            SnapshotOwnerError: The folder belongs to another job, or a live run of this one.
        """
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be an int >= 1 or None (keep all), got {keep!r}")
        if keep_every is not None and (not isinstance(keep_every, int) or keep_every < 1):
            raise ValueError(f"keep_every must be an int >= 1 or None, got {keep_every!r}")
        if when_busy not in ("wait", "skip"):
            raise ValueError(f"when_busy must be 'wait' or 'skip', got {when_busy!r}")
        self.keep, self.keep_every = keep, keep_every
        self.async_save, self.when_busy = async_save, when_busy
        self.owner = owner
        self._owner_checked = False  # this store wrote under the owner check: it ends the run
        self._storage = _open(
            url, storage, storage_options, (retry or RetryPolicy()).with_timeout(storage_timeout)
        )
        self.url = self._storage.url
        check_reachable(self._storage, url, create)
        if owner is not None:
            ownership.claim(self._storage, self.url, owner, probe=owner_probe)
        self._catalog = catalog.Catalog(self._storage, self.url)
        self._committer = commit.Committer(
            self._storage,
            self._catalog,
            verify_after_write,
            guard=self._ensure_owner,
            sole_copy=keep == 1,
        )
        self._writer = writer.BackgroundWriter(self._storage.health)
        self._job: commit.SaveJob | None = None  # the save in flight, to cancel at a deadline
        self._deadline = Deadline()
        # Staging on shared memory only where the writer process may read it.
        shared = getattr(self._storage.inner, "writer_process", False)
        self._capturer = Capturer(shared=shared)
        self._closed = False
        self.last_committed: SnapshotInfo | None = None  # newest save committed by this store
        atexit.register(_close_at_exit, weakref.ref(self))

    @property
    def storage(self) -> RetryingStorage:
        """The storage this store reads and writes through: the backend (``inner``) with
        retries (``policy``) and the outage record (``health``) on top. Read-only."""
        return self._storage

    @property
    def last_hook_wait_ms(self) -> float:
        """How long the last ``optimizer.step()`` waited for an overlapped copy."""
        return self._capturer.last_hook_wait_ms

    @last_hook_wait_ms.setter
    def last_hook_wait_ms(self, value: float) -> None:
        self._capturer.last_hook_wait_ms = value

    def _ensure_owner(self) -> None:
        if self.owner is not None:
            ownership.ensure_mine(self._storage, self.url, self.owner)
            self._owner_checked = True

    def _record_end(self) -> None:
        """The writer of the run closes: the next run of the job adopts the folder at once
        (``ownership.end``). Best effort, and never waited for on storage that is down: the
        record then goes stale instead."""
        if self.owner is None or not self._owner_checked or self._storage.health.down:
            return
        if self._writer.pending is not None:  # a save still in flight may yet commit
            return
        with contextlib.suppress(Exception):
            ownership.end(self._storage.single_attempt(), self.url, self.owner)

    # ------------------------------------------------------------------ save
    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        epoch: int = 0,
        world_size: int = 1,
        metadata: Mapping[str, Any] | None = None,
        blocking: bool | None = None,
        per_rank: Sequence[Any] | None = None,
        overlap_with: torch.optim.Optimizer | None = None,
        deadline_s: float | None = None,
        shards: Callable[[], sharded_commit.ShardPart] | None = None,
        token: str | None = None,
    ) -> SaveHandle:
        """Snapshot ``state`` at ``step``. Blocks for the in-memory copy only, unless blocking.

        Asynchronous saves are skipped (``snapshot.skipped``), never waited for, while
        storage is down. ``deadline_s`` (blocking saves): raise SnapshotSaveError once it has
        passed, the save cancelled (see ``deadline()``).

        ``overlap_with=optimizer`` (asynchronous saves only, opt-in; CheckFreq): the optimizer's
        parameters and state are copied in the background while the next forward/backward
        runs, and ``optimizer.step()`` waits (a step pre-hook) until that copy is done.
        Everything else (BatchNorm buffers, scheduler, scaler, plain values) is copied at the
        call. Only valid if nothing but ``optimizer.step()`` changes those tensors meanwhile.

        Args:
            step: The step number (>= 0); the snapshot's folder is ``step-<12 digits>``.
            state: Name -> tensor, nested dict/list of tensors and plain values, or an object
                with ``state_dict()`` (model, optimizer, ``Stateful``).
            epoch: Default 0. Recorded in the manifest (``SnapshotInfo.epoch``).
            world_size: Default 1. The world size that saved it, recorded for the reader.
            metadata: Default None. JSON-serialisable values recorded in the manifest.
            blocking: Default None: the store's ``async_save`` decides. True: return only
                once the snapshot is committed.
            per_rank: Default None. One state per rank (RNG states gathered to this rank),
                saved in files of their own; ``load(rank=r)`` returns rank r's.
            overlap_with: Default None. The optimizer whose state is copied while the next
                step runs (above).
            deadline_s: Default None. Blocking saves: give up after this many seconds.
            shards: Default None. A sharded save's part (``DistributedSnapshotter``'s).
            token: Default None: a fresh one. The random token in this save's file names.

        Returns:
            A handle: ``result()`` waits and returns the ``SnapshotInfo`` of the committed
            snapshot (None when the save was skipped), or raises SnapshotSaveError.

        Raises:
            SnapshotSaveError: A blocking save failed or passed its deadline, or an earlier
                asynchronous save failed (raised once, after this save was started).
            SnapshotExistsError: This step is already committed.
            SnapshotError: The store is closed.
        """
        if self._closed:
            raise SnapshotError(f"snapshot store {self.url} is closed")
        layout.step_dir(step)  # validates the step
        meta = json_metadata(metadata)
        blocking = (not self.async_save) if blocking is None else blocking
        started = time.perf_counter()

        def capture(overlap: torch.optim.Optimizer | None = None) -> commit.SaveJob:
            return self._capturer.capture(
                step, state, epoch=epoch, world_size=world_size, meta=meta,
                per_rank=per_rank, started=started, overlap=overlap, shards=shards,
                token=token,
            )  # fmt: skip

        if blocking:
            with self.deadline(deadline_s):
                return self._save_blocking(step, capture, started)
        reason = self._why_skip() if shards is None else None
        if reason is not None:
            emit("snapshot.skipped", step=step, reason=reason)
            return SaveHandle(step, skipped_reason=reason)
        # the previous save may have finished (failed) since: collect its error to raise once
        self._writer.settle()
        job = capture(overlap_with)
        previous = self._writer.take_unreported()
        handle = self._submit(job)
        if previous is not None:
            raise writer.previous_failure(previous, handle)
        return handle

    def why_skip(self) -> str | None:
        """Why an asynchronous save must not start now (None: it may). Waits for the save
        in flight (``when_busy="wait"``) unless storage is down. For DistributedSnapshotter,
        whose ranks agree on it before a sharded save."""
        return self._why_skip()

    def _why_skip(self) -> str | None:
        """Why an asynchronous save must not start now (None: start it). Never waits for a
        storage that is down: the training loop goes on and a later save catches up."""
        pending = self._writer.pending
        if self._writer.busy() and pending is not None:
            if self.when_busy == "skip":
                return f"the save of step {pending.step} is still in flight"
            if not self._settle_pending():
                return (
                    f"snapshot storage is down ({self._storage.health.error}); the save of "
                    f"step {pending.step} is still retrying"
                )
        if self._storage.health.down:
            self._writer.probe(lambda: self._storage.single_attempt().list(""))
            return (
                f"snapshot storage is down ({self._storage.health.error}); snapshots resume "
                "once it answers again"
            )
        return None

    def _save_blocking(
        self, step: int, capture: Callable[[], commit.SaveJob], started: float
    ) -> SaveHandle:
        """Runs on the writer thread, so that the caller can stop waiting at its deadline."""
        late = self.flush_before_blocking(step)
        if late is not None:
            raise late
        job = capture()
        previous = self._writer.take_unreported()
        handle = self._submit(job, stall_started=started)
        if not self._writer.settle(until=self._deadline.end()):
            raise self._past_deadline(step, "it was still")
        exc = self._writer.take_unreported()
        if exc is not None:
            raise exc from exc.__cause__  # this save's own failure, raised here, once
        if previous is not None:
            raise writer.previous_failure(previous, handle)
        return handle

    def flush_before_blocking(self, step: int) -> SnapshotSaveError | None:
        """A blocking save's first part: wait for the save in flight until the deadline.
        The error naming the deadline (the save in flight cancelled) when it passed first.
        DistributedSnapshotter's ranks share this answer before a sharded blocking save, so
        that they all start it or all give up (never one rank's writer left in the commit's
        collectives, waiting for a rank that gave up before copying)."""
        if self._writer.settle(until=self._deadline.end()):
            return None
        return self._past_deadline(step, f"the save of step {self._pending_step()} is still")

    def _submit(self, job: commit.SaveJob, *, stall_started: float | None = None) -> SaveHandle:
        self._job = job
        return self._writer.submit(
            job.step,
            lambda: self._write(job, stall_started=stall_started),
            urgent=stall_started is not None,  # a blocking save: someone is waiting for it
        )

    def deadline(self, seconds: float | None) -> contextlib.AbstractContextManager[None]:
        """Inside the block, ``save(blocking=True)`` and ``wait()`` give up after ``seconds``
        (SnapshotSaveError naming the deadline; the save in flight is cancelled). None: no
        deadline (an enclosing block's, if any, still holds).

        Args:
            seconds: The deadline from now, or None.

        Returns:
            A context manager: ``with store.deadline(20): store.save(..., blocking=True)``.
        """
        return self._deadline.block(seconds)

    def _pending_step(self) -> int | None:
        return self._writer.pending.step if self._writer.pending is not None else None

    def _past_deadline(self, step: int | None, what: str) -> SnapshotSaveError:
        """Cancel the save in flight (it stops before its next write, never commits)."""
        if self._job is not None:
            self._job.cancelled.set()
        if self._writer.pending is not None:
            self._writer.pending.error_reported = True  # this error is its report
        return self._deadline.error(self.url, step, what)

    def _settle_pending(self) -> bool:
        """Before a save: wait for the one in flight, unless storage is down (then return
        False at once, leaving it in flight). Keeps its error for the caller to see once.
        DistributedSnapshotter calls this on rank 0 before its collectives."""
        return self._writer.settle(unless_down=True, until=self._deadline.end())

    def wait(self) -> SnapshotInfo | None:
        """Flush the in-flight save; raise the newest unreported save failure, if any.
        Inside a ``deadline()`` block, gives up (and cancels the save) when it passes.

        Returns:
            The ``SnapshotInfo`` the save in flight committed; None when there was none, it
            was skipped, or its failure was already reported through its handle.

        Raises:
            SnapshotSaveError: A save failed and was not reported yet, or the deadline passed.
        """
        handle = self._writer.pending
        if not self._writer.settle(until=self._deadline.end()):
            raise self._past_deadline(self._pending_step(), "it was still")
        previous = self._writer.take_unreported()
        if previous is not None:
            raise writer.previous_failure(previous, None)
        if handle is None or handle.skipped or handle.exception() is not None:
            return None  # a failure seen here was already reported through its handle
        return handle.result()

    def close(self) -> None:
        """Flush the in-flight save and stop the writer thread. Idempotent.

        Raises:
            SnapshotSaveError: As ``wait()``: the last save failed unreported.
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._writer.shutdown(wait=self._writer.pending is None)
            self._record_end()

    def release_reserved(self) -> int:
        """Once the job has ended: close, then delete the data files local storage keeps in
        ``.reuse/`` for the next save to write over (about one snapshot's size). The bytes
        freed (``snapshot.reserved_released`` when any); 0 on other storage, which keeps
        nothing.

        Returns:
            The bytes freed.
        """
        self.close()
        freed = self._storage.release_set_aside()
        if freed:
            emit("snapshot.reserved_released", bytes=freed, url=self.url)
        return freed

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- the writer
    def _write(self, job: commit.SaveJob, *, stall_started: float | None = None) -> SnapshotInfo:
        """Runs on the writer thread (or the caller's, for blocking saves)."""
        begun = time.perf_counter()
        with self._writer.tracking(job.step):
            info = self._commit(job)
        write_ms = (time.perf_counter() - begun) * 1000
        stall_ms = (
            job.stall_ms if stall_started is None else (time.perf_counter() - stall_started) * 1000
        )
        if self.last_committed is None or info.step >= self.last_committed.step:
            self.last_committed = info
        if job.shards is not None and job.shards.rank != 0:
            return info  # a sharded save is reported, and retention run, by rank 0 only
        emit(
            "snapshot.saved",
            step=job.step,
            epoch=job.epoch,
            url=info.url,
            bytes=info.bytes,
            stall_ms=round(stall_ms, 3),
            write_ms=round(write_ms, 3),
        )
        self._prune_after_save(job.step)  # reached only once the new snapshot verified
        return info

    def _commit(self, job: commit.SaveJob) -> SnapshotInfo:
        try:
            self._capturer.finish_deferred(job)
            return self._committer.commit(job)
        except Exception as exc:
            self._writer.chore(lambda: self._committer.abandon(job))  # off the save's path
            error = redact_url(f"{type(exc).__name__}: {exc}")
            emit("snapshot.failed", step=job.step, url=self._step_url(job.step), error=error)
            if isinstance(exc, SnapshotSaveError):
                raise
            raise SnapshotSaveError(
                f"saving step {job.step} to {self.url} failed: {error}", step=job.step
            ) from exc

    def _prune_after_save(self, verified_step: int) -> None:
        if self.keep is None:
            return
        try:
            self._prune(self.keep, verified_step)
        except SnapshotError as exc:
            # Pruning is housekeeping: a failure must not fail the save that just committed.
            emit(
                "snapshot.failed",
                step=verified_step,
                url=self.url,
                error=f"pruning failed: {redact_url(str(exc))}",
            )


def _close_at_exit(ref: weakref.ReferenceType[SnapshotStore]) -> None:
    store = ref()
    if store is None:
        return
    # A failure here was already reported as snapshot.failed when it happened.
    with contextlib.suppress(SnapshotError):
        store.close()


def _open(
    url: str,
    storage: Storage | None,
    storage_options: Mapping[str, Any] | None,
    policy: RetryPolicy,
) -> RetryingStorage:
    """The backend ``url`` names, or the one the caller passed, with retries on top."""
    if storage is None:
        return open_storage(url, storage_options=storage_options, retry=policy)
    if storage_options:
        raise ValueError(
            "storage_options apply only to the backend opened from the URL: "
            "pass them to the storage you construct instead"
        )
    return RetryingStorage(storage, policy)

"""SnapshotStore: save / latest / load / list / verify / prune on any fsspec URL.

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
once; catching and ignoring it is safe.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import json
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from snapshots import _faults, _reader, layout, retention
from snapshots.errors import (
    NoValidSnapshotError,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    SnapshotSaveError,
    StorageError,
    UnsafeStateError,
)
from snapshots.events import emit
from snapshots.info import LoadedSnapshot, SaveHandle, SnapshotInfo, VerifyResult
from snapshots.manifest import FileEntry, Manifest, checksum, now_iso, to_json
from snapshots.retry import RetryPolicy
from snapshots.rng import RNGState
from snapshots.serialization import Stager, deserialize, is_stateful, serialize
from snapshots.storage import RetryingStorage, open_storage, redact_url

WhenBusy = Literal["wait", "skip"]


@dataclass(frozen=True, kw_only=True)
class _SaveJob:
    step: int
    epoch: int
    world_size: int
    metadata: dict[str, Any]
    entries: dict[str, Any]  # captured (staged) values, ready to serialise
    per_rank: list[Any] | None
    stall_ms: float
    token: str
    overlapped: bool = False


class SnapshotStore:
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
    ) -> None:
        """``create=False``: a missing local folder is an error instead of being created."""
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be an int >= 1 or None (keep all), got {keep!r}")
        if keep_every is not None and (not isinstance(keep_every, int) or keep_every < 1):
            raise ValueError(f"keep_every must be an int >= 1 or None, got {keep_every!r}")
        if when_busy not in ("wait", "skip"):
            raise ValueError(f"when_busy must be 'wait' or 'skip', got {when_busy!r}")
        self.keep, self.keep_every = keep, keep_every
        self.async_save, self.when_busy = async_save, when_busy
        self._storage: RetryingStorage = open_storage(
            url, storage_options=storage_options, retry=retry
        )
        self.url = self._storage.url
        self._check_reachable(url, create)
        self._stager = Stager()
        self._executor: cf.ThreadPoolExecutor | None = None
        self._pending: SaveHandle | None = None
        self._unreported: SnapshotSaveError | None = None
        self._in_flight: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.last_committed: SnapshotInfo | None = None  # newest save committed by this store
        self._copy_done = threading.Event()  # overlapped capture: deferred copies finished
        self._copy_done.set()
        self._hooked: set[int] = set()
        self.last_hook_wait_ms = 0.0
        atexit.register(_close_at_exit, weakref.ref(self))

    def _check_reachable(self, url: str, create: bool) -> None:
        try:
            self._storage.check(create=create)
        except (StorageError, OSError) as exc:
            cause = exc.__cause__ or exc
            raise StorageError(
                f"cannot use snapshot storage {redact_url(url)}: {redact_url(str(cause))}; "
                "check that the folder or bucket exists and is writable, and that the endpoint, "
                "credentials (storage_options) and network are right"
            ) from exc

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
    ) -> SaveHandle:
        """Snapshot ``state`` at ``step``. Blocks for the in-memory copy only, unless blocking.

        ``overlap_with=optimizer`` (asynchronous saves only, opt-in; CheckFreq): the optimizer's
        parameters and state are copied in the background while the next forward/backward
        runs, and ``optimizer.step()`` waits (a step pre-hook) until that copy is done.
        Everything else (BatchNorm buffers, scheduler, scaler, plain values) is copied at the
        call. Only valid if nothing but ``optimizer.step()`` changes those tensors meanwhile.
        """
        if self._closed:
            raise SnapshotError(f"snapshot store {self.url} is closed")
        layout.step_dir(step)  # validates the step
        meta = _json_metadata(metadata)
        blocking = (not self.async_save) if blocking is None else blocking
        started = time.perf_counter()
        if self._busy():
            if blocking or self.when_busy == "wait":
                self._settle_pending()
            else:
                return self._skip(step)
        self._settle_pending()
        overlap = overlap_with if not blocking else None
        job = self._capture(step, state, epoch, world_size, meta, per_rank, started, overlap)
        previous = self._take_unreported()
        if blocking:
            return self._save_now(job, started, previous)
        future = self._writer().submit(self._write, job)
        handle = SaveHandle(step, future)
        self._pending = handle
        if previous is not None:
            raise _previous_failure(previous, handle)
        return handle

    def _busy(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def _skip(self, step: int) -> SaveHandle:
        reason = f"the save of step {self._pending.step} is still in flight"  # type: ignore[union-attr]
        emit("snapshot.skipped", step=step, reason=reason)
        return SaveHandle(step, skipped_reason=reason)

    def _capture(
        self,
        step: int,
        state: Mapping[str, Any],
        epoch: int,
        world_size: int,
        meta: dict[str, Any],
        per_rank: Sequence[Any] | None,
        started: float,
        overlap: torch.optim.Optimizer | None = None,
    ) -> _SaveJob:
        if overlap is not None:
            self._hook_optimizer(overlap)
            self._copy_done.clear()
            entries = self._stager.capture_overlapped(state, overlap)
        else:
            entries = self._stager.capture(state)
        ranks = None
        if per_rank is not None:
            ranks = [self._stager.copy_tree(v, ("__rank__", r)) for r, v in enumerate(per_rank)]
        return _SaveJob(
            step=step,
            epoch=epoch,
            world_size=world_size,
            metadata=meta,
            entries=entries,
            per_rank=ranks,
            stall_ms=(time.perf_counter() - started) * 1000,
            token=layout.new_token(),
            overlapped=overlap is not None,
        )

    def _hook_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._hooked:
            return
        self._hooked.add(id(optimizer))
        optimizer.register_step_pre_hook(self._before_optimizer_step)

    def _before_optimizer_step(self, *_: Any) -> None:
        """The only place an overlapped save makes training wait: weights are about to change."""
        if self._copy_done.is_set():
            return
        begun = time.perf_counter()
        self._copy_done.wait()
        self.last_hook_wait_ms = (time.perf_counter() - begun) * 1000

    def _save_now(
        self, job: _SaveJob, started: float, previous: SnapshotSaveError | None
    ) -> SaveHandle:
        future: cf.Future[SnapshotInfo] = cf.Future()
        try:
            future.set_result(self._write(job, stall_started=started))
        except SnapshotSaveError as exc:
            raise exc from exc.__cause__
        handle = SaveHandle(job.step, future)
        if previous is not None:
            raise _previous_failure(previous, handle)
        return handle

    def _writer(self) -> cf.ThreadPoolExecutor:
        # One thread: at most one save in flight, and staging buffers are reused per save.
        if self._executor is None:
            self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="snapshot-writer")
        return self._executor

    def _settle_pending(self) -> None:
        """Wait for the in-flight save; keep its error for the caller to see once."""
        handle, self._pending = self._pending, None
        if handle is None:
            return
        cf.wait([handle._future]) if handle._future is not None else None
        exc = handle.exception()
        if isinstance(exc, SnapshotSaveError) and not handle.error_reported:
            self._unreported = exc

    def _take_unreported(self) -> SnapshotSaveError | None:
        exc, self._unreported = self._unreported, None
        return exc

    def wait(self) -> SnapshotInfo | None:
        """Flush the in-flight save; raise the newest unreported save failure, if any."""
        handle = self._pending
        self._settle_pending()
        previous = self._take_unreported()
        if previous is not None:
            raise _previous_failure(previous, None)
        if handle is None or handle.skipped or handle.exception() is not None:
            return None  # a failure seen here was already reported through its handle
        return handle.result()

    def close(self) -> None:
        """Flush the in-flight save and stop the writer thread. Idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- the writer
    def _write(self, job: _SaveJob, *, stall_started: float | None = None) -> SnapshotInfo:
        """Runs on the writer thread (or the caller's, for blocking saves)."""
        begun = time.perf_counter()
        with self._lock:
            self._in_flight.add(job.step)
        try:
            if job.overlapped:
                try:
                    self._stager.copy_deferred()
                finally:
                    self._copy_done.set()  # never leave optimizer.step() waiting
            info = self._commit(job)
        except Exception as exc:
            self._abandon(job)
            error = redact_url(f"{type(exc).__name__}: {exc}")
            emit("snapshot.failed", step=job.step, url=self._step_url(job.step), error=error)
            if isinstance(exc, SnapshotSaveError):
                raise
            raise SnapshotSaveError(
                f"saving step {job.step} to {self.url} failed: {error}", step=job.step
            ) from exc
        finally:
            with self._lock:
                self._in_flight.discard(job.step)
        write_ms = (time.perf_counter() - begun) * 1000
        stall_ms = (
            job.stall_ms if stall_started is None else (time.perf_counter() - stall_started) * 1000
        )
        emit(
            "snapshot.saved",
            step=job.step,
            epoch=job.epoch,
            url=info.url,
            bytes=info.bytes,
            stall_ms=round(stall_ms, 3),
            write_ms=round(write_ms, 3),
        )
        if self.last_committed is None or info.step >= self.last_committed.step:
            self.last_committed = info
        self._prune_after_save(job.step)
        return info

    def _commit(self, job: _SaveJob) -> SnapshotInfo:
        folder = layout.step_dir(job.step)
        if _reader.has_manifest(self._storage, job.step):
            raise SnapshotExistsError(
                f"step {job.step} is already committed at {self._step_url(job.step)}; committed "
                "snapshots are never overwritten (save a later step, or delete it first)",
                step=job.step,
            )
        _faults.hit("before_data")
        files = [
            self._put(folder, layout.entry_file_name(i, key, job.token), value, key=key)
            for i, (key, value) in enumerate(job.entries.items())
        ]
        for rank, value in enumerate(job.per_rank or []):
            files.append(
                self._put(folder, layout.rank_file_name(rank, job.token), value, rank=rank)
            )
        manifest = Manifest(
            step=job.step,
            epoch=job.epoch,
            world_size=job.world_size,
            torch_version=torch.__version__,
            created_at=now_iso(),
            files=tuple(files),
            metadata=job.metadata,
        )
        _faults.hit("before_manifest")
        self._put_manifest(job, manifest)
        _faults.hit("after_manifest")
        return self._verify_written(job.step)

    def _put(
        self, folder: str, name: str, value: Any, *, key: str | None = None, rank: int | None = None
    ) -> FileEntry:
        data = serialize(value)
        entry = FileEntry(name=name, size=len(data), checksum=checksum(data), key=key, rank=rank)
        self._storage.write(f"{folder}/{name}", data)
        return entry

    def _put_manifest(self, job: _SaveJob, manifest: Manifest) -> None:
        body = to_json(manifest)
        try:
            self._storage.write(layout.manifest_path(job.step), body, exclusive=True)
        except FileExistsError as exc:
            # A retried PUT whose first attempt landed reads as "exists": is it ours?
            if self._manifest_is_ours(job):
                return
            raise SnapshotExistsError(
                f"step {job.step} was committed by another writer while this save ran "
                f"({self._step_url(job.step)}); this save was discarded",
                step=job.step,
            ) from exc

    def _manifest_is_ours(self, job: _SaveJob) -> bool:
        try:
            manifest = _reader.read_manifest(self._storage, job.step)
        except (FileNotFoundError, SnapshotError):
            return False
        return all(job.token in f.name for f in manifest.files) and bool(manifest.files)

    def _verify_written(self, step: int) -> SnapshotInfo:
        """Read the commit back (manifest, sizes, checksums) before anything older is pruned."""
        result = self.verify(step)
        if not result.ok or result.info is None:
            raise SnapshotCorruptError(
                f"step {step} failed verification right after writing: {'; '.join(result.problems)}"
            )
        return result.info

    def _abandon(self, job: _SaveJob) -> None:
        """Best effort: remove this save's data files unless its manifest committed them."""
        if self._manifest_is_ours(job):
            return
        folder = layout.step_dir(job.step)
        try:
            for entry in self._storage.list(folder):
                if job.token in entry.name:
                    self._storage.delete(f"{folder}/{entry.name}")
        except SnapshotError:
            pass  # storage is failing; retention cleans the orphan later

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

    # ------------------------------------------------------------- reading
    def _step_url(self, step: int) -> str:
        return f"{self.url}/{layout.step_dir(step)}"

    def _committed(self) -> tuple[list[int], list[int]]:
        """(committed steps, partial steps), newest first."""
        committed, partial = [], []
        for step in _reader.step_folders(self._storage):
            (committed if _reader.has_manifest(self._storage, step) else partial).append(step)
        return committed, partial

    def committed_steps(self) -> list[int]:
        """Steps with a manifest (readable or not), oldest first. Nothing is verified."""
        return sorted(self._committed()[0])

    def list(self) -> list[SnapshotInfo]:
        """Committed snapshots whose manifest parses, oldest first (files are not verified)."""
        infos = []
        for step in sorted(self._committed()[0]):
            try:
                manifest = _reader.read_manifest(self._storage, step)
            except (FileNotFoundError, SnapshotCorruptError):
                continue
            infos.append(SnapshotInfo.from_manifest(manifest, self._step_url(step)))
        return infos

    def verify(self, step: int) -> VerifyResult:
        """Check a snapshot's manifest, file sizes and checksums. Deserialises nothing."""
        try:
            manifest = _reader.read_manifest(self._storage, step)
        except FileNotFoundError:
            return VerifyResult(
                step=step, ok=False, problems=[f"{layout.MANIFEST_NAME} is missing"]
            )
        except SnapshotCorruptError as exc:
            return VerifyResult(step=step, ok=False, problems=[str(exc)])
        problems, _ = _reader.check_files(self._storage, step, manifest, manifest.files)
        info = SnapshotInfo.from_manifest(manifest, self._step_url(step))
        return VerifyResult(step=step, ok=not problems, problems=problems, info=info)

    def latest(self) -> SnapshotInfo | None:
        """The newest committed and verified snapshot; None only when nothing is committed."""
        committed, _ = self._committed()
        problems = []
        for step in committed:
            result = self.verify(step)
            if result.ok:
                return result.info
            problems.append(self._report_corrupt(step, "; ".join(result.problems)))
        if problems:
            raise self._none_valid(problems)
        return None

    def _report_corrupt(self, step: int, problem: str) -> str:
        emit("snapshot.corrupt", step=step, url=self._step_url(step), problem=problem)
        return f"step {step}: {problem}"

    def _none_valid(self, problems: list[str]) -> NoValidSnapshotError:
        return NoValidSnapshotError(
            f"{len(problems)} snapshot(s) at {self.url} but none passes verification "
            f"({' | '.join(problems)[:1000]}); run 'elastic-train snapshots verify {self.url}', "
            "then repair or remove them, or point to another snapshot URL"
        )

    def load(
        self,
        step: int | None = None,
        *,
        into: Mapping[str, Any] | None = None,
        rank: int | None = None,
    ) -> LoadedSnapshot:
        """Load a verified snapshot (the newest valid one when ``step`` is None).

        ``into`` restores Stateful objects in place (RNG states last). ``rank`` loads only that
        rank's per-rank entry into ``rank_state``; without it ``per_rank`` holds all of them.
        """
        loaded = self._load_step(step, rank) if step is not None else self._load_newest(rank)
        if into is not None:
            restore_into(into, loaded.state, step=loaded.info.step)
        return loaded

    def _load_newest(self, rank: int | None) -> LoadedSnapshot:
        committed, _ = self._committed()
        if not committed:
            raise SnapshotNotFoundError(f"no committed snapshot at {self.url}")
        problems = []
        for step in committed:
            try:
                return self._load_step(step, rank)
            except SnapshotCorruptError as exc:
                problems.append(self._report_corrupt(step, str(exc)))
        raise self._none_valid(problems)

    def _load_step(self, step: int, rank: int | None) -> LoadedSnapshot:
        try:
            manifest = _reader.read_manifest(self._storage, step)
        except FileNotFoundError as exc:
            raise SnapshotNotFoundError(
                f"no committed snapshot of step {step} at {self.url}"
            ) from exc
        entry_files = manifest.entry_files()
        rank_files = manifest.rank_files()
        wanted = list(entry_files.values())
        if rank is not None:
            wanted += [rank_files[rank]] if rank in rank_files else []
        else:
            wanted += list(rank_files.values())
        data = _reader.verified_bytes(self._storage, step, manifest, wanted)  # before unpickling
        state = {
            k: deserialize(data[f.name], what=f"step {step} file {f.name}")
            for k, f in entry_files.items()
        }
        per_rank = {
            r: deserialize(data[f.name], what=f"step {step} file {f.name}")
            for r, f in rank_files.items()
            if f.name in data
        }
        info = SnapshotInfo.from_manifest(manifest, self._step_url(step))
        if rank is not None:
            return LoadedSnapshot(info=info, state=state, rank_state=per_rank.get(rank))
        return LoadedSnapshot(
            info=info, state=state, per_rank=[per_rank[r] for r in sorted(per_rank)]
        )

    # ------------------------------------------------------------- retention
    def prune(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` committed snapshots (and every keep_every-th)."""
        latest = self.latest()
        return self._prune(keep, latest.step if latest is not None else None)

    def _prune(self, keep: int, newest_verified: int | None) -> list[int]:
        committed, partial = self._committed()
        doomed = retention.steps_to_prune(
            committed, newest_verified=newest_verified, keep=keep, keep_every=self.keep_every
        )
        with self._lock:
            in_flight = set(self._in_flight)
        orphans = retention.orphans_to_clean(
            partial, newest_committed=committed[0] if committed else None, in_flight=in_flight
        )
        for step in doomed:
            # The manifest goes first: a half-deleted snapshot must read as uncommitted.
            self._storage.delete(layout.manifest_path(step))
            self._storage.delete(layout.step_dir(step))
        for step in orphans:
            self._storage.delete(layout.step_dir(step))
        self._clean_temp_files([s for s in committed if s not in doomed and s not in in_flight])
        if doomed:
            emit("snapshot.pruned", steps=doomed, url=self.url)
        return doomed

    def _clean_temp_files(self, steps: list[int]) -> None:
        """Temp files left by a writer killed mid-write, inside committed folders."""
        for step in steps:
            folder = layout.step_dir(step)
            for entry in self._storage.list(folder):
                if layout.is_temp_name(entry.name):
                    self._storage.delete(f"{folder}/{entry.name}")


def restore_into(into: Mapping[str, Any], state: Mapping[str, Any], *, step: int) -> None:
    """load_state_dict for every Stateful in ``into``; RNG states last (loading may draw)."""
    targets = [(k, v) for k, v in into.items() if is_stateful(v)]
    targets.sort(key=lambda kv: isinstance(kv[1], RNGState))
    for key, target in targets:
        if key not in state:
            raise SnapshotError(
                f"snapshot of step {step} has no entry {key!r} (it has {sorted(state)}); "
                "restore only entries that were saved"
            )
        target.load_state_dict(state[key])


def _json_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    meta = dict(metadata or {})
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as exc:
        raise UnsafeStateError(f"snapshot metadata must be JSON-serialisable: {exc}") from exc
    return meta


def _previous_failure(exc: SnapshotSaveError, handle: SaveHandle | None) -> SnapshotSaveError:
    error = SnapshotSaveError(
        f"an earlier asynchronous save failed: {exc}", step=exc.step, handle=handle
    )
    error.__cause__ = exc
    return error


def _close_at_exit(ref: weakref.ReferenceType[SnapshotStore]) -> None:
    store = ref()
    if store is None:
        return
    # A failure here was already reported as snapshot.failed when it happened.
    with contextlib.suppress(SnapshotError):
        store.close()

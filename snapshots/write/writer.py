"""The background writer: one thread, at most one save in flight, failures kept until told.

A failed save never raises into the training loop by itself; its error is kept here until
it is reported once, through its own handle or through the next save()/wait()/close().

The writer thread runs at a lower CPU priority (nice +``WRITER_NICENESS``) while it writes
asynchronous saves: on a node whose cores are all busy (torch's intra-op threads, other
ranks, other jobs) it takes ~1/10 of a core from the training thread instead of half. A
blocking save (the final snapshot, under a deadline) goes back to the process's priority
where the system allows a thread to raise its own again (root, or RLIMIT_NICE).

A second thread runs *chores*: best-effort work that must never hold up a save or the
training loop (the clean-up of a failed save, a probe of storage that is down).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

from snapshots.errors import SnapshotSaveError
from snapshots.info import SaveHandle, SnapshotInfo
from snapshots.storage.health import StorageHealth

# CFS weighs a nice +10 thread at ~1/10 of a nice 0 one: training keeps its core when both
# want it, and the writer still uses any core left idle at full speed.
WRITER_NICENESS = 10


class BackgroundWriter:
    def __init__(self, health: StorageHealth | None = None) -> None:
        self.health = health or StorageHealth()
        self._executor: cf.ThreadPoolExecutor | None = None
        self._chores: cf.ThreadPoolExecutor | None = None
        self._probe: cf.Future[None] | None = None
        self.pending: SaveHandle | None = None
        self._unreported: SnapshotSaveError | None = None
        self._in_flight: set[int] = set()
        self._lock = threading.Lock()

    def submit(
        self, step: int, write: Callable[[], SnapshotInfo], *, urgent: bool = False
    ) -> SaveHandle:
        """``urgent``: a blocking save, written at the process's own priority if allowed."""
        if self._executor is None:
            # One thread: at most one save in flight, and staging buffers are reused per save.
            self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="snapshot-writer")
        base = _priority(None)
        future = self._executor.submit(_at_priority, base, urgent, write)
        future.add_done_callback(lambda _: self.health.poke())
        handle = SaveHandle(step, future)
        self.pending = handle
        return handle

    def busy(self) -> bool:
        return self.pending is not None and not self.pending.done()

    def settle(self, *, until: float | None = None, unless_down: bool = False) -> bool:
        """Wait for the in-flight save; keep its error for the caller to see once.

        ``until`` (a ``time.monotonic()`` value): give up then. ``unless_down``: give up as
        soon as storage is down (the save is failing or retrying). Returns True once nothing
        is in flight, False when it gave up (the save stays pending)."""
        handle = self.pending
        if handle is None:
            return True
        if not handle.done():
            timeout = None if until is None else max(0.0, until - time.monotonic())
            if unless_down:
                self.health.wait_until(handle.done, timeout)
            elif handle._future is not None:
                cf.wait([handle._future], timeout)
            if not handle.done():
                return False
        self.pending = None
        exc = handle.exception()
        if isinstance(exc, SnapshotSaveError) and not handle.error_reported:
            self._unreported = exc
        return True

    def take_unreported(self) -> SnapshotSaveError | None:
        exc, self._unreported = self._unreported, None
        return exc

    def chore(self, fn: Callable[[], None]) -> cf.Future[None]:
        """Run ``fn`` off the training path, best effort: a failure is not raised."""
        if self._chores is None:
            self._chores = cf.ThreadPoolExecutor(1, thread_name_prefix="snapshot-chores")
        return self._chores.submit(_quietly, fn)

    def probe(self, fn: Callable[[], None]) -> None:
        """One storage probe at a time: its success marks storage as answering again."""
        if self._probe is None or self._probe.done():
            self._probe = self.chore(fn)

    @contextlib.contextmanager
    def tracking(self, step: int) -> Iterator[None]:
        """Marks ``step`` as being written, so housekeeping leaves its folder alone."""
        with self._lock:
            self._in_flight.add(step)
        try:
            yield
        finally:
            with self._lock:
                self._in_flight.discard(step)

    def in_flight(self) -> set[int]:
        with self._lock:
            return set(self._in_flight)

    def shutdown(self, *, wait: bool = True) -> None:
        """Stop both threads; ``wait=False`` when a save ran past its deadline (it was
        cancelled and ends after its current storage call, bounded by the storage deadline)."""
        for executor in (self._executor, self._chores):
            if executor is not None:
                executor.shutdown(wait=wait)


def _priority(tid: int | None) -> int | None:
    """A thread's nice value (None: the calling process's), None where there is none."""
    try:
        return os.getpriority(os.PRIO_PROCESS, tid or 0)
    except (AttributeError, OSError):  # no getpriority (Windows)
        return None


def _at_priority(base: int | None, urgent: bool, write: Callable[[], SnapshotInfo]) -> SnapshotInfo:
    """Runs on the writer thread: set its own nice value (Linux applies setpriority with a
    thread id to that one thread), then write. Best effort: the save runs either way."""
    if base is not None:
        tid = threading.get_native_id()
        wanted = base if urgent else base + WRITER_NICENESS
        if _priority(tid) != wanted:
            with contextlib.suppress(OSError):  # raising it back needs root or RLIMIT_NICE
                os.setpriority(os.PRIO_PROCESS, tid, wanted)
    return write()


def _quietly(fn: Callable[[], None]) -> None:
    # Best effort by design: what matters (a failed save, storage being down) was already
    # reported; a storage failure here also marks storage as down (StorageHealth).
    with contextlib.suppress(Exception):
        fn()


def previous_failure(exc: SnapshotSaveError, handle: SaveHandle | None) -> SnapshotSaveError:
    error = SnapshotSaveError(
        f"an earlier asynchronous save failed: {exc}", step=exc.step, handle=handle
    )
    error.__cause__ = exc
    return error

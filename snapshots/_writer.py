"""The background writer: one thread, at most one save in flight, failures kept until told.

A failed save never raises into the training loop by itself; its error is kept here until
it is reported once, through its own handle or through the next save()/wait()/close().
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
from collections.abc import Callable, Iterator

from snapshots.errors import SnapshotSaveError
from snapshots.info import SaveHandle, SnapshotInfo


class BackgroundWriter:
    def __init__(self) -> None:
        self._executor: cf.ThreadPoolExecutor | None = None
        self.pending: SaveHandle | None = None
        self._unreported: SnapshotSaveError | None = None
        self._in_flight: set[int] = set()
        self._lock = threading.Lock()

    def submit(self, step: int, write: Callable[[], SnapshotInfo]) -> SaveHandle:
        if self._executor is None:
            # One thread: at most one save in flight, and staging buffers are reused per save.
            self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="snapshot-writer")
        handle = SaveHandle(step, self._executor.submit(write))
        self.pending = handle
        return handle

    def busy(self) -> bool:
        return self.pending is not None and not self.pending.done()

    def settle(self) -> None:
        """Wait for the in-flight save; keep its error for the caller to see once."""
        handle, self.pending = self.pending, None
        if handle is None:
            return
        if handle._future is not None:
            cf.wait([handle._future])
        exc = handle.exception()
        if isinstance(exc, SnapshotSaveError) and not handle.error_reported:
            self._unreported = exc

    def take_unreported(self) -> SnapshotSaveError | None:
        exc, self._unreported = self._unreported, None
        return exc

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

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

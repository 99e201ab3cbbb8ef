"""Whether the storage behind a store is answering: shared by the training and writer threads.

Storage is *down* from a transient failure (a refused or timed-out attempt, a 5xx) until any
storage call succeeds again. The store reads this to skip periodic snapshots instead of
making the training loop wait for a save that is failing (``SnapshotStore.save``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class StorageHealth:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._error: str | None = None  # the transient failure since storage last answered

    @property
    def down(self) -> bool:
        return self._error is not None

    @property
    def error(self) -> str | None:
        return self._error

    def failed(self, error: str) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def answered(self) -> None:
        if self._error is None:
            return  # the common case: no lock per storage call
        with self._cond:
            self._error = None
            self._cond.notify_all()

    def poke(self) -> None:
        """Wake ``wait_until`` callers to re-check their condition (e.g. a future finished)."""
        with self._cond:
            self._cond.notify_all()

    def wait_until(self, done: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until ``done()`` or storage is down, at most ``timeout`` s; returns ``done()``.
        Whoever makes ``done()`` true must call ``poke``."""
        with self._cond:
            self._cond.wait_for(lambda: done() or self._error is not None, timeout)
        return done()

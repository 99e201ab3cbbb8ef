"""Deadlines of a store's blocking calls (a preemption's final snapshot must not outlive the
grace period): the innermost ``block`` wins; its end is a ``time.monotonic()`` value."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from snapshots.errors import SnapshotSaveError


class Deadline:
    def __init__(self) -> None:
        self._active: tuple[float, float] | None = None  # (seconds, monotonic end)

    @contextlib.contextmanager
    def block(self, seconds: float | None) -> Iterator[None]:
        if seconds is None:
            yield
            return
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
            raise ValueError(f"deadline_s must be seconds >= 0 or None, got {seconds!r}")
        outer = self._active
        self._active = (float(seconds), time.monotonic() + seconds)
        try:
            yield
        finally:
            self._active = outer

    def end(self) -> float | None:
        return None if self._active is None else self._active[1]

    def error(self, url: str, step: int | None, what: str) -> SnapshotSaveError:
        seconds = self._active[0] if self._active is not None else 0.0
        return SnapshotSaveError(
            f"gave up on the snapshot of step {step} at {url} after its deadline of "
            f"deadline_s={seconds:g} s: {what} writing (storage slow or down); the newest "
            "committed snapshot stays the one to resume from",
            step=step,
        )

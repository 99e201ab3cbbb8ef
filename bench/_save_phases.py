"""Per-phase, per-rank timings of our saves (``bench/sharded_snapshot.py --phases``).

Wraps the save path's functions in the worker process with timers (the library carries no
timing code): each phase's seconds are summed per save on each rank, whatever thread ran
them. Phases on different threads overlap (the shard hash runs beside the write), so they
need not add up to the wall time. ``writer`` is the whole background write of one save.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from snapshots import store
from snapshots.format import manifest
from snapshots.sharded import shards as _shards
from snapshots.storage import local as _local_storage
from snapshots.write import commit as _commit
from snapshots.write import sharded_commit as _sharded_commit

_lock = threading.Lock()
_totals: dict[str, float] = {}


def _add(phase: str, seconds: float) -> None:
    with _lock:
        _totals[phase] = _totals.get(phase, 0.0) + seconds


def _timed(phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        begun = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _add(phase, time.perf_counter() - begun)

    return wrapper


class _TimedHasher:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def update(self, data: Any) -> None:
        begun = time.perf_counter()
        self._inner.update(data)
        _add("hash", time.perf_counter() - begun)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


# (owner, attribute, phase): what each phase times. Functions found at call time through
# their module or class attribute, so patching these covers every caller.
_PHASES: list[tuple[Any, str, str]] = [
    (_shards.ShardStager, "stage", "stage copy"),
    (_local_storage, "_fsync_dir", "fsync dir"),
    (_sharded_commit, "_check_written", "read-back (own shard)"),  # before O_DIRECT only
    (_sharded_commit, "_verify_commit", "verify commit (rank 0)"),
    (_commit.Committer, "_verify_fully", "verify (read back)"),
    (_sharded_commit, "_gather", "gather reports"),
    (_sharded_commit, "_broadcast", "broadcast outcome"),
    (_commit.Committer, "_put_manifest", "manifest write"),
    (store.SnapshotStore, "_prune_after_save", "retention"),
    (store.SnapshotStore, "_write", "writer (total)"),
]


def install() -> None:
    """Wrap the phases' functions (once per process). ``fsync`` times every file fsync
    (directory fsyncs are ``fsync dir``, counted in both)."""
    for owner, name, phase in _PHASES:
        if hasattr(owner, name):  # an older checkout (a before/after comparison) may lack it
            setattr(owner, name, _timed(phase, getattr(owner, name)))
    if hasattr(_local_storage._Sink, "_write_large"):  # large writes, O_DIRECT where possible
        for name in ("_write_large", "flush"):
            setattr(
                _local_storage._Sink, name, _timed("write", getattr(_local_storage._Sink, name))
            )
    else:  # an older checkout: every write went through _write_all
        _local_storage._write_all = _timed("write", _local_storage._write_all)
    os.fsync = _timed("fsync", os.fsync)
    real_hasher = manifest.hasher
    manifest.hasher = lambda algorithm: _TimedHasher(real_hasher(algorithm))


def take() -> dict[str, float]:
    """This rank's phase seconds since the last call."""
    with _lock:
        out = dict(_totals)
        _totals.clear()
    return out

"""Atomic, verified, asynchronous training snapshots on any fsspec URL.

Usable on its own (it does not import elastic_trainer)::

    from snapshots import SnapshotStore
    store = SnapshotStore("s3://bucket/run-1", keep=3)
    store.save(step, {"model": model, "optimizer": opt, "rng": RNGState()})
    loaded = store.load(into={"model": model, "optimizer": opt, "rng": RNGState()})
"""

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
from snapshots.info import LoadedSnapshot, SaveHandle, SnapshotInfo, VerifyResult
from snapshots.retry import RetryPolicy
from snapshots.rng import RNGState, capture_rng_state, restore_rng_state
from snapshots.serialization import Stateful
from snapshots.store import SnapshotStore

__all__ = [
    "LoadedSnapshot",
    "NoValidSnapshotError",
    "RNGState",
    "RetryPolicy",
    "SaveHandle",
    "SnapshotCorruptError",
    "SnapshotError",
    "SnapshotExistsError",
    "SnapshotInfo",
    "SnapshotNotFoundError",
    "SnapshotSaveError",
    "SnapshotStore",
    "Stateful",
    "StorageError",
    "UnsafeStateError",
    "VerifyResult",
    "capture_rng_state",
    "restore_rng_state",
]

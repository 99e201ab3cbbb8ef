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
    SnapshotOwnerError,
    SnapshotSaveError,
    StorageError,
    UnsafeStateError,
)
from snapshots.info import LoadedSnapshot, SaveHandle, SnapshotInfo, VerifyResult
from snapshots.ownership import Owner
from snapshots.retry import DEFAULT_STORAGE_TIMEOUT_S, RetryPolicy
from snapshots.rng import RNGState, capture_rng_state, restore_rng_state
from snapshots.serialization import Stateful
from snapshots.store import SnapshotStore

__all__ = [
    "DEFAULT_STORAGE_TIMEOUT_S",
    "LoadedSnapshot",
    "NoValidSnapshotError",
    "Owner",
    "RNGState",
    "RetryPolicy",
    "SaveHandle",
    "SnapshotCorruptError",
    "SnapshotError",
    "SnapshotExistsError",
    "SnapshotInfo",
    "SnapshotNotFoundError",
    "SnapshotOwnerError",
    "SnapshotSaveError",
    "SnapshotStore",
    "Stateful",
    "StorageError",
    "UnsafeStateError",
    "VerifyResult",
    "capture_rng_state",
    "restore_rng_state",
]

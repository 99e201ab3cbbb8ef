"""Atomic, verified, asynchronous training snapshots on any fsspec URL.

Usable on its own (it does not import elastic_trainer)::

    from snapshots import SnapshotStore
    store = SnapshotStore("s3://bucket/run-1", keep=3)
    store.save(step, {"model": model, "optimizer": opt, "rng": RNGState()})
    loaded = store.load(into={"model": model, "optimizer": opt, "rng": RNGState()})
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
from snapshots.storage.retry import DEFAULT_STORAGE_TIMEOUT_S, RetryPolicy

# name -> module, imported on first use: these need torch, and the read-only tools
# (``elastic-train snapshots list``...) must start without paying for it.
_LAZY = {
    "SnapshotStore": "snapshots.store",
    "Stateful": "snapshots.format.serialization",
    "RNGState": "snapshots.format.rng",
    "capture_rng_state": "snapshots.format.rng",
    "restore_rng_state": "snapshots.format.rng",
}

if TYPE_CHECKING:
    from snapshots.format.rng import RNGState, capture_rng_state, restore_rng_state
    from snapshots.format.serialization import Stateful
    from snapshots.store import SnapshotStore


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'snapshots' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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

"""Carrying out retention: the pure rules in ``retention`` decide, this module deletes."""

from __future__ import annotations

import time
from collections.abc import Collection

from snapshots import retention
from snapshots.errors import SnapshotCorruptError
from snapshots.events import emit
from snapshots.format import layout
from snapshots.read import reader
from snapshots.read.catalog import Catalog
from snapshots.storage import Storage

# Strays younger than this may belong to a writer still running (SnapshotStore.stray_grace_s).
DEFAULT_STRAY_GRACE_S = 60.0


def prune(
    storage: Storage,
    catalog: Catalog,
    *,
    keep: int,
    keep_every: int | None,
    newest_verified: int | None,
    in_flight: Collection[int],
    stray_grace_s: float,
) -> list[int]:
    """Delete old snapshots, orphaned partial writes and strays in committed folders. Returns
    the pruned steps. ``newest_verified`` must be a step that passed verification (or None)."""
    committed, partial = catalog.committed()
    doomed = retention.steps_to_prune(
        committed, newest_verified=newest_verified, keep=keep, keep_every=keep_every
    )
    orphans = retention.orphans_to_clean(
        partial, newest_committed=committed[0] if committed else None, in_flight=in_flight
    )
    for step in doomed:
        # The manifest goes first: a half-deleted snapshot must read as uncommitted.
        storage.delete(layout.manifest_path(step))
        storage.delete(layout.step_dir(step))
    for step in orphans:
        storage.delete(layout.step_dir(step))
    kept = [s for s in committed if s not in doomed and s not in in_flight]
    _sweep_strays(storage, kept, grace_s=stray_grace_s)
    if doomed:
        emit("snapshot.pruned", steps=doomed, url=catalog.url)
    return doomed


def _sweep_strays(storage: Storage, steps: list[int], *, grace_s: float) -> None:
    """Files of committed folders that their manifest does not list (see ``retention``)."""
    for step in steps:
        folder = layout.step_dir(step)
        entries = [e for e in storage.list(folder) if not e.is_dir]
        if not retention.may_hold_strays(e.name for e in entries):
            continue
        try:
            manifest = reader.read_manifest(storage, step)
        except (FileNotFoundError, SnapshotCorruptError):
            continue  # pruned meanwhile, or unreadable: strays cannot be told from data
        strays = retention.strays_to_sweep(
            [(e.name, e.mtime) for e in entries],
            listed={f.name for f in manifest.files},
            now=time.time(),
            grace_s=grace_s,
        )
        for name in strays:
            storage.delete(f"{folder}/{name}")

"""``snapshots export``: one plain state dict of full tensors, from any snapshot format.

A single process, no process group: a sharded snapshot's chunks are assembled into full
tensors (the load planner with full-size templates), a format-1 snapshot is read as it is.
The result holds only plain values and tensors, so ``torch.load(FILE, weights_only=True)``
reads it. Written to a temporary file beside the target, then renamed: never half a file.
"""

from __future__ import annotations

import os
import tempfile

import torch

from snapshots.format import sharding
from snapshots.read.catalog import Catalog


def export(catalog: Catalog, step: int, path: str) -> int:
    """Write step ``step`` to ``path``; returns how many tensors it holds."""
    loaded = catalog.load_step(step, None)  # verified; sharded -> full tensors
    state = dict(loaded.state)
    _, tensors = sharding.split(state, ())
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".export-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(state, fh)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return len(tensors)

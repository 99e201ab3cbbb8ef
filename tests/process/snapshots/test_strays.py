"""A writer that lost the race for a step and was killed leaves files in the committed folder.

The loser is a forked process SIGKILLed mid-file (through the faults hook) after it wrote one
data file and half of another; the winner then commits the same step. Housekeeping leaves
the loser's files alone while they are young (it could still be running) and sweeps them
once older than the grace period; the committed snapshot is untouched throughout.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from snapshots import SnapshotStore
from snapshots.format import layout
from snapshots.storage import faults


def _state(step: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 8, generator=gen), "b": torch.randn(8, generator=gen)}


def _crashed_loser(root: str, step: int) -> None:
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        try:
            faults.inject(faults.KillAt("mid_file", 2))
            SnapshotStore(root, async_save=False).save(step, _state(100 + step))
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_crashed_losers_files_are_swept_once_older_than_the_grace(tmp_path: Path) -> None:
    root = str(tmp_path)
    _crashed_loser(root, 1)
    folder = tmp_path / layout.step_dir(1)
    loser = _names(folder)
    assert any(layout.is_temp_name(n) for n in loser) and len(loser) == 2
    store = SnapshotStore(root, async_save=False, keep=5)
    store.save(1, _state(1))  # the winner commits into the folder the loser wrote to
    winner = _names(folder) - loser
    assert layout.MANIFEST_NAME in winner and len(winner) == 3

    store.save(2, _state(2))
    assert _names(folder) == winner | loser  # young: the loser might still be running
    old = time.time() - 2 * store.stray_grace_s
    for name in loser:
        os.utime(folder / name, (old, old))
    store.save(3, _state(3))
    assert _names(folder) == winner
    loaded = store.load(1)
    assert torch.equal(loaded.state["w"], _state(1)["w"])  # type: ignore[arg-type]
    assert store.verify(1).ok


def test_unreadable_manifest_means_nothing_is_swept(tmp_path: Path) -> None:
    """Without the manifest, strays cannot be told from the snapshot's own data."""
    store = SnapshotStore(str(tmp_path), async_save=False, keep=5)
    store.stray_grace_s = 0.0
    store.save(1, _state(1))
    folder = tmp_path / layout.step_dir(1)
    (folder / layout.entry_file_name(0, "w", "0badf00d")).write_bytes(b"stray")
    (folder / layout.MANIFEST_NAME).write_bytes(b"{not json")
    before = _names(folder)
    store.save(2, _state(2))
    assert _names(folder) == before

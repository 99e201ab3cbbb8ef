"""A backend handed to SnapshotStore is the one it writes through, retries on top."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from snapshots import SnapshotStore
from snapshots.storage import LocalStorage


def test_a_passed_storage_is_used_under_the_retrying_layer(tmp_path: Path) -> None:
    backend = LocalStorage(str(tmp_path))
    store = SnapshotStore(str(tmp_path), async_save=False, storage=backend)
    assert store.storage.inner is backend and store.url == backend.url
    store.save(1, {"w": torch.ones(2)})
    assert SnapshotStore(str(tmp_path)).committed_steps() == [1]


def test_storage_options_with_a_passed_storage_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pass them to the storage you construct"):
        SnapshotStore(
            str(tmp_path),
            storage=LocalStorage(str(tmp_path)),
            storage_options={"direct_io": False},
        )

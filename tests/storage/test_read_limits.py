"""Reads with a limit, on every backend: at most ``limit`` bytes come back, or the file is
reported too large (damage), never read whole."""

from __future__ import annotations

import pytest

from snapshots.errors import FileTooLargeError, SnapshotCorruptError
from snapshots.storage import open_storage

from .conftest import Backend


def test_a_limit_bounds_every_read(backend: Backend) -> None:
    storage = open_storage(backend.url, storage_options=backend.storage_options)
    storage.check(create=True)
    storage.write("step-000000000001/a.pt", b"0123456789")
    assert storage.read("step-000000000001/a.pt", limit=10) == b"0123456789"
    assert storage.read("step-000000000001/a.pt") == b"0123456789"
    with pytest.raises(FileTooLargeError, match="more than the 9 bytes"):
        storage.read("step-000000000001/a.pt", limit=9)
    assert issubclass(FileTooLargeError, SnapshotCorruptError)  # damage, not an outage
    with pytest.raises(FileNotFoundError):
        storage.read("step-000000000001/missing.pt", limit=9)

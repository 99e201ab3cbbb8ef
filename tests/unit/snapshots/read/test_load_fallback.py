"""A snapshot whose checksums match but that does not load is skipped like any damage: the
training path (DistributedSnapshotter, here as rank 0 of 1) falls back to an older one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from snapshots import NoValidSnapshotError, SnapshotStore
from snapshots.distributed import DistributedSnapshotter
from tests.tamper import evil_bytes, resign


def _store(root: Path) -> SnapshotStore:
    store = SnapshotStore(str(root), async_save=False, keep=None)
    for step in (1, 2):
        store.save(step, {"model": torch.nn.Linear(2, 2), "step": step})
    return store


def _corrupt_events(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] == "snapshot.corrupt"]


def test_a_refused_pickle_falls_back_and_never_runs(tmp_path: Path) -> None:
    root = tmp_path / "snaps"
    store = _store(root)
    sentinel = tmp_path / "pwned"
    resign(root, 2, lambda f: f.get("key") == "model", evil_bytes(sentinel))
    assert store.verify(2).ok  # checksums cannot tell; only the loader can
    model = torch.nn.Linear(2, 2)
    with capture_logs() as logs:
        loaded = DistributedSnapshotter(store).load(into={"model": model})
    assert loaded is not None and loaded.info.step == 1 and loaded.state["step"] == 1
    assert torch.equal(model.weight, loaded.state["model"]["weight"])
    (event,) = _corrupt_events(logs)
    assert event["step"] == 2 and "GLOBAL posix.system" in event["problem"]
    assert "False" not in event["problem"] and "safe_globals" not in event["problem"]
    assert not sentinel.exists()


def test_a_missing_entry_falls_back(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.save(3, {"other": 1})
    loaded = DistributedSnapshotter(store).load(into={"model": torch.nn.Linear(2, 2)})
    assert loaded is not None and loaded.info.step == 2


def test_a_damaged_per_rank_file_falls_back(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path), async_save=False, keep=None)
    for step in (1, 2):
        store.save(step, {"w": torch.ones(2) * step}, per_rank=[{"r": step}])
    resign(tmp_path, 2, lambda f: f.get("rank") == 0, b"not a torch file")
    loaded = DistributedSnapshotter(store).load()
    assert loaded is not None and loaded.rank_state == {"r": 1}


def test_none_loads_is_an_error_naming_each(tmp_path: Path) -> None:
    root = tmp_path / "snaps"
    store = _store(root)
    for step in (1, 2):
        resign(root, step, lambda f: f.get("key") == "step", b"garbage")
    with capture_logs() as logs, pytest.raises(NoValidSnapshotError, match="none loads"):
        DistributedSnapshotter(store).load()
    assert [e["step"] for e in _corrupt_events(logs)] == [2, 1]


def test_an_explicit_step_does_not_fall_back(tmp_path: Path) -> None:
    root = tmp_path / "snaps"
    store = _store(root)
    resign(root, 2, lambda f: f.get("key") == "step", b"garbage")
    with pytest.raises(NoValidSnapshotError, match="step 2"):
        DistributedSnapshotter(store).load(2)
    with pytest.raises(NoValidSnapshotError, match="no committed snapshot of step 9"):
        DistributedSnapshotter(store).load(9)

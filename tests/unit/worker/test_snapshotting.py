"""The session's periodic snapshots overlap their copy with the next forward/backward."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import BinaryIO, TypeVar

import pytest
import torch

from elastic_trainer.worker import snapshotting
from elastic_trainer.worker.snapshotting import SessionSnapshots, sole_optimizer
from snapshots import Owner, SnapshotOwnerError, SnapshotSaveError, SnapshotStore
from snapshots.storage import LocalStorage

T = TypeVar("T")


class Stalled(LocalStorage):
    """Local disk whose data files (written streamed) wait for ``release``."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.entered, self.release = threading.Event(), threading.Event()

    def write_streamed(
        self, path: str, fill: Callable[[BinaryIO], T], *, exclusive: bool = False
    ) -> T:
        self.entered.set()
        assert self.release.wait(30)
        return super().write_streamed(path, fill, exclusive=exclusive)


def _model_and_optimizer():
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_sole_optimizer_only_when_unambiguous() -> None:
    model, opt = _model_and_optimizer()
    _, other = _model_and_optimizer()
    assert sole_optimizer({"model": model, "optimizer": opt}) is opt
    assert sole_optimizer({"model": model}) is None
    assert sole_optimizer({"a": opt, "b": other}) is None


def test_periodic_saves_overlap_and_final_saves_do_not(tmp_path, monkeypatch) -> None:
    seen: list[object] = []
    original = SnapshotStore.save

    def spy(self, step, state, **kwargs):
        seen.append(kwargs.get("overlap_with"))
        return original(self, step, state, **kwargs)

    monkeypatch.setattr(SnapshotStore, "save", spy)
    model, opt = _model_and_optimizer()
    snaps = SessionSnapshots(str(tmp_path), keep=3)
    state = {"model": model, "optimizer": opt}
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    snaps.save(1, state, epoch=0, blocking=False)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()  # waits in the pre-hook until the overlapped copy is done
    snaps.save(2, state, epoch=0, blocking=True)
    snaps.close()
    assert seen == [opt, None]
    restored = {"model": torch.nn.Linear(4, 2)}
    SnapshotStore(str(tmp_path)).load(step=1, into=restored)
    saved = restored["model"].state_dict()
    assert all(torch.equal(saved[k], at_save[k]) for k in at_save)  # before the step
    assert not torch.equal(saved["weight"], model.weight.detach())  # the step did change them


def test_a_final_save_past_its_deadline_raises_and_commits_nothing(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stalled = Stalled(str(tmp_path))
    # SessionSnapshots builds its own store: hand it the stalling disk through the constructor
    seams = functools.partial(SnapshotStore, storage=stalled)
    monkeypatch.setattr(snapshotting, "SnapshotStore", seams)
    snaps = SessionSnapshots(str(tmp_path), keep=3, storage_timeout=5)
    assert snaps.store.storage.policy.deadline_s == 5
    with pytest.raises(SnapshotSaveError, match=r"deadline_s=0\.1 s"):
        snaps.save(4, {"w": torch.ones(2)}, epoch=0, blocking=True, deadline_s=0.1)
    assert stalled.entered.is_set() and snaps.last_saved_step is None
    stalled.release.set()
    snaps.close_local()
    assert SnapshotStore(str(tmp_path)).latest() is None  # cancelled before its manifest


def test_owner_reaches_the_store(tmp_path) -> None:
    SessionSnapshots(str(tmp_path), keep=3, owner=Owner(job_id="a", run_token="r1"))
    with pytest.raises(SnapshotOwnerError, match="belongs to job 'a'"):
        SessionSnapshots(str(tmp_path), keep=3, owner=Owner(job_id="b", run_token="r2"))


def test_a_skipped_periodic_save_does_not_skip_the_final_one(tmp_path) -> None:
    """Regression: a periodic save skipped while storage was down still counted as saved,
    so a preemption at that very step skipped its final snapshot too."""
    import torch

    from elastic_trainer.worker.snapshotting import SessionSnapshots

    snaps = SessionSnapshots(str(tmp_path / "s"), keep=3)
    state = {"model": torch.nn.Linear(2, 2)}
    snaps.store.storage.health.failed("down for the test")
    snaps.save(5, state, epoch=0, blocking=False)  # skipped: storage is down
    assert snaps.last_saved_step is None
    snaps.save(5, state, epoch=0, blocking=True, deadline_s=30)
    assert [i.step for i in snaps.store.list()] == [5] and snaps.last_saved_step == 5
    snaps.save(5, state, epoch=0, blocking=True)  # committed already: nothing to do
    snaps.close()


def test_a_final_save_after_the_same_periodic_step_is_not_written_twice(tmp_path) -> None:
    import torch

    from elastic_trainer.worker.snapshotting import SessionSnapshots

    snaps = SessionSnapshots(str(tmp_path / "s"), keep=3)
    state = {"model": torch.nn.Linear(2, 2)}
    snaps.save(7, state, epoch=0, blocking=False)
    snaps.save(7, state, epoch=0, blocking=True)  # flushes, sees 7 committed: no second write
    assert [i.step for i in snaps.store.list()] == [7]
    snaps.close()

"""A stop by the supervisor restarting the group resumes from the in-memory copy: no storage
save to wait for. A preemption still saves to storage (the memory copy dies with the node).

One process, a world of one on an in-memory store (as tests/unit/worker/test_session.py)."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic_trainer.contract import protocol
from elastic_trainer.worker.context import WorkerContext, WorkerSettings
from elastic_trainer.worker.memory.tier import NodeCopies
from elastic_trainer.worker.session import TrainingSession


@pytest.fixture(autouse=True)
def _clean():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as in a fresh worker
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _stopped_by_supervisor(tmp_path, marker: str) -> TrainingSession:
    """Two steps, then the supervisor's marker file and SIGTERM; the session stops at 3."""
    control = tmp_path / "control"
    control.mkdir()
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    settings = WorkerSettings(
        control_dir=str(control), memory_dir=str(tmp_path / "memory"), memory_snapshot_every=1
    )
    session = TrainingSession(
        {"model": model, "optimizer": optimizer},
        context=WorkerContext(settings=settings),
        snapshot_dir=str(tmp_path / "snapshots"),
        snapshot_every=100,
        configure_logs=False,
    )
    x = torch.randn(4, 3)
    while not session.should_stop:
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        session.step_done()
        if session.step == 2:
            (control / marker).touch()
            os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(SystemExit):
        session.finish()
    return session


def _storage_steps(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "snapshots").iterdir() if p.name.startswith("step-"))


def test_a_restart_resumes_from_this_steps_memory_copy_without_a_storage_save(tmp_path):
    session = _stopped_by_supervisor(tmp_path, protocol.RESTART_FILE)
    assert (session.stop_reason, session.step) == ("restarting", 3)
    assert NodeCopies(str(tmp_path / "memory")).newest() == 3  # what the new group restores
    assert _storage_steps(tmp_path) == []


def test_a_preemption_still_saves_to_storage_with_the_memory_tier_on(tmp_path):
    session = _stopped_by_supervisor(tmp_path, protocol.STOP_FILE)
    assert (session.stop_reason, session.step) == ("preempted", 3)
    assert _storage_steps(tmp_path) == ["step-000000000003"]


def test_a_restart_whose_memory_copy_failed_saves_to_storage_after_all(tmp_path, monkeypatch):
    # The step's copy failed (tmpfs full): skipping the storage save would lose the step.
    write = NodeCopies.write

    def full_at_step_3(self, step, *args, **kwargs):
        if step == 3:
            raise OSError(28, "No space left on device")
        return write(self, step, *args, **kwargs)

    monkeypatch.setattr(NodeCopies, "write", full_at_step_3)
    session = _stopped_by_supervisor(tmp_path, protocol.RESTART_FILE)
    assert (session.stop_reason, session.step) == ("restarting", 3)
    assert NodeCopies(str(tmp_path / "memory")).newest() == 2
    assert _storage_steps(tmp_path) == ["step-000000000003"]

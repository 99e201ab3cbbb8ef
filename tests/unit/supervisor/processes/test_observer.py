"""The observer's bookkeeping per monitor tick (processes/observer.py)."""

from __future__ import annotations

from typing import Any

from elastic_trainer.supervisor.processes import observer as observer_module
from elastic_trainer.supervisor.processes.observer import GroupObserver


class _Trees:
    """A ProcessTracker that counts its scans."""

    def __init__(self) -> None:
        self.scans = 0

    def refresh(self) -> None:
        self.scans += 1

    def resources(self) -> dict[int, Any]:
        return {}


def test_the_process_trees_are_scanned_once_a_second_not_every_tick(tmp_path, monkeypatch):
    """A scan reads every process of the machine: at each 0.2 s tick it was most of an idle
    agent's CPU. The supervisor is the child subreaper, so an orphan between two scans is
    still its child."""
    now = [1000.0]
    monkeypatch.setattr(observer_module.time, "monotonic", lambda: now[0])
    trees = _Trees()
    watch = GroupObserver(procs=trees, hang_timeout=0, resources_interval=3600)  # type: ignore[arg-type]
    watch.attempt_started(now[0])
    ticks = 0
    while now[0] < 1004.0:  # 4 s of 0.2 s ticks, no resources sample due
        watch.observe(str(tmp_path), local_world_size=1, world_size=1, global_rank=lambda r: r)
        ticks += 1
        now[0] += 0.2
    assert ticks == 20
    assert trees.scans == 4

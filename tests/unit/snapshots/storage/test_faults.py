"""The fault-injection seam: nothing happens without an injector; ``KillAt`` kills at the
n-th reach of its point (of its step), after leaving what a kill halfway leaves."""

from __future__ import annotations

import os
import signal

import pytest

from snapshots.storage import faults


@pytest.fixture
def kills(monkeypatch: pytest.MonkeyPatch):
    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: seen.append((pid, sig)))
    yield seen
    faults.inject(None)


def test_without_an_injector_a_point_does_nothing(kills) -> None:
    faults.inject(None)
    for point in faults.POINTS:
        faults.hit(point, step=1)
    assert kills == [] and not faults.injected()


def test_kill_at_the_nth_reach_of_its_point_only(kills) -> None:
    faults.inject(faults.KillAt.parse("mid_file:3"))
    assert faults.injected()
    faults.hit("mid_file")
    faults.hit("before_data")  # another point: not counted
    faults.hit("mid_file")
    assert kills == []
    faults.hit("mid_file")
    assert kills == [(os.getpid(), signal.SIGKILL)]
    faults.hit("mid_file")  # the 4th reach: the process would be gone; nothing more
    assert len(kills) == 1


def test_kill_at_a_step_counts_that_step_and_tears_first(kills) -> None:
    order: list[str] = []
    faults.inject(faults.KillAt("mid_memory_write", step=9))
    faults.hit("mid_memory_write", step=8, torn=lambda: order.append("torn 8"))
    assert kills == [] and order == []
    faults.hit("mid_memory_write", step=9, torn=lambda: order.append("torn 9"))
    assert order == ["torn 9"] and len(kills) == 1


def test_an_unknown_point_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown fault point 'mid_fiel': one of before_data"):
        faults.KillAt.parse("mid_fiel:2")

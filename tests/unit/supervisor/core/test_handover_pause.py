"""group.handed_over's pause_s: the join's cost on the workers' own step clock."""

from __future__ import annotations

import pytest

from elastic_trainer.supervisor.core.handover_pause import (
    HandedOver,
    last_step_time,
    pause_s,
    step_time,
)
from elastic_trainer.supervisor.core.ledger import Attempt
from elastic_trainer.supervisor.core.watchdog import Progress


def attempt(*records: tuple[int, float], restored: int | None = None) -> Attempt:
    """An attempt that saw these (step, time) records, in order, one per tick."""
    a = Attempt()
    for step, t in records:
        a.observe({0: Progress(step=step, restored_step=restored, time=t)})
    return a


# the old group: restored step 100 at 50.0 (its session's start), steps of 0.1 s from 51.0
OLD = attempt((100, 50.0), (101, 51.0), (105, 51.4), (110, 51.9), restored=100)
PENDING = HandedOver(ready=True, start_s=0.4, stop_s=0.05, last_time=51.9,
                     step_s=step_time(OLD))  # fmt: skip


def test_the_step_time_counts_from_the_first_step_made_not_the_sessions_start() -> None:
    assert step_time(OLD) == pytest.approx(0.1)
    assert step_time(attempt((100, 50.0), (101, 51.0), restored=100)) is None
    assert step_time(None) is None


def test_the_pause_is_the_time_without_steps() -> None:
    # the new group restored step 110 and was seen at step 112 at 52.4: 0.5 s, 2 steps of 0.1
    assert pause_s(last_time=51.9, step_s=0.1, restored_step=110, seen_step=112,
                   seen_time=52.4) == pytest.approx(0.3)  # fmt: skip


def test_the_event_waits_for_the_new_workers_first_step() -> None:
    new = attempt((110, 52.0), restored=110)  # the new sessions started: no step yet
    assert PENDING.fields(new) is None
    new.observe({0: Progress(step=111, restored_step=110, time=52.25)})
    fields = PENDING.fields(new)
    assert fields == {"ready": True, "start_s": 0.4, "stop_s": 0.05,
                      "pause_s": pytest.approx(0.25)}  # fmt: skip


def test_an_attempt_that_ends_without_a_step_reports_no_pause() -> None:
    new = attempt((110, 52.0), restored=110)
    assert PENDING.fields(new, ended=True) == {"ready": True, "start_s": 0.4, "stop_s": 0.05,
                                               "pause_s": None}  # fmt: skip


def test_unmeasured_old_steps_give_no_pause() -> None:
    pending = HandedOver(ready=False, start_s=60.0, stop_s=2.0, last_time=None, step_s=None)
    new = attempt((110, 52.0), (111, 52.3), restored=110)
    assert pending.fields(new)["pause_s"] is None  # type: ignore[index]


def test_the_old_workers_last_step_is_their_latest_record() -> None:
    assert last_step_time({0: Progress(step=5, time=3.0), 1: Progress(step=5, time=3.1)}) == 3.1
    assert last_step_time({}) is None

"""What restarts cost: measured from progress reports, unknown (with a bound) without them."""

from __future__ import annotations

import pytest

from elastic_trainer.contract.events import UNMEASURED_CAUSES
from elastic_trainer.supervisor.core.ledger import Ledger, LostWork
from elastic_trainer.supervisor.core.watchdog import Progress


def plain_failed_once() -> Ledger:
    """A script that reports nothing: started at 100, failed at 106, restarted at 110."""
    ledger = Ledger()
    ledger.start_attempt(now=100.0)
    ledger.observe({}, world_size=2)
    ledger.failed(cause="signal", now=106.0, world_size=2)
    ledger.start_attempt(now=110.0)
    return ledger


def test_a_plain_script_restart_is_unmeasured_with_its_bound() -> None:
    ledger = plain_failed_once()
    fields = ledger.unmeasured_restart(world_size=1)
    assert fields == {
        "cause": "signal",
        "steps_lost": None,  # unknown, not zero
        "time_lost_s": None,
        "time_lost_max_s": 10.0,  # all 6 s of the attempt may be redone, and the 4 s restart
        "ran_s": 6.0,
        "restart_s": 4.0,
        "world_size_before": 2,
        "world_size_after": 1,
    }
    assert ledger.unmeasured_restart(world_size=1) is None  # said once
    assert ledger.pending is None  # no first step will ever close it


def test_the_job_figures_of_a_restarted_plain_script_are_unknown_with_bounds() -> None:
    ledger = plain_failed_once()
    assert ledger.lost_work() == LostWork(steps_lost=None, time_lost_s=None, time_lost_max_s=10.0)
    fields = ledger.finished_fields(20.0, now=118.0)  # workers ran 6 + 8 s of 20
    assert {**fields, "goodput": ledger.goodput(20.0, now=118.0)} == {
        "steps_lost": None,
        "time_lost_s": None,
        "time_lost_max_s": 10.0,
        "goodput": None,  # unknown: not the share of the time its workers ran
        "goodput_max": pytest.approx(0.7),  # that share, redone work counted as kept
    }


def test_a_plain_script_that_never_restarted_lost_nothing() -> None:
    ledger = Ledger()
    ledger.start_attempt(now=100.0)
    assert ledger.unmeasured_restart(world_size=1) is None
    assert ledger.finished_fields(20.0, now=118.0) == {
        "steps_lost": 0,
        "time_lost_s": 0.0,
        "time_lost_max_s": None,
        "goodput_max": None,
    }


def test_a_restart_without_a_failure_is_unmeasured_too() -> None:
    # a node joined (or a peer failed): the group re-formed and the script lost its work too
    ledger = Ledger()
    ledger.start_attempt(now=100.0)
    ledger.observe({}, world_size=1)
    ledger.start_attempt(now=130.0)
    fields = ledger.unmeasured_restart(world_size=2)
    assert fields is not None
    assert (fields["cause"], fields["ran_s"], fields["restart_s"]) == ("membership", 30.0, 0.0)
    assert fields["cause"] in UNMEASURED_CAUSES  # the event's closed vocabulary
    assert (fields["world_size_before"], fields["world_size_after"]) == (1, 2)
    assert ledger.failures == 0  # a join is no failure


def test_each_failure_of_a_plain_script_counts_for_the_mtbf() -> None:
    ledger = plain_failed_once()
    ledger.failed(cause="error", now=120.0, world_size=1)
    ledger.start_attempt(now=121.0)
    assert ledger.failures == 2 and ledger.mtbf_s(100.0) == 50.0
    assert ledger.lost_work().time_lost_max_s == pytest.approx(10.0 + 11.0)


def test_a_reporting_script_is_measured_as_before() -> None:
    ledger = Ledger()
    ledger.start_attempt(now=100.0)
    ledger.observe({0: Progress(step=7, restored_step=0, time=105.0)}, world_size=1)
    ledger.failed(cause="error", now=106.0, world_size=1)
    ledger.start_attempt(now=108.0)
    assert ledger.unmeasured_restart(world_size=1) is None
    recovered = ledger.observe({0: Progress(step=6, restored_step=5, time=110.0)}, world_size=1)
    assert recovered is not None and recovered["steps_lost"] == 2
    assert ledger.lost_work() == LostWork(steps_lost=2, time_lost_s=4.0, time_lost_max_s=None)
    assert ledger.goodput_max(20.0, now=111.0) is None


def test_a_session_that_failed_before_its_first_report_is_unmeasured_once() -> None:
    # nothing said it reports progress until its second attempt did: the first restart's
    # cost stays unknown (bounded), and no recovery.completed counts it again
    ledger = Ledger()
    ledger.start_attempt(now=100.0)
    ledger.failed(cause="error", now=103.0, world_size=1)
    ledger.start_attempt(now=104.0)
    assert ledger.unmeasured_restart(world_size=1) is not None
    assert ledger.observe({0: Progress(step=1, time=106.0)}, world_size=1) is None
    ledger.observe({0: Progress(step=9, time=114.0)}, world_size=1)
    assert not ledger.goodput_estimated and ledger.goodput(20.0) is not None  # measured
    assert ledger.lost_work() == LostWork(steps_lost=None, time_lost_s=None, time_lost_max_s=4.0)

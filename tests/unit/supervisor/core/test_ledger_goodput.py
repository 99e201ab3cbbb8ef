"""Goodput for every job: measured from progress reports, else estimated from worker times."""

from __future__ import annotations

import pytest

from elastic_trainer.supervisor.core.ledger import Ledger
from elastic_trainer.supervisor.core.watchdog import Progress
from tests.process.supervisor.test_agent import OK, RUNNING, Round, run


def test_a_plain_script_gets_the_share_of_wall_time_its_workers_ran() -> None:
    ledger = Ledger()
    ledger.start_attempt(now=100.0)  # workers start 2 s into a 20 s run
    ledger.failed(cause="error", now=106.0, world_size=1)  # ran 6 s
    ledger.failed(cause="signal", now=107.0, world_size=1)  # the cascade ends nothing new
    ledger.start_attempt(now=110.0)  # 4 s of restart downtime, not counted
    assert ledger.goodput_estimated
    assert ledger.goodput(20.0, now=118.0) == pytest.approx((6.0 + 8.0) / 20.0)


def test_progress_reports_are_measured_not_estimated() -> None:
    ledger = Ledger()
    ledger.start_attempt(now=0.0)
    ledger.observe({0: Progress(step=1, restored_step=None, time=0.0)}, world_size=1)
    ledger.observe({0: Progress(step=10, restored_step=None, time=9.0)}, world_size=1)
    assert not ledger.goodput_estimated
    assert ledger.goodput(20.0, now=20.0) == pytest.approx(0.5)


def test_no_workers_started_no_goodput() -> None:
    ledger = Ledger()
    assert not ledger.goodput_estimated and ledger.goodput(5.0, now=5.0) is None


def test_the_agent_reports_an_estimate_for_a_plain_script(tmp_path) -> None:
    rounds = [Round(nodes=1, ticks=[{0: RUNNING}, {0: 1}]), Round(nodes=1, ticks=[{0: OK}])]
    outcome, _, agent = run(rounds, tmp_path)
    assert outcome.status == "succeeded"
    assert agent.ledger.goodput_estimated
    assert outcome.goodput is not None and 0.0 < outcome.goodput <= 1.0

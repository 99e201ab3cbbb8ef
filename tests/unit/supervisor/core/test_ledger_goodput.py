"""Goodput for every job: measured from progress reports, else estimated from worker times."""

from __future__ import annotations

import pytest

from elastic_trainer.supervisor.agent import ElasticTrainAgent
from elastic_trainer.supervisor.core.ledger import Ledger
from elastic_trainer.supervisor.core.watchdog import Progress
from tests.process.supervisor.test_agent import OK, RUNNING, Round, ScriptedAgent, run


def observe_for_real(agent: ScriptedAgent) -> None:
    """The agent's own observation (the progress files: none here), not the scripted one."""
    agent._observe = lambda: ElasticTrainAgent._observe(agent)  # type: ignore[method-assign]


def test_a_plain_script_gets_the_share_of_wall_time_its_workers_ran() -> None:
    ledger = Ledger()
    ledger.start_attempt(now=100.0)  # workers start 2 s into a 20 s run, never restarted
    assert ledger.goodput_estimated and not ledger.goodput_unknown
    assert ledger.goodput(20.0, now=118.0) == pytest.approx(18.0 / 20.0)
    assert ledger.goodput_max(20.0, now=118.0) is None


def test_once_a_plain_script_restarted_its_goodput_is_unknown_and_bounded() -> None:
    ledger = Ledger()
    ledger.start_attempt(now=100.0)  # workers start 2 s into a 20 s run
    ledger.failed(cause="error", now=106.0, world_size=1)  # ran 6 s
    ledger.failed(cause="signal", now=107.0, world_size=1)  # the cascade ends nothing new
    ledger.start_attempt(now=110.0)  # 4 s of restart downtime, not counted
    assert ledger.goodput_estimated and ledger.goodput_unknown
    assert ledger.goodput(20.0, now=118.0) is None  # not the 70 % it would have claimed
    # at most: every second the workers ran was kept (the 6 s before the failure may all
    # have been redone, and the workers' start-up counts as work: no lower bound)
    assert ledger.goodput_max(20.0, now=118.0) == pytest.approx((6.0 + 8.0) / 20.0)


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
    outcome, _, agent = run([Round(nodes=1, ticks=[{0: RUNNING}, {0: OK}])], tmp_path)
    assert outcome.status == "succeeded"
    assert agent.ledger.goodput_estimated
    assert outcome.goodput is not None and 0.0 < outcome.goodput <= 1.0


def test_the_agent_says_a_restarted_plain_script_lost_an_unknown_amount(tmp_path) -> None:
    rounds = [Round(nodes=1, ticks=[{0: RUNNING}, {0: 1}]), Round(nodes=1, ticks=[{0: OK}])]
    outcome, logs, agent = run(rounds, tmp_path, prepare=observe_for_real)
    assert outcome.status == "succeeded"
    assert agent.ledger.goodput_estimated and outcome.goodput is None
    (restart,) = [e for e in logs if e["event"] == "recovery.unmeasured"]
    assert restart["cause"] == "error"
    assert restart["steps_lost"] is None and restart["time_lost_s"] is None  # unknown, not 0
    bound = restart["ran_s"] + restart["restart_s"]  # each rounded to the ms
    assert restart["time_lost_max_s"] == pytest.approx(bound, abs=0.002)
    assert (restart["world_size_before"], restart["world_size_after"]) == (1, 1)
    assert not [e for e in logs if e["event"] == "recovery.completed"]

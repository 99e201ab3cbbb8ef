"""``elastic-train report`` on a script that reports no progress: what its restarts cost is
unknown, not zero, and said with the bound the supervisor knows."""

from __future__ import annotations

import pytest

from elastic_trainer.tools.report.events import with_relative_time
from elastic_trainer.tools.report.summary import format_summary, summarize
from tests.unit.tools.report.test_summary import ev

UNMEASURED = {
    "steps_lost": None,
    "time_lost_s": None,
    "world_size_before": 1,
    "world_size_after": 1,
}


def plain_run(*, finished: bool = True, **unmeasured: float | str) -> list[dict]:
    """A plain script SIGKILLed once after 2.1 s of work, restarted 0.1 s later."""
    restart = {"cause": "signal", "ran_s": 2.1, "restart_s": 0.1, "time_lost_max_s": 2.2}
    events = [
        ev(0, "supervisor.started"),
        ev(1, "rendezvous.completed", world_size=1),
        ev(1.2, "workers.started", world_size=1, restart_count=0),
        ev(3.3, "worker.failed", rank=0, cause="signal", exit_code=-9),
        ev(3.3, "group.restarting", reason="failure", restart_count=1),
        ev(3.4, "workers.started", world_size=1, restart_count=1),
        ev(3.5, "recovery.unmeasured", **UNMEASURED, **{**restart, **unmeasured}),
    ]
    if finished:
        events.append(
            ev(
                10,
                "job.finished",
                status="succeeded",
                exit_code=0,
                restarts=1,
                wall_s=10.0,
                goodput=None,
                goodput_estimated=True,
                steps_lost=None,
                time_lost_s=None,
                time_lost_max_s=2.2,
                goodput_max=0.81,
            )
        )
    return events


def test_a_plain_script_restart_is_unknown_with_its_bound() -> None:
    s = summarize(with_relative_time(plain_run()))
    assert (s.time_lost_s, s.steps_redone, s.time_lost_max_s) == (None, None, 2.2)
    assert (s.goodput, s.goodput_max) == (None, 0.81)
    assert s.goodput_estimated and s.goodput_source == "job.finished"
    text = format_summary(s, source="log")
    assert (
        "time lost:   unknown (at most 2.2 s: the attempt ran 2.1 s before the failure, "
        "restarting took 0.1 s); steps redone unknown (the script reports no progress)"
    ) in text
    assert "goodput:     unknown, at most 81.0% (job.finished, estimated)" in text


def test_several_restarts_add_up_and_a_join_is_one_of_them() -> None:
    events = plain_run(finished=False)
    events.append(
        ev(
            6,
            "recovery.unmeasured",
            **UNMEASURED,
            cause="membership",
            ran_s=2.5,
            restart_s=0.5,
            time_lost_max_s=3.0,
        )
    )
    s = summarize(with_relative_time(events))
    assert s.time_lost_max_s == pytest.approx(5.2)
    assert [r["cause"] for r in s.unmeasured_restarts] == ["signal", "membership"]
    text = format_summary(s, source="log")
    assert (
        "unknown (at most 5.2 s: attempts ran 4.6 s before 2 restarts, restarting took 0.6 s)"
        in text
    )


def test_without_job_finished_goodput_is_at_most_what_the_restart_gaps_leave() -> None:
    s = summarize(with_relative_time(plain_run(finished=False)))  # 3.5 s of events
    assert s.goodput is None and s.goodput_source == "estimated" and s.goodput_estimated
    assert s.goodput_max == pytest.approx(1 - 0.1 / 3.5)  # only the restart gap is sure


def test_a_log_from_before_the_event_is_unknown_without_a_bound() -> None:
    events = [e for e in plain_run() if e["event"] != "recovery.unmeasured"]
    events[-1] = ev(
        10,
        "job.finished",
        status="succeeded",
        exit_code=0,
        restarts=1,
        wall_s=10.0,
        goodput=0.81,
        goodput_estimated=True,
    )
    s = summarize(with_relative_time(events))
    assert (s.time_lost_s, s.steps_redone, s.time_lost_max_s) == (None, None, None)
    assert (s.goodput, s.goodput_max) == (None, 0.81)  # the workers' running share: at most
    text = format_summary(s, source="log")
    assert "time lost:   unknown; steps redone unknown (the script reports no progress)" in text
    assert "goodput:     unknown, at most 81.0% (job.finished, estimated)" in text


def test_measured_recoveries_count_into_the_bound() -> None:
    events = plain_run(finished=False)
    events.append(ev(8, "recovery.completed", cause="error", downtime_s=1.5, steps_lost=3))
    s = summarize(with_relative_time(events))
    assert (s.time_lost_s, s.steps_redone, s.time_lost_max_s) == (None, None, 3.7)
    assert "measured recoveries 1.5 s)" in format_summary(s, source="log")

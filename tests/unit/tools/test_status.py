"""``elastic-train status``: the on-call engineer's first questions, from a run's events."""

from __future__ import annotations

import json

import pytest

from elastic_trainer import cli
from elastic_trainer.tools.status import format_status, status_of

T0 = 1_700_000_000.0


def _e(t: float, event: str, node: str = "a", **fields) -> dict:
    return {"event": event, "node": node, "time": T0 + t, **fields}


RUN = [
    _e(0, "supervisor.started"),
    _e(1, "rendezvous.completed", world_size=4, round=0),
    _e(1, "supervisor.started", node="b"),
    _e(5, "snapshot.saved", step=100, stall_ms=3),
    _e(8, "worker.failed", node="b", rank=3, cause="oom", error_summary=None),
    _e(9, "group.restarting", reason="failure"),
    _e(12, "membership.changed", old_world_size=4, new_world_size=2, reason="node_lost"),
    _e(20, "train.progress", step=140, loss=0.5),
    _e(25, "snapshot.saved", step=150, stall_ms=3),
    _e(30, "train.progress", step=160, loss=0.4),
]


def test_a_running_job_says_world_size_step_snapshot_and_restarts_by_cause() -> None:
    status = status_of(RUN, now=T0 + 40)
    assert status.state == "running"
    assert (status.world_size, status.step) == (2, 160)
    assert (status.last_snapshot_step, status.last_snapshot_age_s) == (150, 15.0)
    assert status.restarts_by_cause == {"oom": 1}
    assert status.failures_by_cause == {"oom": 1}
    assert status.last_failure == "rank 3 on b: oom (no error summary), 32.0s ago"
    assert [(n.node, n.state, n.last_event) for n in status.nodes] == [
        ("a", "running", "train.progress"),
        ("b", "running", "worker.failed"),
    ]
    text = format_status(status, source="run.jsonl")
    assert "last snapshot: step 150, 15.0s ago" in text and "restarts:      1 (oom 1)" in text


def test_a_finished_job_says_how_it_ended() -> None:
    events = [*RUN, _e(31, "job.finished", status="succeeded", exit_code=0)]
    assert status_of(events, now=T0 + 40).state == "succeeded"


def test_the_command_reads_a_log_and_prints_json(tmp_path, capsys) -> None:
    log = tmp_path / "events.jsonl"
    # what the supervisor writes: a timestamp (unix seconds are read too), no parsed time
    lines = [{**{k: v for k, v in e.items() if k != "time"}, "timestamp": e["time"]} for e in RUN]
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert cli.main(["status", str(log), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 2 and out["last_snapshot_step"] == 150 and out["log"] == str(log)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["status", "/no/such.jsonl"], "no such event log '/no/such.jsonl'"),
        (["status"], "give a RUN (event log or run folder) or --rdzv-endpoint HOST:PORT"),
    ],
)
def test_bad_input_is_one_line_with_the_prefix(argv, message, capsys) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("elastic-train: error: ") and message in err
    assert err.count("\n") == 1


def test_a_graceful_preemption_is_not_a_failure() -> None:
    """Regression: node b's preemption read 'last failure: rank 0 on a: preempted'."""
    events = [
        _e(0, "rendezvous.completed", world_size=2, round=0),
        _e(0, "rendezvous.completed", node="b", world_size=2, round=0),
        _e(10, "preemption.received", node="b", signal="SIGTERM", grace_s=25),
        _e(11, "worker.failed", rank=0, cause="preempted", error_summary=None),
        _e(12, "job.finished", node="b", status="preempted", exit_code=143),
    ]
    status = status_of(events, now=T0 + 20)
    assert status.last_failure is None and status.failures_by_cause == {}
    assert status.preemptions == 1
    assert status.last_preemption == "node b (SIGTERM), 10.0s ago"
    text = format_status(status, source="run")
    assert "last failure:  none" in text
    assert "preemptions:   1 (last: node b (SIGTERM), 10.0s ago)" in text


def test_a_stray_start_in_the_same_log_is_left_out() -> None:
    """A second command writing into events-b.jsonl never joined: its stop is not the job's."""
    job = [{**e, "supervisor_run": f"{e['node']}000"} for e in RUN]
    stray = [
        _e(32, "supervisor.started", node="b", supervisor_run="5eca7e"),
        _e(33, "preemption.received", node="b", supervisor_run="5eca7e", signal="SIGINT"),
        _e(33, "job.finished", node="b", supervisor_run="5eca7e", status="preempted"),
    ]
    status = status_of([*job, *stray], now=T0 + 40)
    assert status.state == "running" and status.preemptions == 0
    assert [n.state for n in status.nodes] == ["running", "running"]
    assert "left out:      1 supervisor start(s) that never joined the job: 5eca7e on b" in (
        format_status(status, source="run")
    )

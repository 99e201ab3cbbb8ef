"""``elastic-train report``: the summary is computed from the events alone."""

from __future__ import annotations

import json

from elastic_trainer.tools.report.events import parse_lines, with_relative_time
from elastic_trainer.tools.report.summary import format_summary, restart_causes, summarize

T0 = 1_700_000_000.0


def ev(t: float, name: str, node: str = "n1", **fields) -> dict:
    from datetime import datetime, timezone

    stamp = datetime.fromtimestamp(T0 + t, tz=timezone.utc).isoformat().replace("+00:00", "Z")
    return {"event": name, "timestamp": stamp, "node": node, **fields}


def a_run() -> list[dict]:
    """Two nodes sharing one log: a crash, a hang, a peer preemption, then success."""
    return [
        ev(0, "supervisor.started"),
        ev(0.5, "supervisor.started", node="n2"),
        ev(2, "rendezvous.completed", world_size=2, round=1),
        ev(2, "rendezvous.completed", node="n2", world_size=2, round=1),
        ev(10, "train.progress", step=10, epoch=0, loss=2.0, lr=0.1),
        ev(12, "snapshot.saved", step=10, stall_ms=10.0),
        ev(20, "train.progress", step=20, epoch=0, loss=1.5, lr=0.1),
        ev(21, "worker.failed", node="n2", rank=1, cause="error", exit_code=1),
        ev(21.5, "group.restarting", reason="failure", restart_count=1),
        ev(21.5, "group.restarting", node="n2", reason="failure", restart_count=1),
        ev(
            25,
            "recovery.completed",
            cause="error",
            downtime_s=4.0,
            steps_lost=10,
            world_size_before=2,
            world_size_after=2,
            snapshot_step=10,
        ),
        ev(25, "recovery.completed", node="n2", cause="error", downtime_s=3.5, steps_lost=10),
        ev(30, "snapshot.saved", step=20, stall_ms=30.0),
        ev(31, "train.evaluated", step=20, epoch=0, val_loss=1.2, val_accuracy=0.6),
        ev(32, "train.model_exported", step=20, path="/s/best/m20.pt", val_accuracy=0.6),
        ev(40, "worker.hung", rank=0, last_step=25, stalled_s=5.0),
        ev(40, "worker.failed", rank=0, cause="hang", exit_code=None),
        ev(40.5, "group.restarting", reason="hang", restart_count=2),
        ev(45, "recovery.completed", cause="hang", downtime_s=5.0, steps_lost=5),
        ev(50, "preemption.received", node="n2", signal="SIGTERM", grace_s=25),
        ev(51, "worker.failed", rank=0, cause="preempted", exit_code=75),
        ev(51.5, "group.restarting", reason="membership", restart_count=2),
        ev(53, "rendezvous.completed", world_size=1, round=2),
        ev(53, "membership.changed", old_world_size=2, new_world_size=1, reason="peer_preempted"),
        ev(55, "recovery.completed", cause="preempted", downtime_s=4.0, steps_lost=0),
        ev(70, "train.evaluated", step=40, epoch=1, val_loss=0.9, val_accuracy=0.75),
        ev(
            80,
            "job.finished",
            status="succeeded",
            exit_code=0,
            restarts=2,
            wall_s=80.0,
            goodput=0.81,
        ),
    ]


def test_summary_numbers_come_from_the_events() -> None:
    s = summarize(with_relative_time(a_run()))
    assert s.nodes == ["n1", "n2"] and s.status == "succeeded" and s.wall_s == 80.0
    assert s.restarts == 3
    assert s.restarts_by_cause == {"error": 1, "hang": 1, "peer_preempted": 1}
    assert s.failures_by_cause == {"error": 1, "hang": 1}  # a preemption is no failure
    assert s.preemptions == 1 and s.membership_changes == 1
    assert s.time_lost_s == 13.0 and s.steps_redone == 15  # n1's view only, not n2's copies
    assert (s.goodput, s.goodput_source) == (0.81, "job.finished")
    assert s.snapshots == 2 and s.mean_snapshot_stall_ms == 20.0
    assert s.world_sizes == [2, 1] and s.final_step == 40
    assert (s.final_val_accuracy, s.best_val_accuracy, s.best_step) == (0.75, 0.75, 40)
    assert s.exported_models == ["/s/best/m20.pt"]


def test_goodput_is_estimated_without_job_finished() -> None:
    events = [e for e in a_run() if e["event"] != "job.finished"]
    s = summarize(with_relative_time(events))
    assert s.status is None and s.wall_s == 70.0
    assert s.goodput_source == "estimated" and s.goodput == 1 - 13.0 / 70.0


def test_an_uneventful_run() -> None:
    events = [
        ev(0, "supervisor.started"),
        ev(1, "rendezvous.completed", world_size=1),
        ev(9, "job.finished", status="succeeded", wall_s=9.0, goodput=None),
    ]
    s = summarize(with_relative_time(events))
    assert s.restarts == 0 and s.restarts_by_cause == {} and s.time_lost_s == 0.0
    assert s.world_sizes == [1] and s.goodput_source == "estimated" and s.goodput == 1.0
    assert "restarts:    0" in format_summary(s, source="log")


def test_restart_cause_is_the_failure_before_it() -> None:
    events = [
        ev(0, "worker.failed", cause="oom"),
        ev(1, "group.restarting", reason="failure"),
        ev(2, "group.restarting", reason="membership"),
        ev(3, "membership.changed", reason="node_joined"),
        ev(4, "group.restarting", reason="failure"),
    ]
    assert restart_causes(events) == ["oom", "node_joined", "failure"]


def test_format_summary_shows_the_headline_numbers() -> None:
    text = format_summary(summarize(with_relative_time(a_run())), source="run.jsonl")
    assert "restarts:    3 (error 1, hang 1, peer_preempted 1)" in text
    assert "time lost:   13.0 s; steps redone 15" in text
    assert "goodput:     81.0% (job.finished)" in text
    assert "accuracy 75.0%" in text


def test_parse_lines_skips_what_is_not_an_event() -> None:
    lines = [
        json.dumps(ev(0, "supervisor.started")),
        "torch warning: blah",
        "",
        "[1, 2]",
        json.dumps({"event": "x"}),
        json.dumps(ev(1, "job.finished")),
    ]
    events, skipped = parse_lines(lines)
    assert [e["event"] for e in events] == ["supervisor.started", "job.finished"]
    assert skipped == 3


def _tokened(events: list[dict], token_of_node: dict[str, str]) -> list[dict]:
    """What supervisors write: each event carries its supervisor start's token."""
    return [{**e, "supervisor_run": token_of_node[e["node"]]} for e in events]


def a_stray_start() -> list[dict]:
    """A second command started by mistake in n2's run folder, then stopped with Ctrl-C."""
    return [
        ev(60, "supervisor.started", node="n2", supervisor_run="5eca7e0000000000"),
        ev(61, "preemption.received", node="n2", supervisor_run="5eca7e0000000000"),
        ev(61, "job.finished", node="n2", supervisor_run="5eca7e0000000000", status="preempted"),
    ]


def test_a_stray_start_that_never_joined_is_left_out_and_named() -> None:
    job = _tokened(a_run(), {"n1": "aaaa000000000000", "n2": "bbbb000000000000"})
    s = summarize(with_relative_time([*job, *a_stray_start()]))
    assert s.preemptions == 1 and s.status == "succeeded" and s.nodes == ["n1", "n2"]
    assert [r["token"] for r in s.runs] == [
        "aaaa000000000000",
        "bbbb000000000000",
        "5eca7e0000000000",
    ]
    assert [(r["token"], r["node"], r["status"], r["joined"]) for r in s.stray_runs] == [
        ("5eca7e0000000000", "n2", "preempted", False)
    ]
    text = format_summary(s, source="run")
    left_out = "left out:    1 supervisor start(s) that never joined the job: 5eca7e0000000000"
    assert f"{left_out} on n2 (preempted)" in text


def test_without_any_joined_run_nothing_is_left_out() -> None:
    s = summarize(with_relative_time(a_stray_start()))
    assert s.stray_runs == [] and s.preemptions == 1 and s.status == "preempted"


def test_a_supervisor_estimate_of_goodput_is_flagged() -> None:
    events = [
        ev(0, "supervisor.started"),
        ev(1, "rendezvous.completed", world_size=1),
        ev(9, "job.finished", status="succeeded", wall_s=9.0, goodput=0.7, goodput_estimated=True),
    ]
    s = summarize(with_relative_time(events))
    assert (s.goodput, s.goodput_source, s.goodput_estimated) == (0.7, "job.finished", True)
    assert "goodput:     70.0% (job.finished, estimated)" in format_summary(s, source="log")


def test_a_store_move_is_reported_once_however_many_nodes_said_it() -> None:
    moved = {"old_host": "h:1", "new_host": "h:2", "endpoint": "10.0.0.2:29500", "why": "lost"}
    events = with_relative_time(
        [
            ev(0, "supervisor.started"),
            ev(5, "store.moved", node="n2", duration_s=0.004, hosted_here=True, **moved),
            ev(5, "store.moved", node="n3", duration_s=0.1, hosted_here=False, **moved),
            ev(
                9,
                "store.moved",
                node="n3",
                old_host="h:2",
                new_host="h:3",
                endpoint="e",
                why="leaving",
                duration_s=0.3,
                hosted_here=True,
            ),
        ]
    )
    summary = summarize(events)
    assert summary.store_moves == [
        {**moved, "duration_s": 0.004},
        {
            "old_host": "h:2",
            "new_host": "h:3",
            "endpoint": "e",
            "why": "leaving",
            "duration_s": 0.3,
        },
    ]
    text = format_summary(summary, source="x")
    assert "store moved: 2x: h:1 -> h:2 (lost); h:2 -> h:3 (leaving)" in text
    assert "store moved" not in format_summary(summarize(events[:1]), source="x")


def test_a_job_run_again_after_it_finished_is_named_not_merged_silently() -> None:
    first = [
        ev(0, "supervisor.started", supervisor_run="aaaa"),
        ev(1, "rendezvous.completed", supervisor_run="aaaa", world_size=1),
        ev(9, "job.finished", supervisor_run="aaaa", status="succeeded", wall_s=9.0),
    ]
    again = [
        ev(20, "supervisor.started", supervisor_run="bbbb"),
        ev(21, "rendezvous.completed", supervisor_run="bbbb", world_size=1),
        ev(29, "job.finished", supervisor_run="bbbb", status="succeeded", wall_s=9.0),
    ]
    summary = summarize(first + again)
    assert [r["token"] for r in summary.later_runs] == ["bbbb"]
    text = format_summary(summary, source="runs/x")
    assert "ran again:" in text and "bbbb on n1" in text
    assert summarize(first).later_runs == []


def test_stragglers_are_named_with_the_time_the_group_waited_for_its_slowest_rank() -> None:
    events = [
        ev(0, "supervisor.started"),
        ev(1, "rendezvous.completed", world_size=3),
        ev(5, "straggler.detected", node="b", rank=1, slowdown=1.8, since_step=40, step=48),
        ev(9, "straggler.recovered", node="b", rank=1, since_step=40, step=90, waited_s=2.5),
        ev(12, "straggler.detected", node="c", rank=2, slowdown=1.3, since_step=120, step=131),
        ev(20, "straggler.summary", node="a", steps=200, waited_s=6.25, stragglers=[2], attempt=7),
        ev(21, "job.finished", status="succeeded", wall_s=21.0, goodput=None),
    ]
    s = summarize(with_relative_time(events))
    assert [(e["node"], e["recovered"]) for e in s.stragglers] == [("b", True), ("c", False)]
    assert s.straggler_wait_s == 6.25  # the session's own sum, not the episodes'
    line = "stragglers:  2 (b rank 1 x1.8 from step 40, c rank 2 x1.3 from step 120 (to the end))"
    assert line + "; waited for the slowest rank 6.2 s" in format_summary(s, source="log")


def test_a_session_killed_before_its_summary_counts_its_episodes_waits() -> None:
    events = [
        ev(5, "straggler.detected", node="b", rank=1, slowdown=2.0, since_step=3, step=9),
        ev(9, "straggler.recovered", node="b", rank=1, since_step=3, step=30, waited_s=1.5),
    ]
    assert summarize(with_relative_time(events)).straggler_wait_s == 1.5


def test_a_run_without_stragglers_says_nothing_of_them() -> None:
    text = format_summary(summarize(with_relative_time(a_run())), source="run.jsonl")
    assert "stragglers" not in text

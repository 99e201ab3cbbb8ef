"""The supervisor's metrics: event -> changes (pure), /health's phase, the docs' table."""

from __future__ import annotations

import math
import re

import pytest

from elastic_trainer.contract import events
from elastic_trainer.supervisor.core import metrics as M
from elastic_trainer.supervisor.core.watchdog import Progress
from tests import ROOT

METRICS_DOC = ROOT / "docs" / "events-and-metrics.md"


def test_a_saved_snapshot_sets_step_and_time_and_observes_stall_and_write_in_seconds() -> None:
    changes = M.changes_for(
        {
            "event": "snapshot.saved",
            "step": 40,
            "timestamp": "2024-05-01T12:00:00Z",
            "stall_ms": 250,
            "write_ms": 1500,
        }
    )
    assert changes == [
        M.Change("elastic_train_last_snapshot_step", M.Op.SET, 40.0),
        M.Change("elastic_train_last_snapshot_timestamp_seconds", M.Op.SET, 1714564800.0),
        M.Change("elastic_train_snapshot_stall_seconds", M.Op.OBSERVE, 0.25),
        M.Change("elastic_train_snapshot_write_seconds", M.Op.OBSERVE, 1.5),
    ]


@pytest.mark.parametrize("reason", events.RESTART_REASONS)
def test_restarts_are_counted_by_their_cause(reason: str) -> None:
    changes = M.changes_for({"event": "group.restarting", "reason": reason})
    assert changes == [
        M.Change("elastic_train_restarts_total", M.Op.INC, 1.0, (("cause", reason),))
    ]


def test_a_label_outside_the_closed_vocabulary_makes_no_new_series() -> None:
    assert M.changes_for({"event": "group.restarting", "reason": "typo"}) == []


def test_a_membership_change_sets_the_world_size_and_counts_the_reason() -> None:
    changes = M.changes_for(
        {
            "event": "membership.changed",
            "old_world_size": 4,
            "new_world_size": 2,
            "reason": "node_lost",
        }
    )
    assert changes == [
        M.Change("elastic_train_world_size", M.Op.SET, 2.0),
        M.Change(
            "elastic_train_membership_changes_total", M.Op.INC, 1.0, (("reason", "node_lost"),)
        ),
    ]


def test_recovery_resources_and_goodput() -> None:
    assert M.changes_for({"event": "recovery.completed", "downtime_s": 12.5}) == [
        M.Change("elastic_train_recovery_seconds", M.Op.OBSERVE, 12.5)
    ]
    assert M.changes_for({"event": "worker.resources", "local_rank": 1, "rss_bytes": 2048}) == [
        M.Change("elastic_train_worker_rss_bytes", M.Op.SET, 2048.0, (("local_rank", "1"),))
    ]
    assert M.changes_for({"event": "job.finished", "goodput": None}) == []
    assert M.goodput_changes(0.9) == [M.Change("elastic_train_goodput_ratio", M.Op.SET, 0.9)]
    assert M.changes_for({"event": "store.moved", "new_host": "n:2"}) == [
        M.Change("elastic_train_store_moves_total", M.Op.INC, 1.0)
    ]


def test_an_unknown_goodput_is_nan_not_the_last_value() -> None:
    # a plain script restarted: job.finished's goodput is null, only bounded
    finished = {"event": "job.finished", "goodput": None, "goodput_max": 0.8}
    (change,) = M.changes_for(finished)
    assert change.metric == "elastic_train_goodput_ratio" and math.isnan(change.value)


def test_a_straggler_sets_its_slowdown_by_node_and_rank_and_its_recovery_resets_it() -> None:
    labels = (("node", "b"), ("rank", "1"))
    detected = {"event": "straggler.detected", "node": "b", "rank": 1, "slowdown": 1.8}
    recovered = {"event": "straggler.recovered", "node": "b", "rank": 1, "slowdown": 1.01}
    assert M.changes_for(detected) == [
        M.Change("elastic_train_rank_slowdown", M.Op.SET, 1.8, labels)
    ]
    assert M.changes_for(recovered) == [
        M.Change("elastic_train_rank_slowdown", M.Op.SET, 1.01, labels)
    ]


def test_events_no_metric_follows_change_nothing() -> None:
    assert M.changes_for({"event": "preflight.warning", "warning": "x"}) == []
    assert M.changes_for({"event": "snapshot.saved", "step": "not a number"}) == []


def test_every_change_names_a_declared_metric_with_its_labels() -> None:
    samples = [
        {"event": "rendezvous.completed", "world_size": 3},
        {"event": "workers.started", "world_size": 3},
        {"event": "membership.changed", "new_world_size": 2, "reason": "node_joined"},
        {"event": "group.restarting", "reason": "hang"},
        {"event": "worker.failed", "cause": "oom"},
        {"event": "worker.resources", "local_rank": 0, "rss_bytes": 1},
        {"event": "recovery.completed", "downtime_s": 1.0},
        {"event": "snapshot.saved", "step": 1, "timestamp": 5.0, "stall_ms": 1, "write_ms": 2},
        {"event": "snapshot.restored", "step": 1},
        {"event": "job.finished", "goodput": 0.5},
        {"event": "store.moved", "new_host": "n:2"},
        {"event": "straggler.detected", "node": "b", "rank": 1, "slowdown": 1.5},
    ]
    for sample in samples:
        changes = M.changes_for(sample)
        assert changes, sample
        for change in changes:
            spec = M.METRICS[change.metric]
            assert tuple(k for k, _ in change.labels) == spec.labels, change


# ---- progress ------------------------------------------------------------------------------
def _reports(*steps: int, restored: int | None = None, time: float = 100.0):
    return {r: Progress(step=s, restored_step=restored, time=time + r) for r, s in enumerate(steps)}


def test_steps_count_from_the_restored_snapshot_then_by_difference() -> None:
    count, changes = M.progress_changes(M.StepCount(), _reports(55, 54, restored=50))
    assert count == M.StepCount(seen=55)
    assert changes == [
        M.Change("elastic_train_step", M.Op.SET, 55.0),
        M.Change("elastic_train_steps_total", M.Op.INC, 5.0),
        M.Change("elastic_train_last_progress_timestamp_seconds", M.Op.SET, 101.0),
    ]
    count, changes = M.progress_changes(count, _reports(57, 57, restored=50))
    assert count.seen == 57
    assert M.Change("elastic_train_steps_total", M.Op.INC, 2.0) in changes


def test_no_new_step_counts_nothing_and_a_fresh_start_counts_from_zero() -> None:
    count, changes = M.progress_changes(M.StepCount(seen=7), _reports(7))
    assert changes == [M.Change("elastic_train_step", M.Op.SET, 7.0)]
    assert M.progress_changes(count, {}) == (count, [])
    _, changes = M.progress_changes(M.StepCount(), _reports(3))
    assert M.Change("elastic_train_steps_total", M.Op.INC, 3.0) in changes


# ---- health --------------------------------------------------------------------------------
def _after(*names_and_fields: dict) -> M.Health:
    health = M.Health()
    for event in names_and_fields:
        health = M.next_health(health, event)
    return health


def test_a_new_supervisor_is_healthy_and_steps_make_it_running() -> None:
    assert M.Health().ok
    running = M.progressed(M.Health(), 12)
    assert running.ok and running.phase == M.Phase.RUNNING


def test_a_hang_is_unhealthy_until_steps_are_made_again() -> None:
    hung = _after(
        {"event": "worker.hung", "rank": 1, "last_step": 9, "stalled_s": 31.0},
        {"event": "worker.failed", "rank": 1, "cause": "hang"},
        {"event": "group.restarting", "reason": "hang"},
        {"event": "workers.started", "restart_count": 1},
    )
    assert not hung.ok and hung.phase == M.Phase.HUNG
    assert "no progress for 31.0s" in hung.reason
    assert M.progressed(hung, 10).ok


def test_a_failure_is_recovering_and_healthy() -> None:
    health = _after({"event": "worker.failed", "rank": 0, "cause": "error"})
    assert health.ok and health.phase == M.Phase.RECOVERING


@pytest.mark.parametrize(
    ("last", "phase"),
    [
        ({"event": "preemption.received", "signal": "SIGTERM"}, M.Phase.STOPPING),
        ({"event": "job.finished", "status": "failed", "exit_code": 1}, M.Phase.FAILED),
        ({"event": "job.finished", "status": "store_lost", "exit_code": 1}, M.Phase.FAILED),
        ({"event": "job.finished", "status": "succeeded", "exit_code": 0}, M.Phase.FINISHED),
    ],
)
def test_stopping_failed_and_finished_are_unhealthy_and_final(last: dict, phase: M.Phase) -> None:
    health = _after(last)
    assert health.phase == phase and not health.ok
    assert M.progressed(health, 99) == health
    assert M.next_health(health, {"event": "workers.started"}) == health


# ---- docs/events-and-metrics.md is the metrics' documentation ----------------------------------
def test_the_docs_document_every_metric_with_its_type_and_labels() -> None:
    text = METRICS_DOC.read_text()
    section = text[text.index("## Metrics") :]
    for spec in M.METRICS.values():
        row = re.search(rf"^\| `{spec.name}(\{{[^`]*\}})?` \| (\w+) \|.*$", section, re.M)
        assert row, f"docs/events-and-metrics.md Metrics table lacks {spec.name}"
        assert row.group(2) == spec.kind.value, spec.name
        labels = re.findall(r"\w+", row.group(1) or "")
        assert tuple(labels) == spec.labels, spec.name


def test_metric_names_follow_prometheus_conventions() -> None:
    for spec in M.METRICS.values():
        assert re.fullmatch(r"elastic_train_[a-z_]+", spec.name), spec.name
        assert spec.name.endswith("_total") == (spec.kind == M.Kind.COUNTER), spec.name


def test_a_restore_from_memory_is_not_a_storage_snapshot() -> None:
    storage = M.changes_for({"event": "snapshot.restored", "step": 7, "source": "storage"})
    assert [(c.metric, c.value) for c in storage] == [("elastic_train_last_snapshot_step", 7)]
    for source in ("memory", "mirror"):
        assert M.changes_for({"event": "snapshot.restored", "step": 9, "source": source}) == []

"""The event catalogue is an API: emit() refuses unknown names, the docs document all."""

from __future__ import annotations

import re

import pytest
from structlog.testing import capture_logs

from elastic_trainer.contract import events
from tests import ROOT

EVENTS_DOC = ROOT / "docs" / "events-and-metrics.md"


def test_emit_logs_a_catalogued_event_with_its_fields() -> None:
    with capture_logs() as logs:
        events.emit(
            "group.restarting", reason="error", restart_count=1, restarts_left=2, backoff_s=0.0
        )
    assert logs == [
        {
            "event": "group.restarting",
            "log_level": "info",
            "reason": "error",
            "restart_count": 1,
            "restarts_left": 2,
            "backoff_s": 0.0,
        }
    ]


def test_emit_refuses_names_outside_the_catalogue() -> None:
    with pytest.raises(KeyError, match=r"not in elastic_trainer\.contract\.events\.CATALOGUE"):
        events.emit("supervisor.startd")


def test_names_are_dotted_lowercase() -> None:
    for name in events.CATALOGUE:
        assert re.fullmatch(r"[a-z_]+\.[a-z_]+", name), name


def test_the_docs_document_every_event() -> None:
    text = EVENTS_DOC.read_text()
    missing = [name for name in events.CATALOGUE if f"`{name}`" not in text]
    assert not missing, f"docs/events-and-metrics.md event table lacks: {missing}"


def test_emit_refuses_an_event_without_its_fields() -> None:
    with pytest.raises(KeyError, match=r"missing its fields \['restarts_left', 'backoff_s'\]"):
        events.emit("group.restarting", reason="failure", restart_count=1)


def test_emit_logs_enum_values_as_plain_strings() -> None:
    with capture_logs() as logs:
        events.emit(
            "membership.changed",
            old_world_size=2,
            new_world_size=1,
            reason=events.MembershipReason.NODE_LOST,
        )
    assert logs[0]["reason"] == "node_lost" and type(logs[0]["reason"]) is str


def test_snapshot_events_have_one_catalogue() -> None:
    from snapshots.events import EVENTS

    assert {k: events.CATALOGUE[k] for k in EVENTS} == EVENTS


def test_log_record_is_catalogued_but_written_only_by_logging() -> None:
    assert events.CATALOGUE["log.record"] == ("logger", "level", "message")
    with pytest.raises(KeyError, match=r"written by elastic_trainer\.logging"):
        events.emit("log.record", message="x")


def test_vocabularies_are_the_enums() -> None:
    assert events.FAILURE_CAUSES == tuple(c.value for c in events.FailureCause)
    assert "node_lost" in events.RECOVERY_CAUSES
    assert "config_error" in events.JOB_STATUSES

"""Reading an event log: a field that is null in our own events is still an event."""

from __future__ import annotations

import json

from elastic_trainer.tools.report.events import parse_lines


def test_job_finished_with_a_null_reason_is_read() -> None:
    # what the supervisor writes at the end of every job that ran (reason: null)
    finished = {
        "event": "job.finished",
        "timestamp": "2026-11-28T00:00:00Z",
        "node": "n0",
        "status": "succeeded",
        "reason": None,
        "goodput": None,
    }
    events, skipped = parse_lines([json.dumps(finished)])
    assert skipped == 0 and [e["status"] for e in events] == ["succeeded"]


def test_a_text_field_of_another_type_is_no_event() -> None:
    crafted = {"event": "job.finished", "timestamp": "2026-11-28T00:00:00Z", "status": 7}
    assert parse_lines([json.dumps(crafted)]) == ([], 1)

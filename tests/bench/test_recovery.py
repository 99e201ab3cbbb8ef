"""bench/recovery.py's arithmetic on made-up logs: phases, steps lost, restore source."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import recovery
from _recovery_parse import (
    Restore,
    Result,
    breakdown,
    parse_audit,
    parse_events,
    parse_markers,
    restore_after,
    result,
    steps_lost,
)

FAULT = 1000.0


def event(name: str, at: float, **fields: object) -> str:
    stamp = datetime.fromtimestamp(at, tz=timezone.utc).isoformat()
    return json.dumps({"event": name, "timestamp": stamp, **fields})


# the old group at world size 2 up to step 13 (last row just before the fault), the new
# group's ranks ready at 1001, restored at 1002, first step at 1002.5
OLD = [(s, r, 2, FAULT - 0.1 * (13 - s) - 0.05) for s in (11, 12, 13) for r in (0, 1)]
MARKS = [("group_ready", 1001.0), ("group_ready", 1001.1), ("restored", 1002.0)]


def recovered(first_step: int, restore: Restore | None, extra=()) -> Result:
    new = [(first_step, 0, 1, 1002.5), (first_step + 1, 0, 1, 1002.6)]
    return result(
        fault=FAULT,
        detected=1000.2,
        formed=1000.5,
        marks=MARKS,
        audit=[*OLD, *extra, *new],
        restore=restore,
        ws_after=1,
    )


def test_plain_worker_resumes_one_before_its_first_step() -> None:
    got = recovered(first_step=11, restore=None)  # its own snapshot of step 10
    assert (got.steps_lost, got.resumed_from, got.source) == (3, 10, None)
    assert got.total == pytest.approx(2.5)
    assert got.phases["restore"] == pytest.approx(1002.0 - 1001.1)


def test_session_worker_counts_from_the_restored_event() -> None:
    got = recovered(first_step=14, restore=Restore(step=13, source="memory"))
    assert (got.steps_lost, got.resumed_from, got.source) == (0, 13, "memory")


def test_a_step_completed_after_the_fault_but_before_the_restore_is_lost() -> None:
    late = [(14, 0, 2, FAULT + 0.05)]  # the survivor finished step 14 as the peer died
    got = recovered(first_step=14, restore=Restore(step=13, source="memory"), extra=late)
    assert got.steps_lost == 1


def test_no_restore_marker_after_the_new_round_is_not_observed() -> None:
    got = result(
        fault=FAULT, detected=1000.2, formed=1000.5, marks=[("group_ready", 1001.0)],
        audit=OLD, restore=None, ws_after=1,
    )  # fmt: skip
    assert got == Result()


def test_steps_lost_is_never_negative() -> None:
    assert steps_lost(10, 13) == 0
    assert steps_lost(13, 10) == 3


def test_restore_after_takes_the_first_restore_after_the_fault_and_all_its_sources() -> None:
    text = "\n".join([
        event("snapshot.restored", 990.0, step=5, source="storage", rank=1),  # b's join
        event("snapshot.restored", 1001.9, step=13, source="memory", rank=0),
        "not json",
        event("snapshot.restored", 1002.0, step=13, source="mirror", rank=1),
        event("snapshot.restored", 1050.0, step=40, source="storage", rank=0),  # a 2nd fault
        event("worker.failed", 1000.1),
    ])  # fmt: skip
    got = restore_after(parse_events(text), FAULT)
    assert got == Restore(step=13, source="memory+mirror")
    assert restore_after(parse_events(text), 2000.0) is None


def test_breakdown_spans_each_step_from_the_one_before_in_time_order() -> None:
    stamps = [("old", 5.0), ("b", 12.5), ("a", 11.0), ("a", 11.25), ("c", 14.0), ("c", 60.0)]
    # each name at its latest rank's first occurrence after 10 (the 60.0 is a later start);
    # "missing" is left out, "old" is before ``after``
    got = breakdown(stamps, ("old", "b", "a", "missing", "c"), 10.0)
    assert got == "b=+1.25 c=+1.50"


def test_torn_lines_are_skipped() -> None:
    assert parse_audit("1 0 2 5.0\n2 0 2 5.1\n3 0") == [(1, 0, 2, 5.0), (2, 0, 2, 5.1)]
    assert parse_markers("began 5.0 0 2\nrestored 5.") == [("began", 5.0)]


def test_torchrun_runs_the_plain_worker_only() -> None:
    pairs = recovery.runs(["torchrun", "elastic-train"], ["plain", "session"])
    assert pairs == [
        ("torchrun", "plain"),
        ("elastic-train", "plain"),
        ("elastic-train", "session"),
    ]


def test_table_shows_each_row_with_its_sources() -> None:
    base = Result(total=40.0, steps_lost=4, phases={})
    ours = Result(total=2.0, steps_lost=0, phases={}, resumed_from=13, source="memory")
    lines = recovery.table(
        "node_loss",
        {"torchrun (plain)": [base], "elastic-train (session)": [ours, ours]},
    )
    row = next(line for line in lines if line.startswith("elastic-train (session)"))
    assert row.split()[-2:] == ["0.050", "memory"]
    assert "median of 2" in lines[0]

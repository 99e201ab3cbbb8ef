"""Read a run's event log: JSON lines, one event each; anything else is skipped.

A run is named by its event log (the supervisor's ``--log-file``) or by a folder that holds
its logs as ``events*.jsonl`` — the built-in job's run folder has one ``events-<node>.jsonl``
per node, so nodes sharing a network file system never interleave lines in one file. The
events of all files are merged by timestamp.
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass
from typing import Any

from elastic_trainer.contract.events import parse_time as parse_time
from elastic_trainer.errors import ConfigError

LOG_PATTERN = "events*.jsonl"
# A log is written by the job, but read from a folder others may write: a line longer than
# any event, nesting deeper than any event's, or a field of the wrong type is no event.
MAX_LINE_CHARS = 1 << 20
MAX_DEPTH = 8
_TEXT_FIELDS = ("event", "node", "job_id", "level", "run_id", "status", "reason", "cause")
_LIMIT = 2**63


@dataclass(frozen=True)
class EventLog:
    path: str  # what the user named: one log file, or the run folder
    events: list[dict[str, Any]]  # each has "event" and "t" (seconds since the first event)
    skipped_lines: int
    files: tuple[str, ...] = ()  # the log files read


def resolve_logs(run: str) -> list[str]:
    """The event log files for RUN (a file, or a folder holding ``events*.jsonl``)."""
    if os.path.isdir(run):
        files = sorted(glob.glob(os.path.join(glob.escape(run), LOG_PATTERN)))
        if files:
            return files
        raise ConfigError(
            f"{run!r} is a folder without {LOG_PATTERN}: pass the supervisor's --log-file instead"
        )
    if not os.path.isfile(run):
        raise ConfigError(f"no such event log {run!r}: pass the supervisor's --log-file path")
    return [run]


def parse_lines(lines: list[str]) -> tuple[list[dict[str, Any]], int]:
    """Events (with a parsed ``time``) in file order, and how many lines were not events."""
    events, skipped = [], 0
    for line in lines:
        record = _event_or_none(line)
        if record is None:
            skipped += bool(line.strip())
            continue
        events.append(record)
    return events, skipped


def _event_or_none(line: str) -> dict[str, Any] | None:
    if len(line) > MAX_LINE_CHARS:
        return None
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, an integer of thousands of digits, nesting
        return None
    if not isinstance(record, dict) or not isinstance(record.get("event"), str):
        return None
    # null is a value of ours too (job.finished's reason): only another type is no event
    if any(f in record and not isinstance(record[f], (str, type(None))) for f in _TEXT_FIELDS):
        return None
    if not _plain(record, MAX_DEPTH):
        return None
    when = parse_time(record.get("timestamp"))
    if when is None:
        return None
    record["time"] = when
    return record


def _plain(value: Any, depth: int) -> bool:
    """Shallow enough, and every number one a summary can compute with (finite, in range)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return True
    if isinstance(value, int):
        return -_LIMIT <= value < _LIMIT
    if isinstance(value, float):
        return math.isfinite(value)
    if depth <= 0:
        return False
    items = value.values() if isinstance(value, dict) else value
    return all(_plain(v, depth - 1) for v in items)


def with_relative_time(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sort by time (stable) and add ``time`` (unix s) and ``t`` (s since the first event)."""
    timed = [{**e, "time": e.get("time", parse_time(e.get("timestamp")))} for e in events]
    ordered = sorted((e for e in timed if e["time"] is not None), key=lambda e: e["time"])
    start = ordered[0]["time"] if ordered else 0.0
    return [{**e, "t": e["time"] - start} for e in ordered]


def load_event_log(run: str) -> EventLog:
    files = resolve_logs(run)
    lines: list[str] = []
    for path in files:
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                lines.extend(handle.readlines())
        except OSError as exc:
            raise ConfigError(f"cannot read event log {path!r} ({exc.strerror})") from exc
    events, skipped = parse_lines(lines)
    if not events:
        raise ConfigError(
            f"{run!r} holds no elastic-train events (JSON lines with 'event' and "
            f"'timestamp'): pass the supervisor's --log-file"
        )
    return EventLog(
        path=run, events=with_relative_time(events), skipped_lines=skipped, files=tuple(files)
    )

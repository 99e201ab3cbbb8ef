"""Reads the new, complete lines of the workers' event files (``protocol.events_file``).

Each tick the observer asks for what was appended since the last tick. Only lines ended by
a newline count: a line a worker is still writing (or died writing) is left for later, so
nothing is read twice or half. Lines that are not JSON objects are skipped.
"""

from __future__ import annotations

import json
import os
from typing import Any

from elastic_trainer import protocol

_MAX_READ = 1 << 20  # per file and tick: a flood must not stall the monitor loop


class WorkerEventTail:
    """The events workers of one attempt appended since the last ``read``."""

    def __init__(self, control_dir: str, local_ranks: range) -> None:
        self._paths = [os.path.join(control_dir, protocol.events_file(r)) for r in local_ranks]
        self._offsets = dict.fromkeys(self._paths, 0)

    def read(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for path in self._paths:
            events.extend(self._read_one(path))
        return events

    def _read_one(self, path: str) -> list[dict[str, Any]]:
        try:
            with open(path, "rb") as handle:
                handle.seek(self._offsets[path])
                chunk = handle.read(_MAX_READ)
        except OSError:  # not written yet, or the attempt's folder is already gone
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offsets[path] += len(complete)
        return [e for e in map(_event_or_none, complete.splitlines()) if e is not None]


def _event_or_none(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("event"), str) else None

"""A run folder that holds a finished job: ``finished.json`` at its root says so.

A new command line pointed at such a folder (the same default ``runs/<job-id>``) resumes
from the job's end: it trains nothing, or only what its own settings add, and "succeeds" in
seconds. That is right for a resubmitted job and a surprise for someone who meant a fresh
run, so the supervisor says it once at start (``preflight.warning``) naming the way to a
fresh folder, and removes the record: the run now in the folder has not finished. The
record is written again when this run succeeds. JSON only, never pickle.
"""

from __future__ import annotations

import json
from typing import Any

FINISHED_NAME = "finished.json"
MAX_RECORD_BYTES = 64 << 10


def record(job_id: str, argv: list[str], finished_at: str) -> bytes:
    body = {"format": 1, "job_id": job_id, "argv": argv, "finished_at": finished_at}
    return json.dumps(body, indent=2, sort_keys=True).encode()


def parse(data: bytes) -> dict[str, Any] | None:
    """The record, or None when it is not one (damage is no reason to stop a job)."""
    try:
        body = json.loads(data)
    except ValueError:
        return None
    return body if isinstance(body, dict) and isinstance(body.get("job_id"), str) else None


def warning(url: str, recorded: dict[str, Any]) -> str:
    """The one line for a run folder that holds a finished job."""
    when = recorded.get("finished_at") or "earlier"
    return (
        f"{url} holds job {recorded['job_id']!r}, which finished at {when}: this run resumes "
        "from its end and trains only what its settings add; for a fresh run pass "
        "--job-id NAME (the built-in job then uses runs/NAME) or another --snapshot-dir"
    )


def check(storage: Any, url: str) -> str | None:
    """The warning for ``url`` if it holds a finished job, removing the record."""
    try:
        data = storage.read(FINISHED_NAME, limit=MAX_RECORD_BYTES)
    except (FileNotFoundError, ValueError):
        return None
    recorded = parse(data)
    storage.delete(FINISHED_NAME)
    return warning(url, recorded) if recorded is not None else None

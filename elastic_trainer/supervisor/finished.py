"""A run folder that holds a finished job: ``finished.json`` at its root says so.

The end of a job is final. The same command started later with the same job id and snapshot
folder (a scheduler's requeue, a node restarted after the end, the same command run twice)
does not train again: it exits 0 at once with one line saying when the job finished and how
to run it again (``already_finished``) -- a plain script would otherwise run from its start
once more. Asking for more is running it again: ``--resume-finished``, or another command
line (the built-in job's ``--max-steps`` left out to go on past a stop): the record is
removed (the run now in the folder has not finished), one line says so, and the job resumes
from its end. A node whose rendezvous fails because
the job finished while it was joining (the store host exited) also ends with exit 0
(``finished_while_joining``), not as a lost store. The record is written again when a run
succeeds. JSON only, never pickle.
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
    """The one line for a finished job's folder that ``--resume-finished`` runs again."""
    when = recorded.get("finished_at") or "earlier"
    return (
        f"{url} holds job {recorded['job_id']!r}, which finished at {when}: "
        "--resume-finished runs it again from its end (a TrainingSession trains only what its "
        "settings add, a plain script runs from its start); for a fresh run pass "
        "--job-id NAME (the built-in job then uses runs/NAME) or another --snapshot-dir"
    )


def done_line(url: str, recorded: dict[str, Any]) -> str:
    """The one line of a command started after its job finished (exit 0, nothing run)."""
    when = recorded.get("finished_at") or "earlier"
    return (
        f"job {recorded['job_id']!r} finished at {when} ({url}/{FINISHED_NAME}): nothing to "
        "run. To run it again from its end pass --resume-finished; for a fresh run, "
        "--job-id NAME or another --snapshot-dir"
    )


def read(storage: Any, job_id: str) -> dict[str, Any] | None:
    """The folder's record of ``job_id`` having finished; None otherwise (no record, damage,
    another job's: the folder's owner record deals with that)."""
    try:
        data = storage.read(FINISHED_NAME, limit=MAX_RECORD_BYTES)
    except (FileNotFoundError, ValueError):
        return None
    recorded = parse(data)
    return recorded if recorded is not None and recorded["job_id"] == job_id else None


def already_finished(
    storage: Any, url: str, job_id: str, argv: list[str], *, resume: bool
) -> str | None:
    """``done_line`` when the folder says ``job_id`` finished under this very command line
    (``argv``: the script and its arguments) and ``resume`` is off. Otherwise (asked, or
    another command line): the record is removed, ``warning`` says so, and None comes back."""
    recorded = read(storage, job_id)
    if recorded is None:
        return None
    if not resume and recorded.get("argv") == argv:
        return done_line(url, recorded)
    storage.delete(FINISHED_NAME)
    from elastic_trainer.contract.events import emit

    emit("preflight.warning", level="warning", warning=warning(url, recorded))
    return None


def finished_while_joining(recorded: dict[str, Any] | None, *, started_at: float) -> bool:
    """Pure: did the job finish after this node started (``started_at``, unix s)? Then a
    rendezvous that failed meanwhile failed because the job ended, not the store."""
    from elastic_trainer.contract.events import parse_time

    when = parse_time(recorded.get("finished_at")) if recorded is not None else None
    return when is not None and when >= started_at

"""A snapshot folder belongs to one job: ``owner.json`` at its root names it.

``owner.json`` is JSON (never pickle): ``{"format": 1, "job_id", "run_token", "created_at"}``.
The first store with an ``Owner`` creates it with an exclusive create, so of two jobs
starting at once exactly one claims the folder. Then, for a store with an ``Owner``:

- another job's folder is refused at start-up (``SnapshotOwnerError``, one line naming both
  job ids and the fix);
- the same job id with another run token (a resumed or requeued job: a new supervisor run)
  adopts the folder: it rewrites ``owner.json`` with its run token (``snapshot.adopted``);
- before every save's first write, before its commit (the manifest) and before pruning, the
  store re-reads ``owner.json``: once a newer run of the same job has adopted the folder,
  the older run's saves fail (``snapshot.failed`` naming both runs) and it prunes nothing.

The checks are re-reads, not locks: a run that loses the folder between a check and its
manifest write can still commit that one step (never over another's: manifests are created
exclusively), but it never deletes anything once it has seen the newer owner.
A store without an ``Owner`` (standalone use, the ops CLI) neither reads nor writes it.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from snapshots.errors import SnapshotOwnerError
from snapshots.events import emit
from snapshots.manifest import now_iso
from snapshots.storage import Storage

OWNER_NAME = "owner.json"
OWNER_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class Owner:
    """Who writes a snapshot folder: a job (stable across restarts) and one run of it."""

    job_id: str
    run_token: str
    created_at: str = ""  # when the run claimed the folder; set when written

    def __post_init__(self) -> None:
        for name in ("job_id", "run_token"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"Owner.{name} must be a non-empty string, got {value!r}")


class Claim(enum.Enum):
    MINE = "mine"  # this very run owns it
    FREE = "free"  # nobody recorded: claim it
    ADOPT = "adopt"  # an earlier (or concurrent) run of the same job: take it over
    FOREIGN = "foreign"  # another job's folder


def decide(recorded: Owner | None, me: Owner) -> Claim:
    """Pure: what a run may do with a folder whose recorded owner is ``recorded``."""
    if recorded is None:
        return Claim.FREE
    if recorded.job_id != me.job_id:
        return Claim.FOREIGN
    return Claim.MINE if recorded.run_token == me.run_token else Claim.ADOPT


def to_json(owner: Owner) -> bytes:
    body = {
        "format": OWNER_FORMAT,
        "job_id": owner.job_id,
        "run_token": owner.run_token,
        "created_at": owner.created_at or now_iso(),
    }
    return json.dumps(body, indent=2, sort_keys=True).encode()


def from_json(data: bytes, url: str) -> Owner:
    try:
        body = json.loads(data)
        return Owner(
            job_id=body["job_id"],
            run_token=body["run_token"],
            created_at=str(body.get("created_at", "")),
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise SnapshotOwnerError(
            f"{url}/{OWNER_NAME} is not a valid owner record ({type(exc).__name__}: {exc}); "
            f"delete it to let the job that should own {url} claim it again"
        ) from exc


def read(storage: Storage, url: str) -> Owner | None:
    try:
        return from_json(storage.read(OWNER_NAME), url)
    except FileNotFoundError:
        return None


def claim(storage: Storage, url: str, me: Owner) -> None:
    """At start-up: claim a free folder, adopt one of an earlier run of this job, refuse
    another job's."""
    recorded = read(storage, url)
    verdict = decide(recorded, me)
    if verdict is Claim.FREE:
        try:
            storage.write(OWNER_NAME, to_json(me), exclusive=True)
            return
        except FileExistsError:  # claimed meanwhile: judge the winner's record
            recorded = read(storage, url)
            verdict = decide(recorded, me)
    if verdict is Claim.FOREIGN:
        raise SnapshotOwnerError(_foreign(url, recorded, me))
    if verdict is Claim.ADOPT and recorded is not None:
        storage.write(OWNER_NAME, to_json(me))
        emit(
            "snapshot.adopted",
            url=url,
            job_id=me.job_id,
            run_token=me.run_token,
            previous_run_token=recorded.run_token,
        )


def ensure_mine(storage: Storage, url: str, me: Owner) -> None:
    """Before writing or deleting: the folder must still be this run's."""
    recorded = read(storage, url)
    verdict = decide(recorded, me)
    if verdict is Claim.MINE:
        return
    if verdict is Claim.FREE:
        raise SnapshotOwnerError(
            f"{url}/{OWNER_NAME} of job {me.job_id!r} disappeared while run {me.run_token} "
            "was writing; restart the job so that it claims the folder again"
        )
    if verdict is Claim.ADOPT and recorded is not None:
        raise SnapshotOwnerError(
            f"snapshot folder {url} was taken over by run {recorded.run_token} of job "
            f"{me.job_id!r}; this run ({me.run_token}) no longer writes there: stop it, only "
            "one run of a job may write its snapshots"
        )
    raise SnapshotOwnerError(_foreign(url, recorded, me))


def _foreign(url: str, recorded: Owner | None, me: Owner) -> str:
    other = recorded.job_id if recorded is not None else "?"
    return (
        f"snapshot folder {url} belongs to job {other!r}, not to job {me.job_id!r}; give job "
        f"{me.job_id!r} its own snapshot folder (--snapshot-dir), or delete {url}/{OWNER_NAME} "
        f"if job {other!r} is gone for good"
    )

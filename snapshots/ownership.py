"""A snapshot folder belongs to one job: ``owner.json`` at its root names it.

``owner.json`` is JSON (never pickle): ``{"format": 1, "job_id", "run_token", "created_at",
"lineage", "alive_at", "beat_s", "ended_at"}`` (the last four may be absent: older records).
The first store with an ``Owner`` creates it with an exclusive create, so of two jobs
starting at once exactly one claims the folder. Then, for a store with an ``Owner``:

- another job's folder is refused at start-up (``SnapshotOwnerError``, one line naming both
  job ids and the fix);
- the same job id with another run token (a resumed or requeued job: a new supervisor run)
  adopts the folder: it rewrites ``owner.json`` with its run token (``snapshot.adopted``),
  unless the recorded run is still alive and not of this run's lineage (below);
- before every save's first write, before its commit (the manifest) and before pruning, the
  store re-reads ``owner.json``: once a newer run of the same job has adopted the folder,
  the older run's saves fail (``snapshot.failed`` naming both runs) and it prunes nothing.

The checks are re-reads, not locks: a run that loses the folder between a check and its
manifest write can still commit that one step (never over another's: manifests are created
exclusively), but it never deletes anything once it has seen the newer owner.
A store without an ``Owner`` (standalone use, the ops CLI) neither reads nor writes it.

Liveness. The owning run refreshes ``alive_at`` (unix seconds) on the save path's owner
check, at most every ``REFRESH_S``; ``beat_s`` is the longest gap it has had between two
refreshes (so a run saving every 10 minutes is not taken for dead after 2), and a clean end
(the store closed by the run's writer) records ``ended_at``. A run of the same job with
another token adopts the folder when the recorded run has ended, is of the same
``lineage`` (one rendezvous store: a re-formed round, whose earlier round its agents have
stopped), has no heartbeat (an older record), or was last alive more than ``stale_after_s``
ago: ``max(3 * beat_s, MIN_STALE_S)``. Otherwise the folder is being written by a live run
this one is not part of (a node that started its own rendezvous next to the job's) and it
is refused (``SnapshotOwnerError``, one line naming that run and the fix). A run without a
lineage (launched by plain torchrun) cannot tell its own re-forms apart and adopts as before.

A run that is gone is known gone at once, without waiting for its heartbeat to age: the record
also names where the run lives (its host and boot, its supervisor's pid and start time, its
rendezvous store's endpoint), and a store given a ``probe`` (the worker's:
``elastic_trainer/worker/run_liveness.py``) asks before refusing: True (its supervisor is
alive on this host, or its store answers with its lineage), False (the supervisor is gone,
or nothing or another store answers there: a job killed hard and started again) or None
(could not tell: a host that does not answer; the heartbeat's age decides, as without one).
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from snapshots.errors import SnapshotOwnerError
from snapshots.events import emit
from snapshots.format.manifest import now_iso
from snapshots.storage import Storage

OWNER_NAME = "owner.json"
OWNER_FORMAT = 1
REFRESH_S = 10.0  # the owning run rewrites alive_at at most this often
MIN_STALE_S = 120.0  # a record's heartbeat is trusted at least this long


@dataclass(frozen=True, kw_only=True)
class Owner:
    """Who writes a snapshot folder: a job (stable across restarts) and one run of it."""

    job_id: str
    run_token: str
    created_at: str = ""  # when the run claimed the folder; set when written
    lineage: str = ""  # the rendezvous store the run formed on; "" unknown (torchrun)
    alive_at: float | None = None  # unix seconds of the run's last heartbeat; None: unknown
    beat_s: float = 0.0  # the longest gap between two of the run's heartbeats so far
    ended_at: float | None = None  # unix seconds of the run's clean end; None: not ended
    # where the run lives, for a probe (``claim``); empty: not known (an older record)
    host: str = ""  # the host name of the node whose worker wrote the record
    boot_id: str = ""  # that host's boot (a pid means nothing across reboots)
    pid: int | None = None  # that node's supervisor
    pid_started: float | None = None  # its start time (unix s): pids are reused
    store: str = ""  # the run's rendezvous store endpoint, HOST:PORT

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
    LIVE = "live"  # a live run of the same job on another rendezvous: not ours to take


def stale_after_s(recorded: Owner) -> float:
    """How long after its last heartbeat a run is taken for gone."""
    return max(3 * recorded.beat_s, MIN_STALE_S)


def decide(recorded: Owner | None, me: Owner, *, now: float, alive: bool | None = None) -> Claim:
    """Pure: what a run may do, at unix time ``now``, with a folder whose recorded owner is
    ``recorded``; ``alive``: what a probe found of the recorded run (None: not known)."""
    if recorded is None:
        return Claim.FREE
    if recorded.job_id != me.job_id:
        return Claim.FOREIGN
    if recorded.run_token == me.run_token:
        return Claim.MINE
    if _may_take_over(recorded, me, now, alive):
        return Claim.ADOPT
    return Claim.LIVE


def _may_take_over(recorded: Owner, me: Owner, now: float, alive: bool | None) -> bool:
    if recorded.ended_at is not None or not me.lineage or recorded.alive_at is None:
        return True
    if recorded.lineage == me.lineage:
        return True
    if alive is not None:
        return not alive
    return now - recorded.alive_at > stale_after_s(recorded)


def to_json(owner: Owner) -> bytes:
    body = {
        "format": OWNER_FORMAT,
        "job_id": owner.job_id,
        "run_token": owner.run_token,
        "created_at": owner.created_at or now_iso(),
        "lineage": owner.lineage,
        "alive_at": owner.alive_at,
        "beat_s": owner.beat_s,
        "ended_at": owner.ended_at,
        "host": owner.host,
        "boot_id": owner.boot_id,
        "pid": owner.pid,
        "pid_started": owner.pid_started,
        "store": owner.store,
    }
    return json.dumps(body, indent=2, sort_keys=True).encode()


def from_json(data: bytes, url: str) -> Owner:
    try:
        body = json.loads(data)
        return Owner(
            job_id=body["job_id"],
            run_token=body["run_token"],
            created_at=str(body.get("created_at", "")),
            lineage=str(body.get("lineage") or ""),
            alive_at=_seconds(body.get("alive_at")),
            beat_s=_seconds(body.get("beat_s")) or 0.0,
            ended_at=_seconds(body.get("ended_at")),
            host=_text(body.get("host")),
            boot_id=_text(body.get("boot_id")),
            pid=_pid(body.get("pid")),
            pid_started=_seconds(body.get("pid_started")),
            store=_text(body.get("store")),
        )
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise SnapshotOwnerError(
            f"{url}/{OWNER_NAME} is not a valid owner record ({type(exc).__name__}: {exc}); "
            f"delete it to let the job that should own {url} claim it again"
        ) from exc


def _seconds(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected seconds (a number), got {value!r}")
    return float(value)


def _text(value: object) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > 300 or not value.isprintable():
        raise TypeError(f"expected short printable text, got {value!r:.80}")
    return value


def _pid(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
        raise TypeError(f"expected a process id, got {value!r:.80}")
    return value


def read(storage: Storage, url: str) -> Owner | None:
    try:
        return from_json(storage.read(OWNER_NAME), url)
    except FileNotFoundError:
        return None


Probe = Callable[[Owner], "bool | None"]


def claim(
    storage: Storage, url: str, me: Owner, *, now: float | None = None, probe: Probe | None = None
) -> None:
    """At start-up: claim a free folder, adopt one of an earlier run of this job that has
    ended, is gone (``probe``), gone stale or belongs to this run's lineage; refuse another
    job's or a live one."""
    now = time.time() if now is None else now
    mine = replace(me, alive_at=now, beat_s=0.0, ended_at=None)
    recorded = read(storage, url)
    verdict, alive = _judged(recorded, me, now, probe)
    if verdict is Claim.FREE:
        try:
            storage.write(OWNER_NAME, to_json(mine), exclusive=True)
            return
        except FileExistsError:  # claimed meanwhile: judge the winner's record
            recorded = read(storage, url)
            verdict, alive = _judged(recorded, me, now, probe)
    if verdict is Claim.FOREIGN:
        raise SnapshotOwnerError(_foreign(url, recorded, me))
    if verdict is Claim.LIVE and recorded is not None:
        raise SnapshotOwnerError(_live(url, recorded, now))
    if verdict is Claim.ADOPT and recorded is not None:
        storage.write(OWNER_NAME, to_json(mine))
        emit(
            "snapshot.adopted",
            url=url,
            job_id=me.job_id,
            run_token=me.run_token,
            previous_run_token=recorded.run_token,
            reason=adopt_reason(recorded, me, alive),
        )


def _judged(
    recorded: Owner | None, me: Owner, now: float, probe: Probe | None
) -> tuple[Claim, bool | None]:
    """``decide``, asking ``probe`` only where the answer turns on whether the run lives;
    and what the probe said (None: not asked, or it could not tell)."""
    verdict, alive = decide(recorded, me, now=now), None
    if verdict is Claim.LIVE and probe is not None and recorded is not None:
        alive = probe(recorded)
        verdict = decide(recorded, me, now=now, alive=alive)
    return verdict, alive


def adopt_reason(recorded: Owner, me: Owner, alive: bool | None) -> str:
    """Pure: why a run of the same job may take the folder over (``snapshot.adopted``)."""
    if recorded.ended_at is not None:
        return "ended"
    if not me.lineage or recorded.alive_at is None:
        return "unknown"  # torchrun without a lineage, or an older record
    if recorded.lineage == me.lineage:
        return "same_rendezvous"
    return "gone" if alive is False else "stale"


def ensure_mine(storage: Storage, url: str, me: Owner, *, now: float | None = None) -> None:
    """Before writing or deleting: the folder must still be this run's. Refreshes this run's
    heartbeat when it is ``REFRESH_S`` old (the save path calls this before every save)."""
    now = time.time() if now is None else now
    recorded = read(storage, url)
    verdict = decide(recorded, me, now=now)
    if verdict is Claim.MINE and recorded is not None:
        _refresh(storage, recorded, now)
        return
    if verdict is Claim.FREE:
        raise SnapshotOwnerError(
            f"{url}/{OWNER_NAME} of job {me.job_id!r} disappeared while run {me.run_token} "
            "was writing; restart the job so that it claims the folder again"
        )
    if verdict in (Claim.ADOPT, Claim.LIVE) and recorded is not None:
        raise SnapshotOwnerError(
            f"snapshot folder {url} was taken over by run {recorded.run_token} of job "
            f"{me.job_id!r}; this run ({me.run_token}) no longer writes there: stop it, only "
            "one run of a job may write its snapshots"
        )
    raise SnapshotOwnerError(_foreign(url, recorded, me))


def _refresh(storage: Storage, recorded: Owner, now: float) -> None:
    last = recorded.alive_at
    if last is not None and now - last < REFRESH_S:
        return
    gap = max(recorded.beat_s, now - last) if last is not None else recorded.beat_s
    storage.write(OWNER_NAME, to_json(replace(recorded, alive_at=now, beat_s=gap)))


def end(storage: Storage, url: str, me: Owner, *, now: float | None = None) -> None:
    """The run's writer closed cleanly: record ``ended_at`` so that the next run of the job
    adopts the folder at once. Nothing if the folder is no longer this run's."""
    now = time.time() if now is None else now
    recorded = read(storage, url)
    if recorded is not None and decide(recorded, me, now=now) is Claim.MINE:
        storage.write(OWNER_NAME, to_json(replace(recorded, alive_at=now, ended_at=now)))


def _live(url: str, recorded: Owner, now: float) -> str:
    ago = now - recorded.alive_at if recorded.alive_at is not None else 0.0
    return (
        f"snapshot folder {url} is being written by run {recorded.run_token} of job "
        f"{recorded.job_id!r} (alive {ago:.0f} s ago): this node's agent is not part of that "
        "job's rendezvous; start it with the job's --rdzv-endpoint or wait for that run to "
        f"end (its record goes stale {stale_after_s(recorded):.0f} s after its last heartbeat)"
    )


def _foreign(url: str, recorded: Owner | None, me: Owner) -> str:
    other = recorded.job_id if recorded is not None else "?"
    return (
        f"snapshot folder {url} belongs to job {other!r}, not to job {me.job_id!r}; give job "
        f"{me.job_id!r} its own snapshot folder (--snapshot-dir), or delete {url}/{OWNER_NAME} "
        f"if job {other!r} is gone for good"
    )

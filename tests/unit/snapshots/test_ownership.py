"""A snapshot folder belongs to one job (owner.json); a resumed job adopts it; a concurrent
second run of the same job takes it over and the older run can no longer save or prune.

Without it, two jobs sharing a folder prune each other's snapshots, and a job resumes
silently from another job's state.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from snapshots import Owner, SnapshotOwnerError, SnapshotSaveError, SnapshotStore
from snapshots.ownership import (
    MIN_STALE_S,
    OWNER_NAME,
    Claim,
    adopt_reason,
    decide,
    from_json,
    to_json,
)


def _x(value: float) -> dict[str, torch.Tensor]:
    return {"x": torch.full((4,), value)}


def _store(root: Path, job: str, run: str, lineage: str = "", **kwargs: object) -> SnapshotStore:
    owner = Owner(job_id=job, run_token=run, lineage=lineage)
    return SnapshotStore(str(root), owner=owner, async_save=False, **kwargs)  # type: ignore[arg-type]


def test_decisions() -> None:
    me = Owner(job_id="a", run_token="r2")
    assert decide(None, me, now=0) is Claim.FREE
    assert decide(Owner(job_id="a", run_token="r2"), me, now=0) is Claim.MINE
    assert decide(Owner(job_id="a", run_token="r1"), me, now=0) is Claim.ADOPT
    assert decide(Owner(job_id="b", run_token="r2"), me, now=0) is Claim.FOREIGN


def test_a_live_run_of_another_lineage_is_not_adopted() -> None:
    """Node b restarted next to a live job, formed its own rendezvous (another lineage) and
    took the folder over; the live run then failed. Now only a run that is gone is taken."""
    me = Owner(job_id="a", run_token="r2", lineage="store-2")
    live = Owner(job_id="a", run_token="r1", lineage="store-1", alive_at=1000.0, beat_s=10.0)
    assert decide(live, me, now=1012.0) is Claim.LIVE
    assert decide(live, me, now=1000.0 + MIN_STALE_S + 1) is Claim.ADOPT  # stale
    slow = Owner(job_id="a", run_token="r1", lineage="store-1", alive_at=1000.0, beat_s=600.0)
    assert decide(slow, me, now=1000.0 + MIN_STALE_S + 1) is Claim.LIVE  # saves 10 min apart
    assert decide(slow, me, now=1000.0 + 3 * 600 + 1) is Claim.ADOPT
    ended = Owner(job_id="a", run_token="r1", lineage="store-1", alive_at=1000.0, ended_at=1000.0)
    assert decide(ended, me, now=1001.0) is Claim.ADOPT  # a requeue after a clean end
    reformed = Owner(job_id="a", run_token="r1", lineage="store-2", alive_at=1000.0)
    assert decide(reformed, me, now=1001.0) is Claim.ADOPT  # a re-form on the job's store
    torchrun = Owner(job_id="a", run_token="r2b")  # no lineage: cannot tell, adopts as before
    assert decide(live, torchrun, now=1012.0) is Claim.ADOPT
    older = Owner(job_id="a", run_token="r1", lineage="store-1")  # a record without heartbeat
    assert decide(older, me, now=1012.0) is Claim.ADOPT


def test_a_node_next_to_a_live_run_is_refused_with_one_line(tmp_path: Path) -> None:
    live = _store(tmp_path, "job-a", "run-1", lineage="store-1")
    live.save(1, _x(1))
    with pytest.raises(SnapshotOwnerError) as info:
        _store(tmp_path, "job-a", "run-2", lineage="store-2")
    message = str(info.value)
    assert "\n" not in message and "run-1" in message and "--rdzv-endpoint" in message
    live.save(2, _x(2))  # the live run goes on writing its folder
    assert [i.step for i in live.list()] == [1, 2]


def test_the_same_lineage_takes_over_at_once(tmp_path: Path) -> None:
    _store(tmp_path, "job-a", "run-1", lineage="store-1").save(1, _x(1))
    _store(tmp_path, "job-a", "run-2", lineage="store-1").save(2, _x(2))
    assert json.loads((tmp_path / OWNER_NAME).read_text())["run_token"] == "run-2"


def test_a_clean_end_lets_the_next_run_adopt_at_once(tmp_path: Path) -> None:
    with _store(tmp_path, "job-a", "run-1", lineage="store-1") as first:
        first.save(1, _x(1))
    assert json.loads((tmp_path / OWNER_NAME).read_text())["ended_at"] is not None
    _store(tmp_path, "job-a", "run-2", lineage="store-2").save(2, _x(2))


def test_a_stale_run_is_adopted(tmp_path: Path) -> None:
    gone = Owner(
        job_id="job-a", run_token="run-1", lineage="s1", alive_at=time.time() - MIN_STALE_S - 5
    )
    (tmp_path / OWNER_NAME).write_bytes(to_json(gone))
    with capture_logs() as logs:
        _store(tmp_path, "job-a", "run-2", lineage="s2").save(1, _x(1))
    assert json.loads((tmp_path / OWNER_NAME).read_text())["run_token"] == "run-2"
    (adopted,) = [e for e in logs if e["event"] == "snapshot.adopted"]
    assert (adopted["previous_run_token"], adopted["reason"]) == ("run-1", "stale")


def test_a_probe_decides_a_fresh_record_of_another_lineage(tmp_path: Path) -> None:
    """A job killed hard and started again: its dead run's record is seconds old. A probe
    that finds the run gone adopts at once; one that finds it alive refuses; one that cannot
    tell leaves it to the heartbeat's age."""
    me = Owner(job_id="a", run_token="r2", lineage="store-2")
    fresh = Owner(job_id="a", run_token="r1", lineage="store-1", alive_at=1000.0, beat_s=10.0)
    assert decide(fresh, me, now=1001.0, alive=False) is Claim.ADOPT
    assert decide(fresh, me, now=1001.0, alive=True) is Claim.LIVE
    assert decide(fresh, me, now=1001.0, alive=None) is Claim.LIVE
    assert adopt_reason(fresh, me, False) == "gone"
    (tmp_path / OWNER_NAME).write_bytes(to_json(replace(fresh, alive_at=time.time())))
    asked: list[Owner] = []

    def gone(recorded: Owner) -> bool:
        asked.append(recorded)
        return False

    with capture_logs() as logs:
        SnapshotStore(str(tmp_path), owner=me, owner_probe=gone, async_save=False)
    assert [o.run_token for o in asked] == ["r1"]
    assert [e["reason"] for e in logs if e["event"] == "snapshot.adopted"] == ["gone"]
    with pytest.raises(SnapshotOwnerError, match="is being written by run r2"):
        other = Owner(job_id="a", run_token="r3", lineage="store-3")
        SnapshotStore(str(tmp_path), owner=other, owner_probe=lambda o: True, async_save=False)


def test_where_a_run_lives_round_trips_and_bad_values_are_one_line(tmp_path: Path) -> None:
    where = Owner(job_id="a", run_token="r", lineage="l", alive_at=1.0, host="h", boot_id="b",
                  pid=42, pid_started=5.5, store="127.0.0.1:29400")  # fmt: skip
    back = from_json(to_json(where), "u")  # one record: to_json stamps created_at when unset
    assert back == replace(where, created_at=back.created_at)
    for field, bad in (("pid", "42"), ("host", "\x1b]0;x\x07"), ("store", ["x"])):
        body = json.loads(to_json(where))
        body[field] = bad
        with pytest.raises(SnapshotOwnerError, match="not a valid owner record"):
            from_json(json.dumps(body).encode(), "u")


def test_the_owner_refreshes_its_heartbeat_on_saves(tmp_path: Path) -> None:
    store = _store(tmp_path, "job-a", "run-1", lineage="s1")
    record = json.loads((tmp_path / OWNER_NAME).read_text())
    record["alive_at"] -= 60  # as if the last save had been a minute ago
    (tmp_path / OWNER_NAME).write_text(json.dumps(record))
    before = time.time()
    store.save(1, _x(1))
    after = json.loads((tmp_path / OWNER_NAME).read_text())
    assert after["alive_at"] >= before and after["beat_s"] >= 60


def test_owner_fields_are_validated() -> None:
    with pytest.raises(ValueError, match="job_id"):
        Owner(job_id="", run_token="r")


def test_the_first_job_records_itself_as_json(tmp_path: Path) -> None:
    _store(tmp_path, "job-a", "run-1")
    record = json.loads((tmp_path / OWNER_NAME).read_text())
    assert (record["job_id"], record["run_token"]) == ("job-a", "run-1")
    assert record["created_at"]


def test_a_second_job_is_refused_with_one_line_naming_both(tmp_path: Path) -> None:
    first = _store(tmp_path, "job-a", "run-1", keep=1)
    first.save(5, _x(5))
    with pytest.raises(SnapshotOwnerError) as info:
        _store(tmp_path, "job-b", "run-9", keep=1)
    message = str(info.value)
    assert "\n" not in message and "'job-a'" in message and "'job-b'" in message
    assert "--snapshot-dir" in message
    assert [i.step for i in first.list()] == [5]  # untouched


def test_a_resumed_job_adopts_its_folder(tmp_path: Path) -> None:
    _store(tmp_path, "job-a", "run-1").save(1, _x(1))
    with capture_logs() as logs:
        resumed = _store(tmp_path, "job-a", "run-2")
    assert [e["previous_run_token"] for e in logs if e["event"] == "snapshot.adopted"] == ["run-1"]
    assert json.loads((tmp_path / OWNER_NAME).read_text())["run_token"] == "run-2"
    assert resumed.latest().step == 1  # type: ignore[union-attr]
    resumed.save(2, _x(2))


def test_an_older_run_cannot_save_or_prune_after_a_takeover(tmp_path: Path) -> None:
    old = _store(tmp_path, "job-a", "run-1", keep=1)
    old.save(100, _x(100))
    new = _store(tmp_path, "job-a", "run-2", keep=5)  # a concurrent second run
    new.save(3, _x(3))
    with capture_logs() as logs, pytest.raises(SnapshotSaveError, match="taken over"):
        old.save(200, _x(200))  # with keep=1 it would have pruned steps 3 and 100
    failed = [e for e in logs if e["event"] == "snapshot.failed"]
    assert len(failed) == 1 and "run-2" in failed[0]["error"] and "run-1" in failed[0]["error"]
    assert [i.step for i in new.list()] == [3, 100]
    with pytest.raises(SnapshotOwnerError):
        old.prune(1)
    assert [i.step for i in new.list()] == [3, 100]


def test_of_two_jobs_starting_at_once_exactly_one_owns_the_folder(tmp_path: Path) -> None:
    barrier = threading.Barrier(2)
    outcomes: dict[str, str] = {}

    def start(job: str) -> None:
        barrier.wait()
        try:
            _store(tmp_path, job, f"run-{job}")
            outcomes[job] = "owner"
        except SnapshotOwnerError:
            outcomes[job] = "refused"

    threads = [threading.Thread(target=start, args=(job,)) for job in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(outcomes.values()) == ["owner", "refused"]
    winner = next(job for job, outcome in outcomes.items() if outcome == "owner")
    assert json.loads((tmp_path / OWNER_NAME).read_text())["job_id"] == winner


def test_a_malformed_record_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / OWNER_NAME).write_text("{not json")
    with pytest.raises(SnapshotOwnerError, match=f"{OWNER_NAME} is not a valid owner record"):
        _store(tmp_path, "job-a", "run-1")


def test_without_an_owner_nothing_is_checked_or_recorded(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path), async_save=False)
    store.save(1, _x(1))
    assert not (tmp_path / OWNER_NAME).exists()
    _store(tmp_path, "job-a", "run-1")  # a job may then claim the folder
    store.save(2, _x(2))  # and a standalone store (ops, scripts) still works there
    assert [i.step for i in store.list()] == [1, 2]

"""The snapshot folder's record of a failed-over store: written, read back, trusted only
when the store it names answers with the recorded lineage."""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs
from torch.distributed import HashStore

from elastic_trainer.supervisor.rendezvous import store_record
from elastic_trainer.supervisor.rendezvous.handler import share_lineage
from elastic_trainer.supervisor.rendezvous.store_record import StoreRecord

RECORD = StoreRecord(job_id="job", endpoint="127.0.0.12:29500", lineage="abc")


def test_a_record_round_trips_and_damage_is_no_record() -> None:
    assert store_record.decode(store_record.encode(RECORD)) == RECORD
    for bad in (
        b"",
        b"{",
        b"[]",
        b'{"job_id": "job"}',
        b'{"job_id": 1, "endpoint": "e", "lineage": "l"}',
    ):
        assert store_record.decode(bad) is None


def test_the_folder_keeps_this_jobs_record_only(tmp_path: Path) -> None:
    folder = str(tmp_path / "snap")
    assert store_record.read(folder, "job") is None  # nothing written yet
    store_record.write(folder, RECORD)
    assert (tmp_path / "snap" / store_record.RECORD_NAME).is_file()
    assert store_record.read(folder, "job") == RECORD
    assert store_record.read(folder, "another-job") is None
    assert store_record.read(None, "job") is None


def test_a_folder_that_cannot_take_it_says_so_and_goes_on(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with capture_logs() as logs:
        store_record.write(str(blocker / "snap"), RECORD)
    (event,) = logs
    assert event["event"] == "store.record_failed" and RECORD.endpoint in event["consequence"]


def found(folder: str, stores: dict[tuple[str, int], object], configured: str = "127.0.0.11:29500"):
    return store_record.find(
        folder, "job", configured=configured, connect=lambda host, port: stores.get((host, port))
    )


def test_a_node_joins_the_recorded_store_only_if_it_answers_with_the_lineage(
    tmp_path: Path,
) -> None:
    folder = str(tmp_path / "snap")
    moved = HashStore()
    lineage = share_lineage(moved, "job")
    store_record.write(
        folder, StoreRecord(job_id="job", endpoint="127.0.0.12:29500", lineage=lineage)
    )
    assert found(folder, {("127.0.0.12", 29500): moved}) == (moved, "127.0.0.12:29500")
    # nothing answers there (the job ended): the configured endpoint, as without a record
    assert found(folder, {}) is None
    # another store answers there (another job's, a restarted one): not ours
    assert found(folder, {("127.0.0.12", 29500): HashStore()}) is None
    # the record names the configured endpoint: nothing moved
    assert found(folder, {("127.0.0.12", 29500): moved}, configured="127.0.0.12:29500") is None

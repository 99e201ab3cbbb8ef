"""The snapshot folder's record of a failed-over store: written, read back, trusted only
when the store it names answers with the recorded lineage."""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs
from torch.distributed import HashStore

from elastic_trainer.contract.auth import JobKey
from elastic_trainer.supervisor.rendezvous import store_record
from elastic_trainer.supervisor.rendezvous.endpoint import EndpointError
from elastic_trainer.supervisor.rendezvous.handler import share_lineage
from elastic_trainer.supervisor.rendezvous.signed_store import SignedStore
from elastic_trainer.supervisor.rendezvous.store_record import StoreRecord

RECORD = StoreRecord(job_id="job", endpoint="127.0.0.12:29500", lineage="abc")
KEY = JobKey.generate()


def test_a_record_round_trips_and_damage_is_no_record() -> None:
    assert store_record.decode(store_record.encode(RECORD, KEY), KEY) == RECORD
    for bad in (
        b"",
        b"{",
        b"[]",
        b'{"job_id": "job"}',
        b'{"job_id": 1, "endpoint": "e", "lineage": "l"}',
        b"[" * 100_000,
    ):
        assert store_record.decode(bad, KEY) is None


def test_a_record_not_signed_with_the_jobs_secret_is_no_record() -> None:
    """Whoever can write the folder but lacks the secret cannot point nodes elsewhere."""
    assert store_record.decode(store_record.encode(RECORD, JobKey.generate()), KEY) is None
    forged = store_record.encode(RECORD, KEY).replace(b"127.0.0.12", b"127.0.0.66")
    assert store_record.decode(forged, KEY) is None


def test_the_folder_keeps_this_jobs_record_only(tmp_path: Path) -> None:
    folder = str(tmp_path / "snap")
    assert store_record.read(folder, "job", KEY) is None  # nothing written yet
    store_record.write(folder, RECORD, KEY)
    assert (tmp_path / "snap" / store_record.RECORD_NAME).is_file()
    assert store_record.read(folder, "job", KEY) == RECORD
    assert store_record.read(folder, "another-job", KEY) is None
    assert store_record.read(None, "job", KEY) is None


def test_an_unsigned_record_is_ignored_with_an_event(tmp_path: Path) -> None:
    folder = tmp_path / "snap"
    folder.mkdir()
    (folder / store_record.RECORD_NAME).write_bytes(store_record.encode(RECORD, JobKey.generate()))
    with capture_logs() as logs:
        assert store_record.read(str(folder), "job", KEY) is None
    (event,) = logs
    assert (event["event"], event["reason"]) == ("store.record_ignored", "not_signed")


def test_a_folder_that_cannot_take_it_says_so_and_goes_on(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with capture_logs() as logs:
        store_record.write(str(blocker / "snap"), RECORD, KEY)
    (event,) = logs
    assert event["event"] == "store.record_failed" and RECORD.endpoint in event["consequence"]


def found(folder: str, stores: dict[tuple[str, int], object], configured: str = "127.0.0.11:29500"):
    def connect(host: str, port: int) -> object:
        store = stores.get((host, port))
        if isinstance(store, Exception):
            raise store
        return store

    return store_record.find(folder, "job", key=KEY, configured=configured, connect=connect)


def test_a_node_joins_the_recorded_store_only_if_it_answers_with_the_lineage(
    tmp_path: Path,
) -> None:
    folder = str(tmp_path / "snap")
    moved = SignedStore(HashStore(), KEY)
    lineage = share_lineage(moved, "job")
    store_record.write(
        folder, StoreRecord(job_id="job", endpoint="127.0.0.12:29500", lineage=lineage), KEY
    )
    assert found(folder, {("127.0.0.12", 29500): moved}) == (moved, "127.0.0.12:29500")
    # nothing answers there (the job ended): the configured endpoint, as without a record
    assert found(folder, {}) is None
    # another store answers there (another job's, a restarted one): not ours
    assert found(folder, {("127.0.0.12", 29500): SignedStore(HashStore(), KEY)}) is None
    # a store whose lineage key was planted by someone without the secret: not ours
    planted = HashStore()
    planted.set("elastic-train/job/lineage", lineage)
    assert found(folder, {("127.0.0.12", 29500): SignedStore(planted, KEY)}) is None
    # something other than a store answers there: ignored with an event, not exit 2
    with capture_logs() as logs:
        not_a_store = EndpointError("127.0.0.12:29500 answers but is not a c10d store")
        assert found(folder, {("127.0.0.12", 29500): not_a_store}) is None
    assert [(e["event"], e["reason"]) for e in logs] == [("store.record_ignored", "not_a_store")]
    # the record names the configured endpoint: nothing moved
    assert found(folder, {("127.0.0.12", 29500): moved}, configured="127.0.0.12:29500") is None

"""Post-write verification and stray clean-up, on every backend (local, memory://, s3 on moto).

memory:// verifies a new snapshot by reading it all back, and so does local disk with
``keep=1``; otherwise local disk checks the manifest and a listing (its checksums are of the
buffers written; loads check them); s3 verifies from one listing (sizes + ETags) and
downloads only what the listing cannot prove.
"""

from __future__ import annotations

import io
import os
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from snapshots import SnapshotSaveError, SnapshotStore
from snapshots.format import layout
from snapshots.storage import S3FS_PART_SIZE, Storage, open_storage, s3_etag

from .conftest import Backend, make_bucket


class Faulty:
    """Wraps a Storage. ``damage`` set: data files are damaged on their way to storage (a byte
    flipped, or the last byte lost), the way a faulty disk or proxy would. Records reads."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url
        self.damage: str | None = None
        self.reads: list[str] = []
        if hasattr(inner, "write_streamed"):  # local disk: the same damage on that path
            self.write_streamed = self._write_streamed

    def __getattr__(self, name: str) -> Any:  # check/list/delete, object_store, etag_of
        return getattr(self.inner, name)

    def _write_streamed(self, path: str, fill: Any) -> Any:
        buf = io.BytesIO()
        result = fill(buf)
        self.write(path, buf.getvalue())
        return result

    def write(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        if self.damage and path.endswith(layout.DATA_SUFFIX):
            damaged = bytearray(data)
            if self.damage == "flip":
                damaged[len(damaged) // 2] ^= 0x01
            else:
                del damaged[-1]
            data = bytes(damaged)
        self.inner.write(path, data, exclusive=exclusive)

    def read(self, path: str) -> bytes:
        self.reads.append(path)
        return self.inner.read(path)


def _faulty_store(b: Backend, **kwargs: Any) -> tuple[SnapshotStore, Faulty]:
    faulty = Faulty(open_storage(b.url, storage_options=b.storage_options).inner)
    store = SnapshotStore(b.url, async_save=False, storage=faulty, **kwargs)
    return store, faulty


def _state(step: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 8, generator=gen), "meta": {"step": step}}


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_failed_verification_of_a_new_snapshot_prunes_nothing(
    backend: Backend, damage: str
) -> None:
    store, faulty = _faulty_store(backend, keep=1)
    store.save(1, _state(1))
    store.save(2, _state(2))
    assert store.committed_steps() == [2]  # keep=1 does prune once a newer save verified
    faulty.damage = damage
    with capture_logs() as logs, pytest.raises(SnapshotSaveError, match="verification"):
        store.save(3, _state(3))
    assert not [e for e in logs if e["event"] == "snapshot.pruned"]
    assert store.committed_steps() == [2, 3]  # 3 committed, but never verified
    latest = store.latest()  # falls back past the damaged 3
    assert latest is not None and latest.step == 2
    assert torch.equal(store.load(2).state["w"], _state(2)["w"])  # type: ignore[arg-type]
    faulty.damage = None
    store.save(4, _state(4))  # a verified save prunes again, the damaged one included
    assert store.committed_steps() == [4]


def test_local_damage_unseen_at_save_is_caught_at_load_and_an_older_one_serves(
    tmp_path: Any,
) -> None:
    # keep=2 on local disk: no read-back ("written"); the damage is the load's to find.
    faulty = Faulty(open_storage(str(tmp_path)).inner)
    store = SnapshotStore(str(tmp_path), async_save=False, keep=2, storage=faulty)
    store.save(1, _state(1))
    faulty.damage = "flip"
    with capture_logs() as logs:
        store.save(2, _state(2))
    assert [e["step"] for e in logs if e["event"] == "snapshot.saved"] == [2]
    assert not [p for p in faulty.reads if p.endswith(layout.DATA_SUFFIX)]  # not read back
    assert store.committed_steps() == [1, 2]  # retention kept the older one
    latest = store.latest()  # checks every checksum: falls back past the damaged 2
    assert latest is not None and latest.step == 1
    assert torch.equal(store.load(1).state["w"], _state(1)["w"])  # type: ignore[arg-type]


def test_strays_in_a_committed_folder_are_swept(backend: Backend) -> None:
    """A writer that lost the race for step 1's manifest and crashed left its data files."""
    store = SnapshotStore(
        backend.url, storage_options=backend.storage_options, async_save=False, keep=5
    )
    store.stray_grace_s = 0.0  # s3 objects cannot be back-dated; grace is tested on disk
    store.save(1, _state(1))
    st = open_storage(backend.url, storage_options=backend.storage_options)
    folder = layout.step_dir(1)
    before = {e.name for e in st.list(folder)}
    loser = [layout.entry_file_name(0, "w", "0badf00d"), layout.rank_file_name(0, "0badf00d")]
    for name in loser:
        st.write(f"{folder}/{name}", b"lost the race")
    st.write(f"{folder}/NOTES.txt", b"not written by snapshots: left alone")
    store.save(2, _state(2))
    assert {e.name for e in st.list(folder)} == before | {"NOTES.txt"}
    assert store.verify(1).ok and torch.equal(store.load(1).state["w"], _state(1)["w"])  # type: ignore[arg-type]


# ------------------------------------------------------------------ s3 only
@pytest.fixture
def s3(moto_endpoint: str) -> Backend:
    bucket = make_bucket(moto_endpoint)
    return Backend("s3", f"s3://{bucket}/run", {"client_kwargs": {"endpoint_url": moto_endpoint}})


def _data_reads(faulty: Faulty) -> list[str]:
    return [p for p in faulty.reads if p.endswith(layout.DATA_SUFFIX)]


@pytest.mark.s3
def test_s3_verifies_from_the_listing_without_downloading_data(s3: Backend) -> None:
    store, faulty = _faulty_store(s3)
    store.save(1, _state(1))
    assert faulty.reads == [layout.manifest_path(1)]  # the manifest, read back, and no data
    assert store.verify(1).ok


@pytest.mark.s3
def test_s3_full_verification_reads_everything_back_when_asked(s3: Backend) -> None:
    store, faulty = _faulty_store(s3, verify_after_write="full")
    store.save(1, _state(1))
    assert len(_data_reads(faulty)) == 2


@pytest.mark.s3
def test_s3_truncation_is_caught_by_the_listing_alone(s3: Backend) -> None:
    store, faulty = _faulty_store(s3)
    faulty.damage = "truncate"
    with pytest.raises(SnapshotSaveError, match="bytes, manifest says"):
        store.save(1, _state(1))
    assert _data_reads(faulty) == []


@pytest.mark.s3
def test_s3_etag_that_is_not_an_md5_falls_back_to_a_download(s3: Backend) -> None:
    """SSE-KMS buckets list ETags that are not MD5s: that is no proof of damage."""
    store, faulty = _faulty_store(s3)
    faulty.etag_of = lambda data: "0" * 32  # type: ignore[method-assign]
    info = store.save(1, _state(1)).result()
    assert info is not None and info.step == 1
    assert len(_data_reads(faulty)) == 2  # both data files downloaded and checksummed


@pytest.mark.s3
@pytest.mark.parametrize("size", [0, 1000, 11 * 2**20])
def test_s3_etag_matches_what_s3_lists(s3: Backend, size: int) -> None:
    """Single PUT and multipart (small parts here; s3fs's default is S3FS_PART_SIZE)."""
    part = 5 * 2**20  # S3's minimum part size
    assert part < S3FS_PART_SIZE
    storage = open_storage(s3.url, storage_options=s3.storage_options).inner
    data = os.urandom(size)
    storage.fs.pipe_file(f"{storage.root}/blob", data, chunksize=part)  # type: ignore[attr-defined]
    (entry,) = [e for e in storage.list("") if e.name == "blob"]
    assert entry.etag == s3_etag(data, part_size=part)
    assert ("-" in entry.etag) == (size >= 2 * part)

"""One contract, every backend: local disk, memory://, s3:// on moto (as fsspec tests)."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from snapshots import SnapshotExistsError, SnapshotStore
from snapshots.format import layout
from snapshots.storage import open_storage

from .conftest import Backend


def _store(b: Backend, **kwargs: object) -> SnapshotStore:
    kwargs.setdefault("async_save", False)
    return SnapshotStore(b.url, storage_options=b.storage_options, **kwargs)  # type: ignore[arg-type]


def _state(step: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(16, 4, generator=gen), "meta": {"step": step, "name": "x"}}


class TestStorageContract:
    def test_write_then_read_returns_the_same_bytes(self, backend: Backend) -> None:
        st = open_storage(backend.url, storage_options=backend.storage_options)
        st.write("step-000000000001/a.pt", b"hello" * 1000)
        assert st.read("step-000000000001/a.pt") == b"hello" * 1000

    def test_plain_write_replaces_but_exclusive_write_refuses(self, backend: Backend) -> None:
        st = open_storage(backend.url, storage_options=backend.storage_options)
        st.write("f/x", b"one")
        st.write("f/x", b"two")
        assert st.read("f/x") == b"two"
        with pytest.raises(FileExistsError):
            st.write("f/x", b"three", exclusive=True)
        assert st.read("f/x") == b"two"
        st.write("f/y", b"new", exclusive=True)
        assert st.read("f/y") == b"new"

    def test_list_reports_folders_files_and_sizes(self, backend: Backend) -> None:
        st = open_storage(backend.url, storage_options=backend.storage_options)
        st.write("step-000000000002/a.pt", b"12345")
        st.write("step-000000000002/b.pt", b"")
        top = {e.name: e for e in st.list("")}
        assert top["step-000000000002"].is_dir
        inside = {e.name: e.size for e in st.list("step-000000000002") if not e.is_dir}
        assert inside == {"a.pt": 5, "b.pt": 0}
        assert st.list("no-such-folder") == []

    def test_read_missing_raises_file_not_found(self, backend: Backend) -> None:
        st = open_storage(backend.url, storage_options=backend.storage_options)
        with pytest.raises(FileNotFoundError):
            st.read("step-000000000009/manifest.json")

    def test_delete_file_folder_and_missing(self, backend: Backend) -> None:
        st = open_storage(backend.url, storage_options=backend.storage_options)
        st.write("d/one", b"1")
        st.write("d/two", b"2")
        st.delete("d/one")
        assert [e.name for e in st.list("d")] == ["two"]
        st.delete("d")
        assert [e.name for e in st.list("") if e.name == "d"] == []
        st.delete("d")  # deleting what is gone is not an error

    def test_save_latest_load_and_retention(self, backend: Backend) -> None:
        store = _store(backend, keep=2)
        for step in (1, 2, 3, 4):
            store.save(step, _state(step), epoch=step // 2, metadata={"k": step})
        assert [i.step for i in store.list()] == [3, 4]
        latest = store.latest()
        assert latest is not None and (latest.step, latest.epoch, latest.metadata) == (
            4,
            2,
            {"k": 4},
        )
        loaded = store.load(3)
        assert torch.equal(loaded.state["w"], _state(3)["w"])
        assert loaded.state["meta"] == {"step": 3, "name": "x"}

    def test_committed_step_is_never_overwritten(self, backend: Backend) -> None:
        store = _store(backend)
        store.save(5, _state(5))
        with pytest.raises(SnapshotExistsError):
            store.save(5, _state(6))
        assert torch.equal(store.load(5).state["w"], _state(5)["w"])
        # the rejected save left no stray data files next to the committed ones
        st = open_storage(backend.url, storage_options=backend.storage_options)
        assert len(st.list(layout.step_dir(5))) == 3  # manifest + 2 entries

    def test_folder_without_manifest_is_ignored_then_cleaned(self, backend: Backend) -> None:
        store = _store(backend, keep=3)
        store.save(1, _state(1))
        st = open_storage(backend.url, storage_options=backend.storage_options)
        st.write(f"{layout.step_dir(2)}/000-w.deadbeef.pt", b"partial")
        assert store.latest().step == 1  # type: ignore[union-attr]
        store.save(3, _state(3))
        assert layout.step_dir(2) not in {e.name for e in st.list("")}

    def test_damaged_newest_falls_back_with_event(self, backend: Backend) -> None:
        store = _store(backend)
        store.save(1, _state(1))
        store.save(2, _state(2))
        st = open_storage(backend.url, storage_options=backend.storage_options)
        name = next(e.name for e in st.list(layout.step_dir(2)) if "-w." in e.name)
        data = bytearray(st.read(f"{layout.step_dir(2)}/{name}"))
        data[len(data) // 2] ^= 0x01
        st.write(f"{layout.step_dir(2)}/{name}", bytes(data))
        with capture_logs() as logs:
            loaded = store.load()
        assert loaded.info.step == 1
        assert [e["step"] for e in logs if e["event"] == "snapshot.corrupt"] == [2]

    def test_async_save_round_trip(self, backend: Backend) -> None:
        store = _store(backend, async_save=True)
        handle = store.save(7, _state(7))
        info = handle.result(timeout=60)
        assert info is not None and info.step == 7
        store.close()
        assert torch.equal(_store(backend).load().state["w"], _state(7)["w"])

    def test_group_access_is_taken_everywhere_and_used_on_local_disk(
        self, backend: Backend
    ) -> None:
        """A local folder's option (``snapshots.storage.modes``): an object store has no
        modes, and its backend (s3fs) refuses an option it does not know."""
        options = {**(backend.storage_options or {}), "group_access": True}
        store = SnapshotStore(backend.url, storage_options=options, async_save=False)
        store.save(1, _state(1))
        assert torch.equal(store.load().state["w"], _state(1)["w"])

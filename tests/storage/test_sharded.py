"""Sharded snapshots (format 2) on every backend: local disk, memory://, s3:// on moto.

``read_range`` is part of the storage contract (a rank reads only the chunks it needs);
a sharded save and load go through the same store on every backend; on s3, two gloo ranks
save FSDP2 state and three ranks load it resharded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from snapshots import SnapshotCorruptError, SnapshotStore
from snapshots.distributed import DistributedSnapshotter
from snapshots.format import layout
from snapshots.storage import open_storage, read_range
from tests.dist.test_snapshot_sharded import assert_state_equal, run_phase
from tests.unit.snapshots.sharded.test_sharded import _model_and_optimizer

from .conftest import Backend, make_bucket


def _store(b: Backend, **kwargs: object) -> SnapshotStore:
    return SnapshotStore(b.url, storage_options=b.storage_options, **kwargs)  # type: ignore[arg-type]


class TestReadRange:
    def test_reads_the_bytes_asked_for(self, backend: Backend) -> None:
        st = open_storage(backend.url, storage_options=backend.storage_options)
        data = bytes(range(256)) * 40
        st.write("r/f.bin", data)
        assert read_range(st, "r/f.bin", 0, 10) == data[:10]
        assert read_range(st, "r/f.bin", 1000, 3000) == data[1000:4000]
        assert read_range(st, "r/f.bin", len(data) - 7, 7) == data[-7:]

    def test_past_the_end_is_truncation_and_missing_is_not_found(self, backend: Backend) -> None:
        st = open_storage(backend.url, storage_options=backend.storage_options)
        st.write("r/short.bin", b"0123456789")
        with pytest.raises(SnapshotCorruptError, match="truncated"):
            read_range(st, "r/short.bin", 5, 10)
        with pytest.raises(FileNotFoundError):
            read_range(st, "r/missing.bin", 0, 1)


class TestShardedStore:
    def test_save_then_load_restores_every_tensor(self, backend: Backend) -> None:
        model, optimizer = _model_and_optimizer(0)
        snap = DistributedSnapshotter(_store(backend, keep=None), sharded=True)
        snap.save(3, {"model": model, "optimizer": optimizer, "n": 7}, blocking=True)
        snap.close()
        assert _store(backend, create=False).latest().format_version == 2  # type: ignore[union-attr]
        fresh_model, fresh_opt = _model_and_optimizer(1)
        loaded = DistributedSnapshotter(_store(backend, create=False)).load(
            into={"model": fresh_model, "optimizer": fresh_opt}
        )
        assert loaded is not None and loaded.state["n"] == 7
        torch.testing.assert_close(fresh_model.state_dict(), model.state_dict(), rtol=0, atol=0)
        torch.testing.assert_close(
            fresh_opt.state_dict()["state"], optimizer.state_dict()["state"], rtol=0, atol=0
        )

    def test_damaged_shard_file_is_named_by_verify_and_load_falls_back(
        self, backend: Backend
    ) -> None:
        model, optimizer = _model_and_optimizer(0)
        snap = DistributedSnapshotter(_store(backend, keep=None), sharded=True)
        for step in (1, 2):
            snap.save(step, {"model": model, "optimizer": optimizer}, blocking=True)
        snap.close()
        st = open_storage(backend.url, storage_options=backend.storage_options)
        folder = layout.step_dir(2)
        shard = next(e.name for e in st.list(folder) if e.name.startswith("shard-"))
        data = bytearray(st.read(f"{folder}/{shard}"))
        data[len(data) // 2] ^= 0xFF  # one flipped byte, as storage damages files
        st.write(f"{folder}/{shard}", bytes(data))
        store = _store(backend, create=False)
        verdict = store.verify(2)
        assert not verdict.ok and shard in " ".join(verdict.problems)
        loaded = DistributedSnapshotter(store).load(into={"model": _model_and_optimizer(1)[0]})
        assert loaded is not None and loaded.info.step == 1


@pytest.mark.s3
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_fsdp_on_s3_saved_by_2_ranks_loads_resharded_at_3(
    tmp_path: Path, moto_endpoint: str
) -> None:
    url = f"s3://{make_bucket(moto_endpoint)}/run"
    options = {"client_kwargs": {"endpoint_url": moto_endpoint}}
    saved = run_phase(tmp_path, "fsdp_save", 2, url=url, storage_options=options)
    assert [r["committed"] for r in saved] == [2, 2]
    st = open_storage(url, storage_options=options)
    names = [e.name for e in st.list(layout.step_dir(2))]
    assert sorted(n[:11] for n in names if n.startswith("shard-")) == ["shard-00000", "shard-00001"]
    loaded = run_phase(tmp_path, "fsdp_load", 3, url=url, storage_options=options)
    assert {r["step"] for r in loaded} == {2}
    assert_state_equal(
        torch.load(tmp_path / "loaded-w3.pt", weights_only=True),
        torch.load(tmp_path / "expected-2.pt", weights_only=True),
    )

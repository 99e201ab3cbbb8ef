"""Sharded snapshots (format 2) in one process: layout, table, tampering, verify, memory://."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch

from snapshots import NoValidSnapshotError, SnapshotCorruptError, SnapshotStore
from snapshots.cli import main
from snapshots.distributed import DistributedSnapshotter
from snapshots.format import layout, sharding
from snapshots.format.manifest import checksum, from_json, to_json
from tests.tamper import EXPLOITS, damage, resign


def _model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 5)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(url: str, step: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optimizer = _model_and_optimizer(0)
    snap = DistributedSnapshotter(SnapshotStore(url, keep=None), sharded=True)
    snap.save(step, {"model": model, "optimizer": optimizer, "extra": {"n": 3}}, blocking=True)
    snap.close()
    return model, optimizer


def _fresh_load(url: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    model, optimizer = _model_and_optimizer(1)
    loaded = DistributedSnapshotter(SnapshotStore(url, create=False)).load(
        into={"model": model, "optimizer": optimizer}
    )
    assert loaded is not None
    return model, optimizer, loaded.state


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_round_trip_writes_a_format_2_snapshot(tmp_path: Path, kind: str) -> None:
    url = str(tmp_path / "s") if kind == "local" else f"memory://sharded-{uuid.uuid4().hex}/s"
    model, optimizer = _save(url)
    store = SnapshotStore(url, create=False)
    info = store.latest()
    assert info is not None and info.format_version == 2
    loaded_model, loaded_opt, state = _fresh_load(url)
    torch.testing.assert_close(loaded_model.state_dict(), model.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(
        loaded_opt.state_dict()["state"], optimizer.state_dict()["state"], rtol=0, atol=0
    )
    assert state["extra"] == {"n": 3}


def _step_files(root: Path) -> list[str]:
    return sorted(p.name for p in (root / layout.step_dir(1)).iterdir())


def test_layout_is_skeletons_one_shard_file_per_rank_and_a_json_table(tmp_path: Path) -> None:
    _save(str(tmp_path))
    names = _step_files(tmp_path)
    assert next(n for n in names if n.startswith("shard-")).startswith("shard-00000.")
    table_name = next(n for n in names if n.startswith("shards."))
    table = sharding.from_json((tmp_path / layout.step_dir(1) / table_name).read_bytes())
    assert set(table.tensors) >= {sharding.fqn(["model", "0.weight"])}
    record = table.tensors[sharding.fqn(["model", "0.weight"])]
    assert (record.dtype, record.shape) == ("torch.float32", (3, 5))
    assert record.chunks[0].nbytes == 3 * 5 * 4


def test_table_round_trips_and_refuses_escaping_file_names() -> None:
    chunk = sharding.Chunk(
        file="shard-00000.0badc0de.bin", offsets=(0,), sizes=(2,), byte_offset=0, nbytes=8,
        checksum="0" * 64,
    )  # fmt: skip
    record = sharding.TensorRecord(dtype="torch.float32", shape=(2,), chunks=(chunk,))
    table = sharding.ShardTable(world_size=1, tensors={'["a"]': record})
    assert sharding.from_json(sharding.to_json(table)) == table
    body = json.loads(sharding.to_json(table))
    body["tensors"]['["a"]']["chunks"][0]["file"] = "../x"
    with pytest.raises(SnapshotCorruptError, match="escapes"):
        sharding.from_json(json.dumps(body).encode())


def test_manifest_with_shard_files_must_say_format_2(tmp_path: Path) -> None:
    _save(str(tmp_path))
    path = tmp_path / layout.manifest_path(1)
    manifest = from_json(path.read_bytes())
    body = json.loads(to_json(manifest))
    body["format_version"] = 1
    with pytest.raises(SnapshotCorruptError, match="format_version 1 does not match"):
        from_json(json.dumps(body).encode())


def test_skeleton_split_and_fill_round_trip() -> None:
    tree = {"a": torch.ones(2), "b": [1, {"c": torch.zeros(1)}], 3: "x"}
    skeleton, tensors = sharding.split(tree, ("k",))
    assert sharding.markers(skeleton) == list(tensors)
    filled = sharding.fill(skeleton, tensors)
    assert filled[3] == "x" and torch.equal(filled["b"][1]["c"], torch.zeros(1))


@pytest.mark.parametrize("exploit", sorted(EXPLOITS))
def test_a_crafted_pickle_in_a_shard_file_is_never_executed(tmp_path: Path, exploit: str) -> None:
    root = tmp_path / "s"
    _save(str(root))
    sentinel = tmp_path / "pwned"
    data = EXPLOITS[exploit](sentinel)
    target = resign(root, 1, lambda f: f.get("shard") is not None, data)
    _resign_table(root, target.name, data)  # every checksum now matches the crafted bytes
    with pytest.raises(NoValidSnapshotError):
        _fresh_load(str(root))
    assert not sentinel.exists()


def _resign_table(root: Path, shard_name: str, data: bytes) -> None:
    """Point every chunk of ``shard_name`` at the whole crafted file, checksum included."""
    folder = root / layout.step_dir(1)
    table_path = next(folder.glob("shards.*.json"))
    body = json.loads(table_path.read_bytes())
    for record in body["tensors"].values():
        for chunk in record["chunks"]:
            if chunk["file"] == shard_name:
                algorithm = body["checksum_algorithm"]
                chunk.update(byte_offset=0, nbytes=len(data), checksum=checksum(data, algorithm))
    resign(root, 1, lambda f: f.get("table", False), json.dumps(body).encode())


def test_a_pickle_as_the_shard_table_is_refused_unexecuted(tmp_path: Path) -> None:
    root = tmp_path / "s"
    _save(str(root))
    sentinel = tmp_path / "pwned"
    resign(root, 1, lambda f: f.get("table", False), EXPLOITS["raw pickle"](sentinel))
    with pytest.raises(SnapshotCorruptError):
        DistributedSnapshotter(SnapshotStore(str(root), create=False)).store.load(1)
    assert not sentinel.exists()


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_verify_names_a_damaged_shard_file(tmp_path: Path, how: str) -> None:
    _save(str(tmp_path))
    shard = next((tmp_path / layout.step_dir(1)).glob("shard-*.bin"))
    damage(shard, how)
    result = SnapshotStore(str(tmp_path), create=False).verify(1)
    assert not result.ok and shard.name in " ".join(result.problems)


def test_deep_verify_passes_a_good_sharded_snapshot(tmp_path: Path) -> None:
    _save(str(tmp_path))
    from snapshots.read.catalog import Catalog
    from snapshots.storage import open_storage

    catalog = Catalog(open_storage(str(tmp_path)), str(tmp_path))
    assert catalog.verify(1, deep=True).ok


@pytest.mark.parametrize("sharded", [True, False])
def test_export_writes_full_tensors_loadable_weights_only(tmp_path: Path, sharded: bool) -> None:

    model, _ = _model_and_optimizer(0)
    snap = DistributedSnapshotter(SnapshotStore(str(tmp_path / "s")), sharded=sharded)
    snap.save(3, {"model": model, "extra": {"n": 3}}, blocking=True)
    snap.close()
    out = tmp_path / "full.pt"
    assert main(["export", str(tmp_path / "s"), "-o", str(out)]) == 0
    exported = torch.load(out, weights_only=True)
    torch.testing.assert_close(dict(exported["model"]), model.state_dict(), rtol=0, atol=0)
    assert exported["extra"] == {"n": 3}


def test_export_of_a_missing_step_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:

    _save(str(tmp_path / "s"))
    assert main(["export", str(tmp_path / "s"), "--step", "9", "-o", str(tmp_path / "x")]) == 2
    assert "no committed snapshot of step 9" in capsys.readouterr().err


def test_show_summarises_a_sharded_snapshot_per_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, _ = _save(str(tmp_path))
    capsys.readouterr()  # only the command's own answer below
    assert main(["show", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out)["sharded"]
    shard = next((tmp_path / layout.step_dir(1)).glob("shard-*.bin"))
    tensors = len(model.state_dict()) + 2 * len(list(model.parameters()))  # + Adam's moments
    assert summary["world_size"] == 1 and summary["tensors"] >= tensors
    assert summary["chunk_checksum"] == "blake3"
    assert summary["ranks"] == [
        {
            "rank": 0,
            "file": shard.name,
            "bytes": shard.stat().st_size,
            "chunks": summary["chunks"],
            "tensors": summary["tensors"],
        }
    ]


def test_summary_counts_each_ranks_chunks_and_tensors() -> None:
    def chunk(file: str, at: int) -> sharding.Chunk:
        return sharding.Chunk(
            file=file, offsets=(at,), sizes=(2,), byte_offset=0, nbytes=8, checksum="0" * 64
        )

    split = sharding.TensorRecord(
        dtype="torch.float32", shape=(4,), chunks=(chunk("a.bin", 0), chunk("b.bin", 2))
    )
    whole = sharding.TensorRecord(dtype="torch.float32", shape=(2,), chunks=(chunk("b.bin", 0),))
    table = sharding.ShardTable(world_size=2, tensors={"x": split, "y": whole})
    summary = sharding.summary(table, {"b.bin": (1, 16), "a.bin": (0, 8)})
    assert (summary["tensors"], summary["chunks"], summary["bytes"]) == (2, 3, 24)
    assert [(r["rank"], r["file"], r["chunks"], r["tensors"]) for r in summary["ranks"]] == [
        (0, "a.bin", 1, 1),
        (1, "b.bin", 2, 2),
    ]


def test_show_of_a_format_1_snapshot_has_no_shard_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    SnapshotStore(str(tmp_path), async_save=False).save(1, {"w": torch.ones(2)})
    assert main(["show", str(tmp_path)]) == 0
    assert "sharded" not in json.loads(capsys.readouterr().out)

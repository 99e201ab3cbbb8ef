"""Sizes in a sharded snapshot's table are checked before anything is allocated or read: a
table whose manifest entry was re-signed over a damaged size is refused as damage, naming
the entry, and the load falls back to the older snapshot."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from snapshots import SnapshotSaveError, SnapshotStore
from snapshots.cli import main
from snapshots.distributed import DistributedSnapshotter
from snapshots.format import layout, sharding
from tests.tamper import resign

Body = dict[str, Any]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))


def _save_two(root: Path) -> torch.nn.Module:
    """Steps 1 and 2 of the same model; step 1 is what a load falls back to."""
    model = _model(0)
    snap = DistributedSnapshotter(SnapshotStore(str(root), keep=None), sharded=True)
    for step in (1, 2):
        snap.save(step, {"model": model}, blocking=True)
    snap.close()
    return model


def _first_chunk(body: Body) -> Body:
    weight = body["tensors"][sharding.fqn(["model", "0.weight"])]
    return weight["chunks"][0]


def _shard_size(root: Path, chunk: Body) -> int:
    return (root / layout.step_dir(2) / chunk["file"]).stat().st_size


def _huge(root: Path, body: Body) -> None:
    _first_chunk(body)["nbytes"] = 2**40


def _negative_offset(root: Path, body: Body) -> None:
    _first_chunk(body)["byte_offset"] = -8


def _past_the_end(root: Path, body: Body) -> None:
    chunk = _first_chunk(body)
    chunk["byte_offset"] = _shard_size(root, chunk) - chunk["nbytes"] + 4


def _not_its_box(root: Path, body: Body) -> None:
    _first_chunk(body)["nbytes"] -= 4  # still inside the file: only the box can tell


def _outside_the_shape(root: Path, body: Body) -> None:
    _first_chunk(body)["offsets"][0] = 2  # a 3-row weight: rows 2..4 do not exist


def _shape_beyond_the_chunks(root: Path, body: Body) -> None:
    # Every chunk still fits, but a load would allocate the full 2**40-row tensor.
    body["tensors"][sharding.fqn(["model", "0.weight"])]["shape"][0] = 2**40


CASES: dict[str, tuple[Callable[[Path, Body], None], str]] = {
    "nbytes 2**40": (_huge, r"\(1099511627776 bytes\) runs past the file's end"),
    "negative offset": (_negative_offset, "expected a non-negative integer, got -8"),
    "offset+nbytes past the end": (_past_the_end, r"runs past the file's end \(\d+ bytes\)"),
    "nbytes not its box": (_not_its_box, r"has nbytes \d+, its box of torch.float32 needs"),
    "box outside the shape": (_outside_the_shape, "lies outside the tensor's shape"),
    "shape beyond its chunks": (_shape_beyond_the_chunks, "needs more bytes than its chunks"),
}


def _damage_table(root: Path, change: Callable[[Path, Body], None]) -> None:
    table = next((root / layout.step_dir(2)).glob("shards.*.json"))
    body = json.loads(table.read_bytes())
    change(root, body)
    resign(root, 2, lambda f: f.get("table", False), json.dumps(body).encode())


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_size_in_the_table_is_refused_and_the_load_falls_back(
    tmp_path: Path, case: str
) -> None:
    saved = _save_two(tmp_path)
    change, reason = CASES[case]
    _damage_table(tmp_path, change)
    model = _model(1)
    with capture_logs() as logs:
        loaded = DistributedSnapshotter(SnapshotStore(str(tmp_path), create=False)).load(
            into={"model": model}
        )
    assert loaded is not None and loaded.info.step == 1
    corrupt = [e for e in logs if e["event"] == "snapshot.corrupt"]
    assert [e["step"] for e in corrupt] == [2]
    assert re.search(reason, corrupt[0]["problem"]), corrupt[0]["problem"]
    for ours, theirs in zip(saved.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("case", ["nbytes 2**40", "nbytes not its box", "shape beyond its chunks"])
def test_deep_verify_names_a_damaged_size(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _save_two(tmp_path)
    _damage_table(tmp_path, CASES[case][0])
    capsys.readouterr()
    assert main(["verify", str(tmp_path), "--step", "2", "--deep"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAILED  step 2: ") and "shard table, tensor" in out


def test_a_table_larger_than_any_table_is_refused_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save_two(tmp_path)
    table = next((tmp_path / layout.step_dir(2)).glob("shards.*.json"))
    size = table.stat().st_size
    padded = table.read_bytes() + b" " * 64  # still valid JSON, longer than step 1's table
    resign(tmp_path, 2, lambda f: f.get("table", False), padded)
    monkeypatch.setattr(sharding, "MAX_TABLE_BYTES", size)
    store = SnapshotStore(str(tmp_path), create=False)
    assert not store.verify(2).ok
    assert "more than a table may" in " ".join(store.verify(2).problems)
    with capture_logs() as logs:
        loaded = DistributedSnapshotter(store).load(into={"model": _model(1)})
    assert loaded is not None and loaded.info.step == 1
    corrupt = [e for e in logs if e["event"] == "snapshot.corrupt"]
    assert len(corrupt) == 1 and "more than a table may" in corrupt[0]["problem"]


def test_a_save_whose_table_would_be_too_large_fails_instead_of_committing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sharding, "MAX_TABLE_BYTES", 100)
    snap = DistributedSnapshotter(SnapshotStore(str(tmp_path), keep=None), sharded=True)
    with pytest.raises(SnapshotSaveError, match="more than a table may"):
        snap.save(1, {"model": _model(0)}, blocking=True)
    snap.close()
    assert SnapshotStore(str(tmp_path), create=False).latest() is None

"""The chunk checksums of a sharded snapshot: BLAKE3 in new tables (format 2), sha256 in
tables of format 1 (still loaded), and an unknown algorithm is damage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch

from snapshots import SnapshotCorruptError, SnapshotStore
from snapshots.cli import main
from snapshots.distributed import DistributedSnapshotter
from snapshots.format import layout, sharding
from snapshots.format.manifest import checksum
from tests.tamper import damage, resign


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))


def _save(root: Path) -> torch.nn.Module:
    model = _model(0)
    snap = DistributedSnapshotter(SnapshotStore(str(root), keep=None), sharded=True)
    snap.save(1, {"model": model}, blocking=True)
    snap.close()
    return model


def _load(root: Path) -> torch.nn.Module:
    model = _model(1)
    DistributedSnapshotter(SnapshotStore(str(root), create=False)).store.load(
        1, into={"model": model}
    )
    return model


def _table(root: Path) -> tuple[Path, dict[str, Any]]:
    path = next((root / layout.step_dir(1)).glob("shards.*.json"))
    return path, json.loads(path.read_bytes())


def _chunks(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for record in body["tensors"].values() for c in record["chunks"]]


def _resign_table(root: Path, body: dict[str, Any]) -> None:
    resign(root, 1, lambda f: f.get("table", False), json.dumps(body).encode())


def _flip_a_chunk_byte_and_resign_the_file(root: Path) -> None:
    """One byte of a shard file flipped, its whole-file checksum fixed: only the chunk's
    own checksum can tell."""
    shard = next((root / layout.step_dir(1)).glob("shard-*.bin"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    resign(root, 1, lambda f: f.get("name") == shard.name, bytes(data))


def test_new_tables_record_each_chunk_with_blake3(tmp_path: Path) -> None:
    _save(tmp_path)
    _, body = _table(tmp_path)
    assert (body["format"], body["checksum_algorithm"]) == (2, "blake3")
    folder = tmp_path / layout.step_dir(1)
    for chunk in _chunks(body):
        raw = (folder / chunk["file"]).read_bytes()
        part = raw[chunk["byte_offset"] : chunk["byte_offset"] + chunk["nbytes"]]
        assert chunk["checksum"] == blake3.blake3(part).hexdigest()


def test_a_flipped_byte_fails_the_chunks_blake3_on_load(tmp_path: Path) -> None:
    _save(tmp_path)
    _flip_a_chunk_byte_and_resign_the_file(tmp_path)
    with pytest.raises(SnapshotCorruptError, match="fails its blake3 checksum"):
        _load(tmp_path)


def test_deep_verify_names_the_damaged_blake3_chunk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(tmp_path)
    _flip_a_chunk_byte_and_resign_the_file(tmp_path)
    assert main(["verify", str(tmp_path)]) == 0  # every whole file matches the manifest
    capsys.readouterr()
    assert main(["verify", str(tmp_path), "--deep"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAILED  step 1: ") and "is damaged" in out


def _to_format_1(root: Path) -> None:
    """Rewrite the table in the layout of format 1: every chunk with its own ``sha256``."""
    _, body = _table(root)
    folder = root / layout.step_dir(1)
    for chunk in _chunks(body):
        raw = (folder / chunk["file"]).read_bytes()
        part = raw[chunk["byte_offset"] : chunk["byte_offset"] + chunk["nbytes"]]
        del chunk["checksum"]
        chunk["sha256"] = checksum(part, "sha256")
    del body["checksum_algorithm"]
    body["format"] = 1
    _resign_table(root, body)


def test_a_format_1_table_with_sha256_chunks_still_loads_and_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = _save(tmp_path)
    _to_format_1(tmp_path)
    loaded = _load(tmp_path)
    for ours, theirs in zip(saved.state_dict().values(), loaded.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs)
    assert main(["verify", str(tmp_path), "--deep"]) == 0
    capsys.readouterr()
    assert main(["show", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["sharded"]["chunk_checksum"] == "sha256"
    _flip_a_chunk_byte_and_resign_the_file(tmp_path)
    with pytest.raises(SnapshotCorruptError, match="fails its sha256 checksum"):
        _load(tmp_path)


@pytest.mark.parametrize("algorithm", ["md5", "crc32", "blake3x", 3])
def test_an_unknown_chunk_algorithm_is_damage(tmp_path: Path, algorithm: Any) -> None:
    _save(tmp_path)
    _, body = _table(tmp_path)
    body["checksum_algorithm"] = algorithm
    _resign_table(tmp_path, body)
    with pytest.raises(SnapshotCorruptError, match=r"checksum_algorithm .* is not one of"):
        _load(tmp_path)


def test_a_digest_of_the_wrong_length_for_its_algorithm_is_damage(tmp_path: Path) -> None:
    _save(tmp_path)
    _, body = _table(tmp_path)
    body["checksum_algorithm"] = "sha512"  # allowed, but the chunks hold 32-byte digests
    with pytest.raises(SnapshotCorruptError, match="not a sha512 hex digest"):
        sharding.from_json(json.dumps(body).encode())


def test_a_manifest_may_name_blake3_for_its_files(tmp_path: Path) -> None:
    """blake3 is on the manifest's allow-list, so a manifest naming it must be checkable."""
    store = SnapshotStore(str(tmp_path), async_save=False, keep=None)
    store.save(1, {"w": torch.arange(4.0)})
    path = tmp_path / layout.manifest_path(1)
    body = json.loads(path.read_bytes())
    body["checksum_algorithm"] = "blake3"
    for entry in body["files"]:
        raw = (tmp_path / layout.step_dir(1) / entry["name"]).read_bytes()
        entry["checksum"] = blake3.blake3(raw).hexdigest()
    path.write_text(json.dumps(body))
    fresh = SnapshotStore(str(tmp_path), create=False)
    assert fresh.verify(1).ok
    assert torch.equal(fresh.load(1).state["w"], torch.arange(4.0))
    entry = body["files"][0]
    damage(tmp_path / layout.step_dir(1) / entry["name"], "flip")
    assert not fresh.verify(1).ok

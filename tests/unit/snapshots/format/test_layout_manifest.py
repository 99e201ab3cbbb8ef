"""Pure naming and manifest rules."""

from __future__ import annotations

import dataclasses
import json

import pytest

from snapshots import SnapshotCorruptError
from snapshots.format import layout
from snapshots.format.manifest import (
    FORMAT_VERSION,
    SUPPORTED_VERSIONS,
    FileEntry,
    Manifest,
    from_json,
    to_json,
)


def _manifest(**changes: object) -> Manifest:
    base = Manifest(
        step=12,
        epoch=1,
        world_size=2,
        torch_version="2.14.1",
        created_at="2026-01-01T00:00:00.000+00:00",
        files=(
            FileEntry(name="000-model.abcd1234.pt", size=10, checksum="0" * 64, key="model"),
            FileEntry(name="rank-00001.abcd1234.pt", size=3, checksum="1" * 64, rank=1),
        ),
        metadata={"note": "x"},
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_step_dirs_are_zero_padded_and_parse_back() -> None:
    assert layout.step_dir(1200) == "step-000000001200"
    assert layout.parse_step_dir("step-000000001200") == 1200
    assert layout.parse_step_dir("some/prefix/step-000000001200/") == 1200
    assert sorted([layout.step_dir(s) for s in (10, 9, 100)]) == [
        layout.step_dir(9),
        layout.step_dir(10),
        layout.step_dir(100),
    ]


@pytest.mark.parametrize("name", ["step-12", "step-0000000012000", "step-00000000120x", ".tmp-x"])
def test_other_names_are_not_steps(name: str) -> None:
    assert layout.parse_step_dir(name) is None


@pytest.mark.parametrize("bad", [-1, 10**12, 1.0, True, "3"])
def test_bad_steps_are_rejected(bad: object) -> None:
    with pytest.raises(ValueError):
        layout.step_dir(bad)  # type: ignore[arg-type]


def test_entry_names_are_safe_whatever_the_key() -> None:
    name = layout.entry_file_name(3, "../../etc/passwd x", "abcd1234")
    assert layout.is_safe_file_name(name) and "/" not in name
    assert layout.is_safe_file_name(layout.rank_file_name(7, "abcd1234"))


def test_manifest_round_trips_through_json() -> None:
    m = _manifest()
    again = from_json(to_json(m), expected_step=12)
    assert again == m
    assert again.entry_files()["model"].size == 10
    assert again.rank_files()[1].name.startswith("rank-00001")
    assert again.total_bytes == 13 and again.format_version == FORMAT_VERSION


@pytest.mark.parametrize(
    "name", ["../model.pt", "/etc/passwd", "a/b.pt", ".hidden", "..", "x\x00y", "manifest.json"]
)
def test_file_names_escaping_the_folder_are_rejected(name: str) -> None:
    body = json.loads(to_json(_manifest()))
    body["files"][0]["name"] = name
    with pytest.raises(SnapshotCorruptError, match="escapes"):
        from_json(json.dumps(body).encode())


def test_future_version_is_rejected_with_the_fix() -> None:
    body = json.loads(to_json(_manifest()))
    body["format_version"] = max(SUPPORTED_VERSIONS) + 1
    with pytest.raises(SnapshotCorruptError, match="upgrade"):
        from_json(json.dumps(body).encode())


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"format_version": 1}',
        b'{"format_version": "1"}',
        b'{"format_version": true}',
    ],
)
def test_garbage_manifests_are_corrupt(data: bytes) -> None:
    with pytest.raises(SnapshotCorruptError):
        from_json(data)


def test_manifest_in_the_wrong_folder_is_corrupt() -> None:
    with pytest.raises(SnapshotCorruptError, match="folder of step 13"):
        from_json(to_json(_manifest()), expected_step=13)


def test_negative_sizes_and_duplicate_names_are_corrupt() -> None:
    body = json.loads(to_json(_manifest()))
    body["files"][0]["size"] = -1
    with pytest.raises(SnapshotCorruptError):
        from_json(json.dumps(body).encode())
    body = json.loads(to_json(_manifest()))
    body["files"][1]["name"] = body["files"][0]["name"]
    with pytest.raises(SnapshotCorruptError):
        from_json(json.dumps(body).encode())

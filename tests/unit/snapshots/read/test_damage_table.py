"""Every malformed manifest and every special file is damage: reported, skipped, never a
traceback and never a hang; latest(), load(), verify and the CLI all fall back to step 1."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from snapshots import SnapshotStore
from snapshots.cli import main
from snapshots.format import layout
from snapshots.format.manifest import MAX_MANIFEST_BYTES

Body = dict[str, Any]


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((16,), float(step)), "opt": {"lr": 0.1 * step}}


def _two_snapshots(root: Path) -> SnapshotStore:
    store = SnapshotStore(str(root), async_save=False, keep=None)
    store.save(1, _state(1))
    store.save(2, _state(2), per_rank=[{"r": 0}, {"r": 1}], world_size=2)
    return store


def _set(key: str, value: Any) -> Callable[[Body], None]:
    return lambda body: body.__setitem__(key, value)


def _drop(key: str) -> Callable[[Body], None]:
    return lambda body: body.pop(key)


def _file(index: int, key: str, value: Any) -> Callable[[Body], None]:
    return lambda body: body["files"][index].__setitem__(key, value)


def _file_drop(index: int, key: str) -> Callable[[Body], None]:
    return lambda body: body["files"][index].pop(key)


def _same(field: str, *, of: str) -> Callable[[Body], None]:
    """Give two files the same ``field`` (both entry files, or both rank files)."""

    def change(body: Body) -> None:
        chosen = [f for f in body["files"] if f.get(of) is not None]
        chosen[1][field] = chosen[0][field]

    return change


def _only_ranks(body: Body) -> None:
    body["files"] = [f for f in body["files"] if f.get("rank") is not None]


# Index 0 is the first entry file, 2 and 3 the rank files (as the writer orders them).
MUTATIONS: dict[str, Callable[[Body], None]] = {
    "algorithm shake_128": _set("checksum_algorithm", "shake_128"),
    "algorithm md5": _set("checksum_algorithm", "md5"),
    "algorithm sha1": _set("checksum_algorithm", "sha1"),
    "algorithm unknown": _set("checksum_algorithm", "rot13"),
    "algorithm a number": _set("checksum_algorithm", 256),
    "algorithm missing": _drop("checksum_algorithm"),
    "files empty": _set("files", []),
    "files only per-rank": _only_ranks,
    "files an object": _set("files", {"a": 1}),
    "files null": _set("files", None),
    "files of numbers": _set("files", [1, 2]),
    "files missing": _drop("files"),
    "size negative": _file(0, "size", -1),
    "size a bool": _file(0, "size", True),
    "size a string": _file(0, "size", "10"),
    "size a float": _file(0, "size", 10.0),
    "size huge": _file(0, "size", 10**400),
    "size missing": _file_drop(0, "size"),
    "checksum a number": _file(0, "checksum", 12),
    "checksum not hex": _file(0, "checksum", "z" * 64),
    "checksum too short": _file(0, "checksum", "ab"),
    "name missing": _file_drop(0, "name"),
    "name a number": _file(0, "name", 7),
    "name escaping": _file(0, "name", "../../etc/passwd"),
    "name is the manifest": _file(0, "name", layout.MANIFEST_NAME),
    "key a number": _file(0, "key", 3),
    "rank negative": _file(2, "rank", -1),
    "rank a bool": _file(2, "rank", True),
    "rank a string": _file(2, "rank", "0"),
    "rank and key": _file(2, "key", "extra"),
    "neither rank nor key": _file_drop(2, "rank"),
    "duplicate key": _same("key", of="key"),
    "duplicate rank": _same("rank", of="rank"),
    "duplicate name": _same("name", of="key"),
    "step a string": _set("step", "2"),
    "step a bool": _set("step", True),
    "step huge": _set("step", 10**40),
    "step negative": _set("step", -2),
    "step of another folder": _set("step", 3),
    "step missing": _drop("step"),
    "epoch negative": _set("epoch", -1),
    "epoch a float": _set("epoch", 1.5),
    "world_size a string": _set("world_size", "2"),
    "world_size null": _set("world_size", None),
    "torch_version a number": _set("torch_version", 2),
    "created_at null": _set("created_at", None),
    "metadata a list": _set("metadata", [1]),
    "format_version a bool": _set("format_version", True),
    "format_version a string": _set("format_version", "1"),
    "format_version missing": _drop("format_version"),
    "format_version future": _set("format_version", 99),
}

RAW: dict[str, bytes] = {
    "empty": b"",
    "not utf-8": b"\xff\xfe{}",
    "a list": b"[]",
    "null": b"null",
    "a string": b'"manifest"',
    "truncated": b'{"format_version": 1, "step": 2, "fil',
    "deep nesting": b'{"format_version": 1, "files": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "NaN step": b'{"format_version": 1, "step": NaN}',
    "oversized": b" " * (MAX_MANIFEST_BYTES + 1) + b"{}",
}


def _manifest(root: Path, step: int = 2) -> Path:
    return root / layout.manifest_path(step)


def _data_file(root: Path, step: int = 2) -> Path:
    return next((root / layout.step_dir(step)).glob("*-w.*.pt"))


def _edit(root: Path, change: Callable[[Body], None]) -> None:
    body = json.loads(_manifest(root).read_bytes())
    change(body)
    _manifest(root).write_text(json.dumps(body))


def _duplicate_json_key(root: Path) -> None:
    text = _manifest(root).read_text()
    _manifest(root).write_text(text.replace('"step": 2', '"step": 2, "step": 2', 1))


def _replace(path: Path, make: Callable[[Path], None]) -> None:
    path.unlink()
    make(path)


SPECIAL: dict[str, Callable[[Path], None]] = {
    "FIFO manifest": lambda root: _replace(_manifest(root), lambda p: os.mkfifo(p)),
    "FIFO data file": lambda root: _replace(_data_file(root), lambda p: os.mkfifo(p)),
    "manifest symlink to /dev/zero": lambda root: _replace(
        _manifest(root), lambda p: p.symlink_to("/dev/zero")
    ),
    "data symlink to /dev/zero": lambda root: _replace(
        _data_file(root), lambda p: p.symlink_to("/dev/zero")
    ),
    "data symlink to a valid copy": lambda root: _symlink_to_copy(_data_file(root)),
    "folder as manifest": lambda root: _replace(_manifest(root), lambda p: p.mkdir()),
    "folder as data file": lambda root: _replace(_data_file(root), lambda p: p.mkdir()),
    "duplicate JSON key": _duplicate_json_key,
}


def _symlink_to_copy(path: Path) -> None:
    """Same bytes, but behind a symlink: readers follow no links, whatever they point to."""
    copy = path.parent.parent / "elsewhere.pt"
    copy.write_bytes(path.read_bytes())
    _replace(path, lambda p: p.symlink_to(copy))


CASES: dict[str, Callable[[Path], None]] = {
    **{f"manifest {k}": (lambda root, c=c: _edit(root, c)) for k, c in MUTATIONS.items()},
    **{f"raw {k}": (lambda root, r=r: _manifest(root).write_bytes(r)) for k, r in RAW.items()},
    **SPECIAL,
}


@pytest.mark.timeout(60)  # hanging on a FIFO is one of the bugs: fail, do not wait forever
@pytest.mark.parametrize("case", list(CASES))
def test_damage_is_reported_and_skipped_everywhere(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "snaps"
    store = _two_snapshots(root)
    CASES[case](root)
    assert not store.verify(2).ok
    with capture_logs() as logs:
        latest = store.latest()
        loaded = store.load()
    assert latest is not None and latest.step == 1
    assert loaded.info.step == 1 and torch.equal(loaded.state["w"], _state(1)["w"])
    corrupt = [e for e in logs if e["event"] == "snapshot.corrupt"]
    assert [e["step"] for e in corrupt] == [2, 2] and all(e["problem"] for e in corrupt)
    capsys.readouterr()
    assert main(["verify", str(root)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "ok      step 1" and out[1].startswith("FAILED  step 2: ")
    assert main(["verify", str(root), "--step", "2"]) == 1
    capsys.readouterr()
    assert main(["list", str(root), "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[1]["verified"] is True and rows[2]["verified"] is False

"""`elastic-train snapshots ...`: output, exit codes, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from snapshots import SnapshotStore, layout
from snapshots.cli import main


@pytest.fixture
def url(tmp_path: Path) -> str:
    root = str(tmp_path / "snaps")
    store = SnapshotStore(root, async_save=False, keep=None)
    for step in (10, 20, 30):
        store.save(step, {"w": torch.full((8,), float(step))}, epoch=step // 10)
    return root


def test_list_json_parses(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["epoch"]) for r in rows] == [(10, 1), (20, 2), (30, 3)]
    assert all(r["bytes"] > 0 and r["url"].endswith(layout.step_dir(r["step"])) for r in rows)


def test_list_table(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", url]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[0] == "step" and [ln.split()[0] for ln in lines[1:]] == [
        "10",
        "20",
        "30",
    ]


def test_show_defaults_to_latest(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", url]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["step"] == 30 and body["verified"] is True
    assert main(["show", url, "--step", "10"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 10


def test_verify_names_the_bad_file_and_exits_1(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", url]) == 0
    bad = next((Path(url) / layout.step_dir(20)).glob("*-w.*.pt"))
    bad.write_bytes(bad.read_bytes()[:-1])
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert f"FAILED  step 20: file {bad.name}" in out and "ok      step 30" in out
    assert main(["verify", url, "--step", "30"]) == 0


def test_prune_keeps_the_newest(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prune", url, "--keep", "1"]) == 0
    assert "[10, 20]" in capsys.readouterr().out
    assert SnapshotStore(url).committed_steps() == [30]


@pytest.mark.parametrize(
    "argv_tail",
    [
        ["list"],  # missing folder: not created, exit 2
        ["verify"],
        ["list", "--storage-options", "{not json"],
    ],
)
def test_usage_and_storage_errors_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv_tail: list[str]
) -> None:
    missing = str(tmp_path / "nowhere")
    assert main([argv_tail[0], missing, *argv_tail[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("elastic-train snapshots: error:")
    assert not Path(missing).exists()


def test_empty_store_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", str(tmp_path)]) == 2
    assert "no snapshots" in capsys.readouterr().err


def test_bad_usage_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prune", "/x"]) == 2  # --keep is required
    assert main(["explode"]) == 2

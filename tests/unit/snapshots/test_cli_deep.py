"""``verify --deep`` and ``prune`` judge a snapshot by whether it loads, not only by its
checksums; a crafted pickle with matching checksums is reported, kept out of retention's
anchor, and never executed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from snapshots import SnapshotStore
from snapshots.cli import main
from tests.tamper import EXPLOITS, resign

pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol")


@pytest.fixture(params=list(EXPLOITS))
def tampered(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path]:
    """Steps 1-3; step 3's entry replaced by an exploit whose checksum matches."""
    root = tmp_path / "snaps"
    store = SnapshotStore(str(root), async_save=False, keep=None)
    for step in (1, 2, 3):
        store.save(step, {"w": torch.ones(4) * step})
    sentinel = tmp_path / "pwned"
    resign(root, 3, lambda f: f.get("key") == "w", EXPLOITS[request.param](sentinel))
    return str(root), sentinel


def test_deep_verify_reports_what_was_refused(
    tampered: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    url, sentinel = tampered
    assert main(["verify", url]) == 0  # the checksums match: only loading tells
    capsys.readouterr()
    assert main(["verify", url, "--deep"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["ok      step 1 (loads)", "ok      step 2 (loads)"]
    assert out[2].startswith("FAILED  step 3: ") and "weights_only" in out[2]
    assert "False" not in out[2] and "safe_globals" not in out[2]
    assert not sentinel.exists()


def test_prune_keeps_the_newest_snapshot_that_loads(
    tampered: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    url, sentinel = tampered
    assert main(["prune", url, "--keep", "1", "--dry-run"]) == 0
    assert "would delete 1 snapshot(s): [1]" in capsys.readouterr().out
    assert main(["prune", url, "--keep", "1"]) == 0
    assert "deleted 1 snapshot(s): [1]" in capsys.readouterr().out
    assert SnapshotStore(url).committed_steps() == [2, 3]
    assert not sentinel.exists()


def test_nothing_loads_prunes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "snaps"
    store = SnapshotStore(str(root), async_save=False, keep=None)
    for step in (1, 2):
        store.save(step, {"w": torch.ones(4) * step})
        resign(root, step, lambda f: f.get("key") == "w", b"garbage")
    capsys.readouterr()
    assert main(["prune", str(root), "--keep", "1"]) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith("elastic-train: error: ")
    assert store.committed_steps() == [1, 2]


def test_store_prune_also_anchors_on_the_newest_snapshot_that_loads(
    tampered: tuple[str, Path],
) -> None:
    """The library call, not only the CLI: step 3 passes its checksums but does not load, so
    step 2 (the newest that loads) must survive keep=1."""
    url, sentinel = tampered
    store = SnapshotStore(url, keep=None)
    assert store.prune(1) == [1]
    assert store.committed_steps() == [2, 3]
    assert not sentinel.exists()

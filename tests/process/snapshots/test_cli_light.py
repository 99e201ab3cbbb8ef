"""The read-only snapshot commands never import torch (it costs seconds per call)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from snapshots import SnapshotStore

# Runs the console script's own entry point, then reports whether torch got imported.
PROBE = """
import json, sys
from elastic_trainer.cli import main
rc = main(sys.argv[2:])
with open(sys.argv[1], "w") as fh:
    json.dump({"rc": rc, "torch": "torch" in sys.modules}, fh)
"""


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("light") / "snaps")
    store = SnapshotStore(root, async_save=False, keep=None)
    for step in (1, 2):
        store.save(step, {"w": torch.ones(4) * step})
    return root


COMMANDS = {
    "list": (["snapshots", "list", "{url}"], 0),
    "list --json": (["snapshots", "list", "{url}", "--json"], 0),
    "show": (["snapshots", "show", "{url}"], 0),
    "show --step": (["snapshots", "show", "{url}", "--step", "1"], 0),
    "verify": (["snapshots", "verify", "{url}"], 0),
    "verify missing step": (["snapshots", "verify", "{url}", "--step", "9"], 2),
    "prune, nothing to delete": (["snapshots", "prune", "{url}", "--keep", "5"], 0),
    "usage error": (["snapshots", "prune", "{url}"], 2),
    "help": (["snapshots", "--help"], 0),
    "sub-command help": (["snapshots", "verify", "--help"], 0),
    "missing folder": (["snapshots", "list", "{url}/nowhere"], 2),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(COMMANDS))
def test_read_only_commands_do_not_import_torch(tmp_path: Path, url: str, name: str) -> None:
    argv, code = COMMANDS[name]
    report = tmp_path / "report.json"
    subprocess.run(
        [sys.executable, "-c", PROBE, str(report), *(a.format(url=url) for a in argv)],
        check=True,
        capture_output=True,
        timeout=100,
    )
    assert json.loads(report.read_text()) == {"rc": code, "torch": False}


def test_deep_verify_does_load(tmp_path: Path, url: str) -> None:
    """The probe itself can see torch: --deep needs it, and says so."""
    report = tmp_path / "report.json"
    argv = ["snapshots", "verify", url, "--deep"]
    subprocess.run(
        [sys.executable, "-c", PROBE, str(report), *argv],
        check=True,
        capture_output=True,
        timeout=100,
    )
    assert json.loads(report.read_text()) == {"rc": 0, "torch": True}

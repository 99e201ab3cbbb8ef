"""The CI scripts beside the code: what `.ci/run` calls after the README's test command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ROOT


def test_newest_torch_installs_past_a_pip_constraint_cap(tmp_path: Path) -> None:
    """Regression: CI's pip caps torch with a constraint file (pip.conf `constraint = ...`), and
    the newest-torch step asked for torch==NEWEST under that cap: ResolutionImpossible, red CI
    after the whole suite had passed. The test caps torch below every release in a config file
    of its own, as such a machine does, and asks the script whether the newest would install."""
    cap = tmp_path / "cap.txt"
    cap.write_text("torch<1\n")
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nconstraint = {cap}\n")
    env = {**os.environ, "PIP_CONFIG_FILE": str(conf), "VIRTUAL_ENV": str(Path(sys.prefix))}
    env.pop("PIP_CONSTRAINT", None)  # .ci/run lifts the cap for the suite: the test sets one
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        ["bash", str(ROOT / ".ci" / "newest-torch.sh"), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = done.stdout + done.stderr
    if "nothing more to run" in done.stdout:
        pytest.skip("the installed torch is the newest pip offers: no newer one to install")
    assert done.returncode == 0, out[-3000:]
    assert "would install" in done.stdout, out[-3000:]

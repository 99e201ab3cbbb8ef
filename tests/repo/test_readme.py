"""The README's commands are the ones CI runs: a pasted command must work."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _command_after(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- {marker} -->\s*```bash\n(.+?)\n```", text, re.S)
    assert match, f"README.md has no {marker} block"
    return match.group(1).strip()


def test_ci_runs_the_readme_test_command() -> None:
    command = _command_after("test-command")
    ci_lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert command in ci_lines


def test_run_command_starts_the_default_job() -> None:
    command = _command_after("run-command")
    assert command.endswith("elastic-train --min-nodes 1 --max-nodes 4")
    assert "pip install" in command

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


README_MAX_LINES = 300
# a measurement belongs in docs/benchmarks.md with its command, not in the front door
DIARY = re.compile(r"\bMeasured 20\d\d-\d\d-\d\d|\bran ~?\d+(\.\d+)?× slower|that day\b")


def test_the_readme_is_a_front_door() -> None:
    """At most ``README_MAX_LINES`` lines and no measurement diary (dated runs, a day's speed):
    the details live on the pages it links."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert DIARY.findall(text) == []
    assert DIARY.search("Measured 2026-11-26 with the quick-start command")  # the rule can fail

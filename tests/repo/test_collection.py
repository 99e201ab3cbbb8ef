"""Every test file runs under the README's test command, except the multi-rank tier
``tests/dist``, which runs when named (``pytest tests/dist``; pyproject.toml's
``norecursedirs`` says why). pytest skips folders named like packaging output (dist, build)
by default: a folder of tests must never drop out of the suite by its name alone."""

from __future__ import annotations

import subprocess
import sys

from tests import ROOT

RUN_WHEN_NAMED = "tests/dist/"


def test_every_test_file_but_the_named_tier_is_collected() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stdout[-2000:] + listed.stderr[-2000:]
    collected = {line.split("::")[0] for line in listed.stdout.splitlines() if "::" in line}
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")}
    missing = sorted(files - collected)
    assert [f for f in missing if not f.startswith(RUN_WHEN_NAMED)] == []
    assert not any(f.startswith(RUN_WHEN_NAMED) for f in collected)  # pyproject.toml says so

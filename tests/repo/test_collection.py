"""Every test file under tests/ runs under the README's test command. pytest skips folders
named like packaging output (dist, build) unless told otherwise: tests/dist was never run by
it until ``norecursedirs`` in pyproject.toml said so."""

from __future__ import annotations

import subprocess
import sys

from tests import ROOT


def test_every_test_file_is_collected() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stdout[-2000:] + listed.stderr[-2000:]
    collected = {line.split("::")[0] for line in listed.stdout.splitlines() if "::" in line}
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    assert sorted(files - collected) == []

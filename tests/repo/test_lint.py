"""ruff is part of the test suite, so CI enforces the house style on every file."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("ruff") or pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True, check=False)


def test_ruff_check_is_clean() -> None:
    done = _ruff("check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_reads_every_python_file_of_the_repository() -> None:
    """Regression: ruff's default exclusions skip folders named ``dist``, so tests/dist was
    never checked (and held syntax the oldest Python we support does not parse)."""
    done = _ruff("check", "--no-cache", "--show-files", ".")
    checked = {str(Path(line).relative_to(ROOT)) for line in done.stdout.split()}
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    assert set(tracked) - checked == set()


def test_ruff_format_is_clean() -> None:
    done = _ruff("format", "--check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout + done.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))

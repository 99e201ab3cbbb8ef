"""Every command reports a usage error the same way: one line, one prefix, exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "argv",
    [
        ["--bogus"],
        ["--max-node", "4"],
        ["status", "--jso", "/no/such/run"],
        ["--max-restarts", "many", "x.py"],
        ["store", "--bogus"],
        ["store", "--port", "http"],
        ["report", "--bogus"],
        ["report", "/no/such/run"],
        ["snapshots", "list"],
        ["snapshots", "verify", "/no/such/folder"],
    ],
)
def test_usage_errors_are_one_prefixed_line_and_exit_2(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "elastic_trainer", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("elastic-train: error: ")
    assert not lines[0].startswith("elastic-train: error: elastic-train")

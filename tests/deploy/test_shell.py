"""Every shell script we ship passes shellcheck (all severities) and `bash -n`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

needs_shellcheck = pytest.mark.skipif(
    shutil.which("shellcheck") is None,
    reason="shellcheck is not installed (Debian: shellcheck; .ci/setup-system.sh)",
)


def shell_scripts() -> list[Path]:
    """deploy/** files with a sh/bash shebang or a shell extension, and the CI set-up."""
    found = [ROOT / ".ci" / "setup-system.sh"]
    for path in sorted((ROOT / "deploy").rglob("*")):
        if not path.is_file():
            continue
        head = path.read_bytes()[:64]
        if path.suffix in (".sh", ".sbatch", ".bash") or head.startswith(
            (b"#!/bin/sh", b"#!/bin/bash", b"#!/usr/bin/env bash")
        ):
            found.append(path)
    return found


def test_the_scripts_are_found() -> None:
    names = {p.name for p in shell_scripts()}
    assert {"elastic-train.sbatch", "setup-system.sh"} <= names


@needs_shellcheck
@pytest.mark.parametrize("script", shell_scripts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_shellcheck_is_clean(script: Path) -> None:
    result = subprocess.run(
        ["shellcheck", "--severity=style", "--external-sources", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", shell_scripts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_bash_parses_it(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@needs_shellcheck
def test_shellcheck_reports_a_broken_script(tmp_path: Path) -> None:
    script = tmp_path / "broken.sh"
    script.write_text("#!/usr/bin/env bash\nrm -rf $DIR/build\n")  # unquoted expansion
    result = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert result.returncode != 0 and "SC2086" in result.stdout

"""deploy/systemd/*.service: `systemd-analyze verify` plus the settings that matter to us.

verify needs the ExecStart binary to exist, so it runs on a temp copy of each unit whose
ExecStart points at this environment's elastic-train. verify exits 0 even for unknown keys
or bad values (it only prints a warning), so any output at all fails the test.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT_DIR = ROOT / "deploy" / "systemd"
INSTALLED_BINARY = "/opt/elastic-train/bin/elastic-train"
SUPERVISOR_GRACE_S = 25

needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (Debian: systemd; .ci/setup-system.sh)",
)


def local_binary() -> str:
    beside_python = Path(sys.executable).parent / "elastic-train"
    found = str(beside_python) if beside_python.exists() else shutil.which("elastic-train")
    if not found:
        pytest.skip("elastic-train is not installed in this environment (pip install -e .)")
    return found


def verify(units: dict[str, str], tmp_path: Path, instances: list[str]) -> str:
    """Write ``units`` (file name -> text) to tmp_path and verify ``instances``; the output."""
    for name, text in units.items():
        (tmp_path / name).write_text(text.replace(INSTALLED_BINARY, local_binary()))
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *[f"./{i}" for i in instances]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return f"exit {result.returncode}\n{result.stdout}{result.stderr}".strip()


def unit_texts() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(UNIT_DIR.glob("*.service"))}


@needs_systemd_analyze
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    units = unit_texts()
    assert set(units) == {"elastic-train@.service", "elastic-train-store.service"}
    output = verify(units, tmp_path, ["elastic-train@job1.service", "elastic-train-store.service"])
    assert output == "exit 0"


@needs_systemd_analyze
@pytest.mark.parametrize(
    ("old", "new", "reported"),
    [
        ("KillMode=mixed", "KillMode=bogus", "kill mode"),
        ("TimeoutStopSec=60", "TimeoutStopSecs=60", "Unknown key 'TimeoutStopSecs'"),
    ],
)
def test_verify_reports_a_broken_unit(tmp_path: Path, old: str, new: str, reported: str) -> None:
    text = unit_texts()["elastic-train@.service"]
    assert old in text
    output = verify(
        {"elastic-train@.service": text.replace(old, new)}, tmp_path, ["elastic-train@j.service"]
    )
    assert reported in output


def settings(text: str) -> dict[str, list[str]]:
    """KEY -> every value it is given (systemd keys may repeat)."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if re.match(r"^[A-Za-z]+=", line):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def test_supervisor_unit_stops_gracefully_and_restarts_only_what_can_recover() -> None:
    unit = settings(unit_texts()["elastic-train@.service"])
    assert unit["KillMode"] == ["mixed"]  # SIGTERM to the supervisor only
    assert int(unit["TimeoutStopSec"][0]) > SUPERVISOR_GRACE_S
    assert unit["Restart"] == ["on-failure"]
    assert "2" in unit["RestartPreventExitStatus"][0].split()  # config errors
    assert "143" in unit["SuccessExitStatus"][0].split()  # stopped after a final snapshot
    assert unit["EnvironmentFile"] == ["/etc/elastic-train/%i.env"]
    exec_start = unit["ExecStart"][0]
    assert "--log-format json" in exec_start and "$ELASTIC_TRAIN_FLAGS" in exec_start
    assert unit["StandardError"] == ["journal"]


def test_store_unit_binds_a_configured_address_never_all_interfaces() -> None:
    unit = settings(unit_texts()["elastic-train-store.service"])
    assert "store --host ${STORE_HOST}" in unit["ExecStart"][0]
    assert "STORE_HOST=127.0.0.1" in unit["Environment"][0]
    assert "2" in unit["RestartPreventExitStatus"][0].split()


def test_example_env_file_joins_a_standalone_store() -> None:
    env = (UNIT_DIR / "example.env").read_text()
    flags = re.search(r'^ELASTIC_TRAIN_FLAGS="([^"]+)"$', env, re.M)
    assert flags, "example.env must set ELASTIC_TRAIN_FLAGS"
    assert "--rdzv-conf is_host=false" in flags[1]
    assert "--rdzv-endpoint " in flags[1]

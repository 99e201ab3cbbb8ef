"""deploy/systemd/install.sh, run for real into a temporary root so nothing on this machine
changes: the system user the unit runs as, the venv, the units and the env files, then
``systemd-analyze verify --root`` on the units as installed (ExecStart resolved in the root).

The package is a wheel of this repository built offline and installed with ``--no-deps``.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "deploy" / "systemd" / "install.sh"
UNITS = ("elastic-train@.service", "elastic-train-store.service")

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="install.sh creates a system user: needs root"),
    pytest.mark.skipif(shutil.which("useradd") is None, reason="useradd is not installed"),
]


@dataclass(frozen=True, kw_only=True)
class Installed:
    root: Path
    wheel: Path
    first: subprocess.CompletedProcess[str]


def run_install(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(INSTALL), *args], capture_output=True, text=True, timeout=300
    )


def build_wheel(tmp: Path) -> Path:
    """This repository as a wheel, built offline with the running environment's setuptools."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src)
    for package in ("elastic_trainer", "snapshots"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    pytest.importorskip("setuptools")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp / "wheels"), str(src)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = (tmp / "wheels").glob("*.whl")
    return wheel


def empty_root(root: Path) -> Path:
    """The account files a real root has: useradd --root edits them in place."""
    etc = root / "etc"
    etc.mkdir(parents=True)
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (etc / "group").write_text("root:x:0:\n")
    (etc / "shadow").write_text("root:*:19000:0:99999:7:::\n")
    (etc / "gshadow").write_text("root:*::\n")
    return root


def offline(wheel: Path) -> list[str]:
    return ["--package", str(wheel), "--pip-arg=--no-deps", "--pip-arg", "--no-index"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    tmp = tmp_path_factory.mktemp("install")
    wheel = build_wheel(tmp)
    root = empty_root(tmp / "root")
    first = run_install("--root", str(root), *offline(wheel))
    assert first.returncode == 0, first.stderr
    return Installed(root=root, wheel=wheel, first=first)


def account(root: Path, file: str, name: str) -> list[str]:
    lines = (root / "etc" / file).read_text().splitlines()
    (line,) = [entry for entry in lines if entry.startswith(f"{name}:")]
    return line.split(":")


def unit_setting(text: str, key: str) -> str:
    (value,) = [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(f"{key}=")]
    return value


def test_creates_the_system_user_the_unit_runs_as(installed: Installed) -> None:
    unit = (installed.root / "etc/systemd/system/elastic-train@.service").read_text()
    user, group = unit_setting(unit, "User"), unit_setting(unit, "Group")
    entry = account(installed.root, "passwd", user)
    assert int(entry[2]) < 1000, "a system account"
    assert entry[6].endswith("nologin")
    assert account(installed.root, "group", group)[2] == entry[3]


def test_installs_the_venv_the_units_start(installed: Installed) -> None:
    binary = installed.root / "opt/elastic-train/bin/elastic-train"
    assert binary.stat().st_mode & stat.S_IXUSR
    assert "elastic_trainer.cli" in binary.read_text()
    for name in UNITS:
        text = (installed.root / "etc/systemd/system" / name).read_text()
        assert text == (ROOT / "deploy/systemd" / name).read_text()  # default prefix: as shipped


def test_installs_the_example_env_readable_by_root_and_the_group_only(installed: Installed) -> None:
    env = installed.root / "etc/elastic-train/example.env"
    assert env.read_text() == (ROOT / "deploy/systemd/example.env").read_text()
    assert stat.S_IMODE(env.stat().st_mode) == 0o640
    assert str(env.parent.stat().st_gid) == account(installed.root, "group", "elastic-train")[2]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is missing")
def test_installed_units_pass_systemd_analyze_verify(installed: Installed, tmp_path: Path) -> None:
    # verify --root needs systemd's own units (sysinit.target, ...) inside the root too.
    system_units = Path("/usr/lib/systemd/system")
    if not system_units.is_dir():
        pytest.skip("no /usr/lib/systemd/system to verify against")
    target = installed.root / "usr/lib/systemd/system"
    if not target.exists():
        shutil.copytree(system_units, target, symlinks=True)
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", f"--root={installed.root}",
         "elastic-train@job1.service", "elastic-train-store.service"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert f"exit {result.returncode}\n{result.stdout}{result.stderr}".strip() == "exit 0"


def test_running_it_again_keeps_the_user_and_the_admins_env_files(installed: Installed) -> None:
    env = installed.root / "etc/elastic-train/example.env"
    env.write_text("ELASTIC_TRAIN_FLAGS=edited\n")
    again = run_install("--root", str(installed.root), *offline(installed.wheel))
    assert again.returncode == 0, again.stderr
    assert "user elastic-train exists" in again.stderr
    assert env.read_text() == "ELASTIC_TRAIN_FLAGS=edited\n"
    passwd = (installed.root / "etc/passwd").read_text()
    assert passwd.count("\nelastic-train:") == 1


def test_another_prefix_is_where_the_units_look(installed: Installed, tmp_path: Path) -> None:
    root = empty_root(tmp_path / "root")
    done = run_install("--root", str(root), "--prefix", "/srv/et", *offline(installed.wheel))
    assert done.returncode == 0, done.stderr
    assert (root / "srv/et/bin/elastic-train").exists()
    for name in UNITS:
        exec_start = unit_setting((root / "etc/systemd/system" / name).read_text(), "ExecStart")
        assert exec_start.startswith("/srv/et/bin/elastic-train ")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--frobnicate"], "unknown argument '--frobnicate'"),
        (["--prefix"], "--prefix needs a value"),
        (["--prefix", "relative/dir"], "--prefix must be an absolute path"),
        (["--root=rel"], "--root must be an absolute path"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    done = run_install(*args)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert message in line and "usage: install.sh" in line

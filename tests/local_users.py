"""Test helpers: a second local user (``nobody``) and code run as that user, for checks that
another user of the machine can neither read nor plant anything of a job's."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys

import pytest


def other_user() -> pwd.struct_passwd:
    """A second local user: ``nobody``, created when missing (only root can do either);
    the test is skipped otherwise. ``tests/process/conftest.py`` serves it as ``other``."""
    if os.geteuid() != 0:
        pytest.skip("acting as a second local user needs root")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "nobody"], check=True)
        return pwd.getpwnam("nobody")


def as_user(user: pwd.struct_passwd, code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by ``user``, with an interpreter every user may run (a venv under /root
    is out of their reach)."""
    python = next((p for p in (sys.executable, "/usr/bin/python3") if _runs_as(user, p)), None)
    if python is None:
        pytest.skip(f"no Python interpreter that uid {user.pw_uid} may run")
    return subprocess.run(
        [python, "-I", "-c", code],
        cwd="/",
        user=user.pw_uid,
        group=user.pw_gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def refused_all(
    user: pwd.struct_passwd, *, listed: list[str], read: list[str]
) -> subprocess.CompletedProcess[str]:
    """As ``user``: list each folder of ``listed`` and read each file of ``read``; the run
    exits 0 only when every attempt is refused (PermissionError), else with "allowed"."""
    return as_user(
        user,
        "import os, sys\n"
        f"acts = [lambda d=d: os.listdir(d) for d in {listed!r}]\n"
        f"acts += [lambda f=f: open(f, 'rb').read() for f in {read!r}]\n"
        "for act in acts:\n"
        "    try:\n"
        "        act()\n"
        "    except PermissionError:\n"
        "        continue\n"
        "    sys.exit('allowed')\n",
    )


def _runs_as(user: pwd.struct_passwd, python: str) -> bool:
    try:
        subprocess.run(
            [python, "-I", "-c", "pass"], user=user.pw_uid, group=user.pw_gid, extra_groups=[],
            cwd="/", check=True, capture_output=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return False
    return True

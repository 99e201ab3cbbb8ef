"""Fixtures shared by the process tests."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.local_users import other_user


@pytest.fixture
def other() -> pwd.struct_passwd:
    """A second local user (``nobody``): the test is skipped where one cannot be had."""
    return other_user()


@pytest.fixture
def shared() -> Iterator[str]:
    """A shared place like /dev/shm: sticky, world-writable, on tmpfs where there is one."""
    base = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.chmod(base, 0o1777)
    yield base
    shutil.rmtree(base, ignore_errors=True)

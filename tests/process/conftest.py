"""Fixtures shared by the process tests."""

from __future__ import annotations

import pwd

import pytest

from tests.local_users import other_user


@pytest.fixture
def other() -> pwd.struct_passwd:
    """A second local user (``nobody``): the test is skipped where one cannot be had."""
    return other_user()

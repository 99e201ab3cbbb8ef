"""Fixtures shared by the e2e tests."""

from __future__ import annotations

import pytest

from tests.e2e.workers.harness import cleanup


@pytest.fixture
def agents():
    """Agents a test started; their whole process trees are killed afterwards."""
    started: list = []
    yield started
    cleanup(started)

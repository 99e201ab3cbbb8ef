"""Tests that judge one process's speed against another's run alone (``@pytest.mark.alone``).

The straggler tests name the slow rank of a three-node job on two cores. Beside another test's
job (two more agents and three more workers) a rank of theirs really is slower for seconds at
a time, which those tests cannot tell from what they inject: under ``pytest -n 2`` a healthy
job had a rank named 1.5x slow, and a duty-cycled SIGSTOP was named 30 steps late. So an
``alone`` test waits for the test beside it to end and holds the machine while it runs; the
others share it. Two ``flock`` locks in a private folder the xdist controller makes: every test
passes the gate, so an ``alone`` test waiting at the share lock is not overtaken by the next
test beside it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator

WORKER_INPUT_KEY = "machine_share_dir"


def make_folder() -> str:
    """The locks' folder: private to this user (``mkdtemp``: mode 0700, a fresh name)."""
    return tempfile.mkdtemp(prefix="elastic-train-tests-")


def remove_folder(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _open_lock(folder: str, name: str) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(os.path.join(folder, name), flags, 0o600)


@contextlib.contextmanager
def turn(folder: str | None, *, alone: bool) -> Iterator[None]:
    """Hold the machine while a test runs: alone, or shared with other tests that are not
    ``alone``. Without a folder (no xdist: one test at a time anyway), nothing to hold."""
    if folder is None:
        yield
        return
    gate, share = _open_lock(folder, "gate"), _open_lock(folder, "share")
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(share, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield
    finally:  # closing the descriptors releases both locks
        os.close(share)
        os.close(gate)

"""An ``alone`` test holds the machine: no test runs beside it, and one waiting for it is not
overtaken (tests/machine_share.py). Threads stand for xdist's workers: ``flock`` locks belong
to each open descriptor, so two threads' turns exclude each other as two processes' do."""

from __future__ import annotations

import fcntl
import os
import stat
import threading
from collections.abc import Iterator

import pytest

from tests import machine_share
from tests.e2e.workers.harness import wait_for


@pytest.fixture
def folder() -> Iterator[str]:
    made = machine_share.make_folder()
    yield made
    machine_share.remove_folder(made)


class Turn(threading.Thread):
    """One test's turn in a thread: ``inside`` once it holds the machine, out on ``done``."""

    def __init__(self, folder: str, *, alone: bool) -> None:
        super().__init__(daemon=True)
        self.folder, self.alone = folder, alone
        self.inside, self.done = threading.Event(), threading.Event()

    def run(self) -> None:
        with machine_share.turn(self.folder, alone=self.alone):
            self.inside.set()
            self.done.wait(30)

    def leave(self) -> None:
        self.done.set()
        self.join(10)


def free(folder: str, name: str, how: int) -> bool:
    """Whether a lock could be taken now (``how``), without waiting."""
    fd = os.open(os.path.join(folder, name), os.O_RDWR)
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_the_folder_is_private() -> None:
    made = machine_share.make_folder()
    try:
        info = os.lstat(made)
        assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
        assert stat.S_IMODE(info.st_mode) == 0o700
    finally:
        machine_share.remove_folder(made)


def test_shared_turns_run_side_by_side(folder: str) -> None:
    first, second = Turn(folder, alone=False), Turn(folder, alone=False)
    first.start()
    assert first.inside.wait(10)
    second.start()
    try:
        assert second.inside.wait(10)  # while the first is still inside
        assert not free(folder, "share", fcntl.LOCK_EX)
    finally:
        for turn in (first, second):
            turn.leave()


def test_an_alone_turn_waits_for_the_test_beside_it_and_is_not_overtaken(folder: str) -> None:
    shared = Turn(folder, alone=False)
    shared.start()
    assert shared.inside.wait(10)
    alone = Turn(folder, alone=True)
    alone.start()
    # waiting at the share lock, holding the gate: the next test beside it waits behind it
    wait_for(lambda: not free(folder, "gate", fcntl.LOCK_EX), 10, "the alone turn at the gate")
    assert not alone.inside.is_set()
    later = Turn(folder, alone=False)
    later.start()
    try:
        shared.leave()
        assert alone.inside.wait(10)
        assert not later.inside.is_set() and not free(folder, "share", fcntl.LOCK_SH)
        alone.leave()
        assert later.inside.wait(10)
    finally:
        for turn in (shared, alone, later):
            turn.leave()

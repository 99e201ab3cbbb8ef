"""worker.handoff: a worker started alongside the old ones waits for the supervisor."""

from __future__ import annotations

import os
import threading

import pytest

from elastic_trainer.contract import protocol
from elastic_trainer.worker.handoff import (
    HandoffTimeout,
    await_handoff,
    say_aware,
    say_handed_off,
)


def test_no_mark_no_wait(tmp_path):
    assert await_handoff(str(tmp_path), 0) is False
    assert await_handoff(None, 0) is False
    assert not (tmp_path / protocol.handoff_ready_file(0)).exists()


def test_says_ready_and_waits_until_the_mark_is_gone(tmp_path):
    mark = tmp_path / protocol.HANDOFF_FILE
    mark.touch()
    ready = tmp_path / protocol.handoff_ready_file(3)
    seen_waiting = threading.Event()

    def supervisor() -> None:
        # the worker's ready file is the only thing that can end this wait
        while not ready.exists():
            pass
        seen_waiting.set()
        os.unlink(mark)

    thread = threading.Thread(target=supervisor)
    thread.start()
    assert await_handoff(str(tmp_path), 3, within_s=30) is True
    thread.join()
    assert seen_waiting.is_set() and not mark.exists()


def test_a_wait_nobody_ends_is_an_error(tmp_path):
    (tmp_path / protocol.HANDOFF_FILE).touch()
    with pytest.raises(HandoffTimeout, match="did not hand the group over"):
        await_handoff(str(tmp_path), 0, within_s=0.05)


def test_a_session_says_its_successor_waits(tmp_path):
    say_aware(str(tmp_path), 1)
    assert (tmp_path / protocol.handoff_aware_file(1)).exists()
    say_aware(str(tmp_path / "gone"), 1)  # a folder removed meanwhile: no error
    say_aware(None, 1)


def test_a_stopped_worker_says_it_has_let_go(tmp_path):
    say_handed_off(str(tmp_path), 2)
    assert (tmp_path / protocol.handed_off_file(2)).exists()
    say_handed_off(None, 2)

"""The supervisor loop's wait (``StopRequest.wait_for_change``): it ends when a watched fd turns
readable -- a worker exited, a peer's connection closed -- or a stop is requested, not at the
end of its interval. Bounds here are did-not-hang bounds, far above any expected time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from elastic_trainer.supervisor.processes.procs import ProcessTracker
from elastic_trainer.supervisor.processes.signals import StopRequest

pytestmark = pytest.mark.timeout(60)
INTERVAL_S = 600.0  # the wait's own bound: never reached when something wakes it


def test_a_worker_that_exits_ends_the_wait_and_its_fd_is_closed() -> None:
    worker = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    tracker = ProcessTracker()
    tracker.track({0: worker})
    fds = tracker.exit_fds()
    assert len(fds) == 1
    worker.stdin.close()  # type: ignore[union-attr]  # it exits
    began = time.monotonic()
    assert StopRequest().wait_for_change(INTERVAL_S, fds) is False  # woken, not stopped
    assert time.monotonic() - began < 30
    assert worker.wait(10) == 0
    assert tracker.exit_fds() == []  # an exited worker no longer wakes the loop
    with pytest.raises(OSError):
        os.fstat(fds[0])


def test_a_stop_ends_a_wait_on_fds_that_never_turn_readable() -> None:
    read, write = os.pipe()
    stop = StopRequest()
    try:
        threading.Thread(target=stop.request, args=(signal.SIGTERM,)).start()
        assert stop.wait_for_change(INTERVAL_S, [read]) is True
    finally:
        os.close(read)
        os.close(write)


def test_without_fds_it_is_the_plain_wait() -> None:
    stop = StopRequest()
    stop.request(signal.SIGTERM)
    assert stop.wait_for_change(INTERVAL_S) is True
    assert StopRequest().wait_for_change(0.0, []) is False


def test_an_idle_wait_is_one_poll_not_one_every_50_ms(monkeypatch) -> None:
    """Nothing happens for the whole interval: one wake-up at its end. It used to poll every
    50 ms to look for a stop, most of an idle agent's wake-ups."""
    import select

    polls: list[float] = []
    real = select.poll

    class Counting:
        def __init__(self) -> None:
            self._poll = real()

        def register(self, fd: int, mask: int) -> None:
            self._poll.register(fd, mask)

        def poll(self, timeout_ms: float) -> list:
            polls.append(timeout_ms)
            return self._poll.poll(timeout_ms)

    monkeypatch.setattr(select, "poll", Counting)
    read, write = os.pipe()
    try:
        assert StopRequest().wait_for_change(0.3, [read]) is False
    finally:
        os.close(read)
        os.close(write)
    assert polls == [300.0]


def test_a_stop_signal_ends_a_wait_on_fds_at_once() -> None:
    """The handler runs while the loop is in poll, which Python then retries: the pipe the
    request writes to is what ends it."""
    read, write = os.pipe()
    stop = StopRequest()
    previous = signal.signal(signal.SIGUSR1, stop.handler)
    try:
        threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGUSR1)).start()
        began = time.monotonic()
        assert stop.wait_for_change(INTERVAL_S, [read]) is True
        assert time.monotonic() - began < 30
        assert stop.signal_name == "SIGUSR1"
    finally:
        signal.signal(signal.SIGUSR1, previous)
        os.close(read)
        os.close(write)

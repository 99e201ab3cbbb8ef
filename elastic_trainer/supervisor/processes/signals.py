"""SIGTERM / SIGUSR1 / SIGINT -> a coordinated stop request.

The handler does the least it can: it records the signal, creates the stop file in the
current attempt's control directory (so workers see it after their current step, even
while the supervisor is busy) and wakes the supervisor's loop. While the supervisor waits
in a rendezvous (no workers to stop) it raises ``StopRequested`` to leave at once.

torch's process context installs its own SIGTERM handler (raise, then kill workers after
30 s); ``run.py`` sets ``TORCHELASTIC_SIGNALS_TO_HANDLE`` so that it leaves ours alone.

The handlers go in at the very start of ``run.main`` (``install_early``), before the heavy
imports and the checks: a SIGTERM in the first second must end the process with 143, not
kill it with -15. Until the supervisor takes over, the request is interruptible: whatever
``main`` is doing (parsing, probing the store) is abandoned at once.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType

from elastic_trainer.contract import protocol

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# Signals torch's PContext may still handle itself (abort: raise + kill the workers).
TORCH_SIGNALS = "SIGHUP,SIGQUIT"


class StopRequested(BaseException):
    """Raised out of a blocking rendezvous when a stop signal arrives.

    A BaseException so that torch's ``except Exception`` blocks do not swallow it.
    """


def create_stop_file(control_dir: str) -> None:
    """Tell the attempt's workers that this node stops (``protocol.STOP_FILE``): a
    ``TrainingSession`` stops the whole group at the step's end."""
    path = os.path.join(control_dir, protocol.STOP_FILE)
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))


class StopRequest:
    """Shared between the signal handler and the agent's loop."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal_name: str | None = None
        self.received_at: float | None = None  # time.monotonic()
        self.count = 0
        self.control_dir: str | None = None
        self.interruptible = False  # True while blocked where nothing needs a graceful stop
        # a pipe that request() writes to, so a stop ends wait_for_change's poll at once
        # (a signal does not: poll is retried after the handler); made by its first call
        self._wake_read, self._wake_write = -1, -1

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    def request(self, signum: int) -> None:
        self.count += 1
        if self.received_at is None:
            self.signal_name = signal.Signals(signum).name
            self.received_at = time.monotonic()
        self.write_stop_file()
        self.event.set()
        if self._wake_write >= 0:
            with contextlib.suppress(OSError):  # full: it is readable already
                os.write(self._wake_write, b"\0")

    def write_stop_file(self) -> None:
        if self.control_dir is None or self.received_at is None:
            return
        create_stop_file(self.control_dir)

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True as soon as a stop is requested."""
        return self.event.wait(seconds)

    def wait_for_change(self, seconds: float, fds: Sequence[int] = ()) -> bool:
        """``wait``, ended early too once one of ``fds`` is readable: a worker's pidfd (it
        exited) or a peer's presence connection (it closed), so that the loop sees a failure
        when it happens instead of up to a monitor interval later; and by a stop, through
        the pipe ``request`` writes to. One poll: it used to wake every 50 ms to look for a
        stop, most of an idle agent's wake-ups."""
        if not fds:
            return self.wait(seconds)
        if self._wake_read < 0:
            self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        poller = select.poll()
        for fd in (self._wake_read, *fds):
            poller.register(fd, select.POLLIN)
        if not self.requested:  # after the pipe exists: a stop from now on is in it
            poller.poll(max(0.0, seconds) * 1000)
        return self.requested

    def __del__(self) -> None:
        for fd in (self._wake_read, self._wake_write):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def handler(self, signum: int, frame: FrameType | None) -> None:
        self.request(signum)
        if self.interruptible:
            raise StopRequested(signal.Signals(signum).name)


def install(stop: StopRequest) -> dict[int, object]:
    """Install the stop handler; returns the previous handlers (for tests to restore)."""
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = TORCH_SIGNALS
    previous = {}
    for sig in STOP_SIGNALS:
        previous[int(sig)] = signal.signal(sig, stop.handler)
    return previous


_process_stop: StopRequest | None = None


def install_early() -> tuple[StopRequest, dict[int, object]]:
    """The process's stop request, interruptible, with its handlers installed.

    Returns it and the previous handlers (``main`` restores them when it returns early, so
    that an in-process caller such as a test keeps its own).
    """
    global _process_stop
    stop = StopRequest()
    stop.interruptible = True
    previous = install(stop)
    _process_stop = stop
    return stop, previous


def process_stop() -> StopRequest:
    """The stop request installed by ``install_early`` (a fresh one if there was none)."""
    return _process_stop if _process_stop is not None else StopRequest()


def restore(previous: dict[int, object]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)  # type: ignore[arg-type]

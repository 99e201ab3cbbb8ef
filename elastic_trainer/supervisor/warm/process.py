"""A process the warm pool forked, as the supervisor holds it: a ``Popen``-like handle on a
child of ours (the pool's forks are re-parented to the supervisor, its child subreaper:
``entrypoints/warm_pool.py``), so ``waitpid`` reaps it as ``Popen`` would. Nothing here
imports torch."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import time
from collections.abc import Sequence

# The exit status of a worker someone else reaped: unknown, so never a false success.
STATUS_LOST = 255


class WarmProcess:
    """What torch and ``ProcessTracker`` use of ``subprocess.Popen``, for a worker the pool
    forked. It is our child (re-parented to us), so ``waitpid`` reaps it as Popen would."""

    def __init__(self, pid: int, args: Sequence[str] = ()) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped behind our back: its status is lost
                self.returncode = STATUS_LOST
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            _until_exit(self.pid, 0.5 if left is None else min(left, 0.5))
        return self.returncode  # type: ignore[return-value]  # set by poll

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _until_exit(pid: int, timeout: float) -> None:
    """Block until ``pid`` exits or ``timeout`` passes (a pidfd where the kernel has one)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        time.sleep(min(timeout, 0.02))
        return
    try:  # poll, not select: a flood of connections can push our fds past select's 1,024
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.poll(timeout * 1000)
    finally:
        os.close(fd)

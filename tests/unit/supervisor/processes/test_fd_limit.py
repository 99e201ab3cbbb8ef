"""The open-file limit (``processes/fd_limit.py``): what soft limit to ask for, and running
out said once per streak."""

from __future__ import annotations

import errno
import resource

import pytest
from structlog.testing import capture_logs

from elastic_trainer.supervisor.processes import fd_limit

INF = resource.RLIM_INFINITY


@pytest.mark.parametrize(
    ("soft", "hard", "wanted"),
    [
        (1024, 4096, 4096),  # raised to the hard limit
        (1024, 1024, 1024),  # nothing to raise
        (1024, INF, fd_limit.MAX_SOFT),  # unlimited: a number the kernel takes
        (1024, 10**8, fd_limit.MAX_SOFT),
        (2 * fd_limit.MAX_SOFT, INF, 2 * fd_limit.MAX_SOFT),  # never lowered
        (INF, INF, INF),
    ],
)
def test_the_soft_limit_asked_for(soft, hard, wanted) -> None:
    assert fd_limit.wanted_soft(soft, hard) == wanted


def test_running_out_is_told_apart_from_other_errors() -> None:
    assert fd_limit.is_exhausted(OSError(errno.EMFILE, "Too many open files"))
    assert fd_limit.is_exhausted(OSError(errno.ENFILE, "Too many open files in system"))
    assert not fd_limit.is_exhausted(OSError(errno.ECONNABORTED, "aborted"))
    assert not fd_limit.is_exhausted(ValueError("EMFILE"))


def test_a_streak_of_failures_is_said_once_and_a_later_one_again() -> None:
    now = [0.0]
    streak = fd_limit.ExhaustionStreak("presence", "turned away", clock=lambda: now[0])
    with capture_logs() as logs:
        for _ in range(1000):  # a flood: failures all the time, for minutes
            streak.failed()
            now[0] += 0.1
        now[0] += fd_limit.QUIET_S + 1
        streak.failed()
    said = [e for e in logs if e["event"] == "resources.fd_exhausted"]
    assert len(said) == 2 and streak.failures == 1001 and streak.streaks == 2
    assert said[0]["where"] == "presence" and said[0]["log_level"] == "error"
    assert said[0]["limit"] == resource.getrlimit(resource.RLIMIT_NOFILE)[0]

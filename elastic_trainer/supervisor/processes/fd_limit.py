"""The supervisor's open-file limit: raised at start, and running out said once, not died of.

The rendezvous store is torch's C++ ``TCPStore``, hosted inside the supervisor's process: it
accepts every connection anyone who reaches its port opens, and holds it (we cannot bound
it). At the common soft limit of 1,024 open files, 1,000 idle connections from another
local user left the supervisor none for its own work (reading ``/proc`` for its workers, a
socket, a pidfd): it died of ``EMFILE`` with a traceback, and the job's store with it. The
hard limit is the kernel's bound on what we may ask for, usually far higher; raising the
soft one to it is what every server does at start (the workers inherit it, as under
``systemd``'s ``LimitNOFILE``).

Our own listeners bound themselves (presence: ``rendezvous/presence.py``; metrics) and say
once per streak when an ``accept`` finds no file left (``resources.fd_exhausted``).
"""

from __future__ import annotations

import errno
import resource
import time
from collections.abc import Callable

from elastic_trainer.contract.events import emit

# An unlimited hard limit is not a number to ask for: the kernel refuses a soft limit above
# fs.nr_open (1,048,576 by default), and some code sizes tables by the soft limit.
MAX_SOFT = 1_048_576
QUIET_S = 60.0  # a streak of failures ends after this long without one
EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE})  # this process's limit, or the system's


def wanted_soft(soft: int, hard: int, cap: int = MAX_SOFT) -> int:
    """The soft limit to ask for: the hard one, at most ``cap``; never lower than ``soft``."""
    ceiling = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
    if soft == resource.RLIM_INFINITY:
        return soft
    return max(soft, ceiling)


def raise_soft_limit() -> tuple[int, int]:
    """Raise this process's soft open-file limit to its hard one (``wanted_soft``); returns
    (before, after). Never fails: a limit we may not raise is kept (the job runs as before)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = wanted_soft(soft, hard)
    if wanted == soft:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (OSError, ValueError):  # above fs.nr_open, or a sandbox that forbids it
        return soft, soft
    return soft, wanted


# Besides its peers' connections an agent holds files of its own: its workers' pipes, pidfds
# and log files, /proc reads, the metrics port's clients (at most 32), torch's own; about a
# hundred with 8 workers. Not 1,024: a small job on a node whose hard limit is 1,024 needs
# no warning.
FILES_BESIDE_PEERS = 256


def files_needed(max_nodes: int) -> int:
    """Open files an agent may need in a job of up to ``max_nodes`` nodes: a presence
    connection to each peer and one from each (``presence.member_cap`` holds up to twice the
    nodes, for a restarted peer's old connection not read yet, and ``pending_cap`` one per
    node still owing its handshake), one store connection per node where this agent hosts
    the store (any agent may come to, by failover), and ``FILES_BESIDE_PEERS``."""
    return 5 * max_nodes + FILES_BESIDE_PEERS


def check_for_nodes(max_nodes: int) -> bool:
    """Say ``resources.fd_limit_low`` (once, at start) where this process's open-file limit,
    already raised to the hard one, is below what a job of ``max_nodes`` nodes may need;
    whether it is enough. Not an error: a job that never grows that large never needs it."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    needed = files_needed(max_nodes)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return True
    emit(
        "resources.fd_limit_low",
        level="warning",
        limit=soft,
        needed=needed,
        max_nodes=max_nodes,
        consequence="at that size this node runs out of files: peers it cannot hold a "
        "presence connection to are found gone by heartbeat expiry only, and the store's "
        "host's death cannot be proven (no failover); raise the hard open-file limit "
        f"(ulimit -Hn, LimitNOFILE=) to {needed} or more",
    )
    return False


def is_exhausted(exc: BaseException) -> bool:
    """``exc`` says no file descriptor is left (this process's limit or the system's)."""
    return isinstance(exc, OSError) and exc.errno in EXHAUSTED


class ExhaustionStreak:
    """Says ``resources.fd_exhausted`` once per streak of failures at ``where``; a streak
    ends after ``QUIET_S`` without one. A flood keeps a listener at the limit for as long as
    it lasts, each freed file taken again at once: a line per refused ``accept`` would be
    thousands a second, and one per recovery still one a second."""

    def __init__(
        self, where: str, consequence: str, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._where, self._consequence, self._clock = where, consequence, clock
        self._last: float | None = None  # the streak's latest failure
        self.failures = 0  # in all
        self.streaks = 0

    def failed(self) -> None:
        now = self._clock()
        new_streak = self._last is None or now - self._last > QUIET_S
        self.failures, self._last = self.failures + 1, now
        if not new_streak:
            return
        self.streaks += 1
        emit(
            "resources.fd_exhausted",
            level="error",
            where=self._where,
            limit=resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            consequence=self._consequence,
        )

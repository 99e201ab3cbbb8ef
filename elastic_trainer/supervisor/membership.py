"""What the rendezvous store says about the other nodes: waiting to join, or gone silent.

A peer that dies usually closes its connections and our workers fail fast; a peer that goes
*silent* (frozen, powered off, cut off by a partition) sends no reset, and our workers would
block in their next collective until its timeout (minutes). Its heartbeats stop all the same:
once a member of our round has not beaten for the keep-alive limit on two checks in a row, the
agent treats it as lost and re-forms without it (``decisions.on_peers_silent``). Two checks,
one keep-alive interval apart, so one late heartbeat on a loaded machine is not a lost node.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from elastic_trainer.errors import first_line
from elastic_trainer.events import emit

CONFIRMATIONS = 2  # consecutive checks that must see the same peers silent


class MembershipWatch:
    def __init__(
        self,
        handler: Any,
        *,
        endpoint: str,
        check_every_s: float,
        dead_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._handler = handler
        self._endpoint = endpoint
        self._every = check_every_s
        self._dead_after = dead_after_s
        self._clock = clock
        self.members: set[Any] = set()
        self._next_check = 0.0
        self._suspects: set[Any] = set()
        self._seen = 0
        self._store_lost_reported = False

    def round_formed(self) -> None:
        """A new round closed: its participants are the members to watch."""
        self.members = set(self._handler.participants())
        self._suspects, self._seen = set(), 0
        self._next_check = self._clock() + self._dead_after  # their first beats are due

    def nodes_waiting(self) -> int:
        try:
            return int(self._handler.num_nodes_waiting())
        except Exception as exc:  # the store host is gone: keep training, no scale-up
            self._report_store_lost(exc)
            return 0

    def silent_peers(self) -> set[Any]:
        """Members whose heartbeats stopped, confirmed on consecutive checks (rate-limited
        to one store read per keep-alive interval)."""
        now = self._clock()
        if len(self.members) < 2 or now < self._next_check:
            return set()
        self._next_check = now + self._every
        try:
            stale = set(self._handler.stale_peers(self.members))
        except Exception as exc:
            self._report_store_lost(exc)
            return set()
        self._seen = self._seen + 1 if stale and stale == self._suspects else int(bool(stale))
        self._suspects = stale
        return stale if self._seen >= CONFIRMATIONS else set()

    def wait_for_lost_peer(self, stop_wait: Callable[[float], bool]) -> bool:
        """After a failure: did a member vanish? Waits until a dead node's heartbeat would
        have expired (``stop_wait`` returns True when a stop interrupts the wait)."""
        deadline = self._clock() + self._dead_after + 1.5
        while self._clock() < deadline:
            try:
                if self._handler.stale_peers(self.members):
                    return True
            except Exception:
                return False
            if stop_wait(0.5):
                return False
        return False

    def _report_store_lost(self, exc: BaseException) -> None:
        if self._store_lost_reported:
            return
        self._store_lost_reported = True
        emit(
            "store.unreachable",
            level="error",
            endpoint=self._endpoint,
            error=first_line(str(exc)),
            consequence="running workers continue; no node can join or leave until restart",
        )

"""What we know about the other nodes: waiting to join, gone (connection closed), or silent.

A peer whose process dies has its presence connection closed by its kernel (``presence.py``):
``lost_peers`` reports it at the next monitor tick, and ``before_rejoin`` tells the rendezvous
to drop it at once (``FastRecoveryRendezvousHandler.mark_dead``) instead of waiting for its
heartbeats to expire. That expiry stays the fallback for peers that send no reset.

A peer that goes *silent* (frozen, powered off, cut off by a partition) sends no reset, and
our workers would block in their next collective until its timeout (minutes). Its heartbeats
stop all the same: once a member of our round has not beaten for the keep-alive limit on two
checks in a row, the agent treats it as lost and re-forms without it
(``decisions.on_peers_gone``). Two checks, one keep-alive interval apart, so one late
heartbeat on a loaded machine is not a lost node.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from elastic_trainer.contract.auth import JobKey
from elastic_trainer.contract.endpoint import format_endpoint, split_address
from elastic_trainer.contract.events import emit
from elastic_trainer.errors import first_line
from elastic_trainer.supervisor.core import decisions
from elastic_trainer.supervisor.rendezvous import presence

CONFIRMATIONS = 2  # consecutive checks that must see the same peers silent
WATCHERS = 2  # members that check each member's heartbeats (``decisions.peers_to_watch``)


class MembershipWatch:
    def __init__(
        self,
        handler: Any,
        *,
        endpoint: str,
        check_every_s: float,
        dead_after_s: float,
        leaving_grace_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._handler = handler
        self._endpoint = endpoint
        self._every = check_every_s
        self._dead_after = dead_after_s
        self._leaving_grace = leaving_grace_s
        self._left_heard: dict[Any, float] = {}  # a member's goodbye: when we first heard it
        self._clock = clock
        self.members: set[Any] = set()
        self._next_check = 0.0
        self._suspects: set[Any] = set()
        self._seen = 0
        self._store_lost_reported = False
        self._server: presence.PresenceServer | None = None
        self.peers: presence.PeerWatch | None = None  # None: heartbeats only
        self._confirmed_silent: set[Any] = set()
        self._address = ""  # our own presence address, as published
        # what store failover needs once the store is gone (failover.py), read at each round:
        self.addresses: dict[str, str] = {}  # member name -> its presence address
        self.store_host: str | None = None  # the member hosting the store (None: standalone)
        self._labels: dict[Any, str] = {}  # member -> its --node name (events name it so)
        self._presence: dict[Any, str] = {}  # member -> its presence address, as published

    def open_presence(self, bind_host: str, key: JobKey, *, max_nodes: int) -> None:
        """Listen for peers and publish where (before the first join, so every member of a
        round finds every other's address). Without it we fall back to heartbeats alone.
        ``key``: the job's secret, which every member's presence handshake proves;
        ``max_nodes``: the job's bound, so that every member finds a place."""
        try:
            server = presence.PresenceServer(
                bind_host,
                key,
                max_pending=presence.pending_cap(max_nodes),
                max_connections=presence.member_cap(max_nodes),
            )
            host = self._handler.this_node.addr if bind_host == "0.0.0.0" else bind_host
            address = format_endpoint(host, server.port)
            self._handler.publish_presence(address)
        except Exception as exc:
            emit(
                "presence.unavailable",
                level="warning",
                error=first_line(str(exc)) or type(exc).__name__,
                consequence="lost nodes are found by heartbeat expiry only",
            )
            return
        self._server = server
        self.peers = presence.PeerWatch(key, member_name(self._handler.this_node))
        self._address = address

    def say_goodbye(self, *, as_straggler: bool = False) -> None:
        """We leave on purpose: every member watching us hears so now (``left_peers``), and
        whether we leave as a straggler (``stragglers_left``)."""
        if self._server is not None:
            self._server.say_goodbye(presence.BYE_STRAGGLER if as_straggler else presence.BYE)

    def left_peers(self) -> set[Any]:
        """Members of this round that said goodbye (preempted, or done): gone on purpose."""
        if self.peers is None:
            return set()
        self.peers.lost()  # reads the connections: a goodbye is found there
        return self.peers.left() & self.members

    def stragglers_left(self) -> set[Any]:
        """Of ``left_peers()``: members that said they leave as stragglers (call it after)."""
        if self.peers is None:
            return set()
        return self.peers.left_as_stragglers() & self.members

    def close(self) -> None:
        """We leave on purpose: tell the peers so (not a lost node)."""
        if self._server is not None:
            self._server.close()
        if self.peers is not None:
            self.peers.close()

    def round_formed(self) -> None:
        """A new round closed: its participants are the members to watch."""
        self.members = set(self._handler.participants())
        self._suspects, self._seen, self._confirmed_silent = set(), 0, set()
        self._next_check = self._clock() + self._dead_after  # their first beats are due
        # A node's name and presence address never change (a node is one agent process):
        # only new members' are read (every member read every member's after each round,
        # N² reads per re-form).
        self._labels = {n: a for n, a in self._labels.items() if n in self.members}
        with contextlib.suppress(Exception):  # names only: events fall back to ADDR:PID
            if unnamed := self.members - self._labels.keys():
                self._labels.update(self._handler.node_labels(unnamed))
        if self.peers is not None:
            others = self.members - {self._handler.this_node}
            found = {n: a for n, a in self._presence.items() if n in others}
            try:
                if new := others - found.keys():
                    found.update(self._handler.presence_addresses(new))
                self.store_host = self._handler.store_host_member()
            except Exception as exc:
                self._report_store_lost(exc)
            self._presence = found
            self.peers.watch({n: split_address(a) for n, a in found.items()})
            self.addresses = {member_name(n): a for n, a in found.items()}
            self.addresses[member_name(self._handler.this_node)] = self._address

    def gone(self) -> set[str]:
        """Names of the last round's members certainly gone: their agent's connection closed
        without a goodbye, or with one (store failover's proof; silence is no proof)."""
        if self.peers is None:
            return set()
        gone = self.lost_peers() | (self.peers.left() & self.members)
        return {member_name(n) for n in gone}

    def label(self, node: Any) -> str:
        """How events name a member: its ``--node`` name, else its address and pid."""
        return self._labels.get(node) or node_name(node)

    def label_of_member(self, name: str) -> str:
        """``label`` of the member called ``name`` (``member_name``); the name if unknown."""
        found = self.members_named({name})
        return self.label(next(iter(found))) if found else name

    def member_names(self) -> set[str]:
        return {member_name(n) for n in self.members}

    def members_named(self, names: set[str]) -> set[Any]:
        return {n for n in self.members if member_name(n) in names}

    def store_moved(self, host: str) -> None:
        """The store is ``host``'s now: a second failover starts from there, and a later
        loss of it is reported again."""
        self.store_host = host
        self._store_lost_reported = False

    def watched_fds(self) -> list[int]:
        """The presence connections to the members: one turns readable when a peer's
        supervisor goes away (``presence.PeerWatch.fds``)."""
        return self.peers.fds() if self.peers is not None else []

    def lost_peers(self) -> set[Any]:
        """Members whose agent process is gone (its connection closed without a goodbye)."""
        return self.peers.lost() & self.members if self.peers is not None else set()

    def connected_peers(self) -> set[Any]:
        """Members whose presence connection is open: their agent process is there, however
        slow (a frozen one too: the heartbeat expiry tells those apart)."""
        if self.peers is None:
            return set()
        self.lost_peers()  # reads the connections: a closed one is no longer watched
        return self.peers.watching() & self.members

    def before_rejoin(self) -> None:
        """Tell the rendezvous which members are certainly gone (lost, confirmed silent, or
        left on purpose), so the next round neither waits for them to rejoin nor for their
        heartbeats to expire."""
        dead = self.lost_peers() | self._confirmed_silent
        if self.peers is not None:
            dead |= self.peers.left() & self.members
        if dead:
            self._handler.mark_dead(dead)

    def nodes_waiting(self) -> int:
        try:
            return int(self._handler.num_nodes_waiting())
        except Exception as exc:  # the store host is gone: keep training, no scale-up
            self._report_store_lost(exc)
            return 0

    def silent_peers(self) -> set[Any]:
        """Of the members this node watches (``decisions.peers_to_watch``: the next two in
        node order), those whose heartbeats stopped, confirmed on consecutive checks
        (rate-limited to one store read per keep-alive interval). A member that said
        goodbye is leaving, not silent, for ``leaving_grace_s`` (its grace period): it stops
        its heartbeats at once, while its workers may still take a step to stop with their
        final snapshot, which our workers take part in. Past that it is silent like any
        other (our workers never noticed it go: they were frozen, or blocked in a
        collective)."""
        now = self._clock()
        if len(self.members) < 2 or now < self._next_check:
            return set()
        self._next_check = now + self._every
        try:
            me = self._handler.this_node
            watched = decisions.peers_to_watch(me, self.members, WATCHERS)
            stale = set(self._handler.stale_peers(watched)) - self._still_leaving(now)
        except Exception as exc:
            self._report_store_lost(exc)
            return set()
        self._seen = self._seen + 1 if stale and stale == self._suspects else int(bool(stale))
        self._suspects = stale
        if self._seen < CONFIRMATIONS:
            return set()
        self._confirmed_silent = set(stale)
        return stale

    def _still_leaving(self, now: float) -> set[Any]:
        """Members that said goodbye less than ``leaving_grace_s`` ago."""
        left = self.left_peers()
        for peer in left:
            self._left_heard.setdefault(peer, now)
        return {p for p in left if now - self._left_heard[p] < self._leaving_grace}

    def wait_for_lost_peer(self, stop_wait: Callable[[float], bool]) -> bool:
        """After a failure: did a member vanish? Waits until a dead node's heartbeat would
        have expired (``stop_wait`` returns True when a stop interrupts the wait)."""
        deadline = self._clock() + self._dead_after + 1.5
        while self._clock() < deadline:
            if self.lost_peers():  # its connection closed meanwhile: no need to wait longer
                return True
            try:
                if self._handler.stale_peers(self.members):
                    return True
            except Exception:
                return False
            if stop_wait(0.5):
                return False
        return False

    def store_host_unreachable(self) -> str | None:
        """The member hosting the store, when the store stopped answering (a read failed) and
        that member is another node of our round; None otherwise (a standalone store: the
        workers train on without it)."""
        host = self.store_host
        if not self._store_lost_reported or host is None or host not in self.member_names():
            return None
        return host if host != member_name(self._handler.this_node) else None

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


def node_name(node: Any) -> str:
    """A rendezvous node as ops can find it: its address and its agent's pid."""
    addr, pid = getattr(node, "addr", None), getattr(node, "pid", None)
    return f"{addr}:{pid}" if addr is not None and pid is not None else str(node)


def member_name(node: Any) -> str:
    """``node_name``, told apart from another handler of the same process (tests run several)."""
    local_id = getattr(node, "local_id", 0)
    return node_name(node) + (f"/{local_id}" if local_id else "")

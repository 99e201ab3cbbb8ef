"""Presence: know at once that a peer agent's process is gone, from its closed connection.

Every agent listens on one TCP port and publishes ``host:port`` in the rendezvous store; after
each round it holds one connection to every other member's port. When a peer's process dies
(SIGKILL, OOM kill, crash) its kernel closes that connection and ours reads EOF or a reset at
the next check: the peer is *lost*, now, not once its heartbeats expire (interval x attempts).

No false positives by construction: a live agent keeps its port open, however slow or loaded
it is, and a frozen one (SIGSTOP, a hung machine) too. Those, and nodes cut off without a reset
(power loss, partition), are what the heartbeat expiry is still there for
(``membership.MembershipWatch.silent_peers``). A peer we cannot connect to is only "lost" when
the connection is *refused* (nothing listens there any more); a timeout proves nothing.

A port holds only connections whose peer proved it holds the job's secret (the handshake
below), so that no process outside the job can use up its places, nor pose as a peer.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import hmac
import ipaddress
import os
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from elastic_trainer.contract.auth import JobKey, handshake_tag
from elastic_trainer.supervisor.processes import fd_limit

CONNECT_TIMEOUT_S = 2.0
# a peer not held (its connect failed or timed out, its port turned us away) is dialed again
# after this, then twice as long each time up to RETRY_MAX_S (``PeerWatch``)
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0
BYE = b"b"  # sent by an agent that exits on purpose (done, preempted): not a lost node
# sent instead by an agent that leaves the group as a straggler (it rejoins after a cool-down);
# an agent that does not know it reads a lost node, the outcome before goodbyes had reasons
BYE_STRAGGLER = b"s"
GOODBYES = (BYE, BYE_STRAGGLER)


def bind_host(local_addr: str | None, rdzv_host: str) -> str:
    """Where to listen: ``--local-addr`` if given; the loopback when the rendezvous is on the
    loopback (single-machine jobs and tests never open a port elsewhere); else every interface."""
    if local_addr:
        return local_addr
    return "127.0.0.1" if is_loopback(rdzv_host) else "0.0.0.0"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Anyone who can reach the port can connect (on one machine: every local user), so only a
# connection whose peer proves it holds the job's secret is held. On accept the server sends
# a challenge (a fresh nonce); the peer answers HELLO: its member name and
# ``handshake_tag(key, nonce, member)`` (contract/auth.py), within the handshake deadline.
# Until then a connection is *pending*: pending ones are few (``max_pending``; a newer one
# pushes out the oldest, so that a member, who answers within milliseconds, still gets in
# during a flood) and closed at their deadline; they never take a member's place, which only
# an answer with the key can (``max_connections`` members in all). A connection turned away
# is told so (REFUSED): its peer is unknown, not lost.
VERSION = b"presence/2"
REFUSED = b"r"
NONCE_BYTES = 16
CHALLENGE_LEN = len(VERSION) + 1 + 2 * NONCE_BYTES + 1  # VERSION, space, nonce in hex, \n
MAX_MEMBER = 256  # bytes of a member's name (an address and a pid: tens)
MAX_HELLO = len(VERSION) + 1 + MAX_MEMBER + 1 + 2 * 32 + 1  # ... member, space, tag, \n
HANDSHAKE_TIMEOUT_S = 5.0
ANSWER_WAIT_S = 1.0  # watch() waits this long for every peer's challenge, all together
MAX_PENDING = 128  # at least (``pending_cap``); a member's answer waits for its next connect
MAX_CONNECTIONS = 512  # members, at least (``member_cap``: a larger job's nodes, twice over)
ACCEPT_BACKOFF_S = 0.1  # no file left for an accept: try again after this
_PREFIX = VERSION + b" "
_PEEK = socket.MSG_DONTWAIT | socket.MSG_PEEK  # how lost() reads a connection's first byte


def member_cap(max_nodes: int) -> int:
    """How many members' connections a port holds in a job of up to ``max_nodes`` nodes:
    every peer's, and as many again for a restarted peer's old connection, which is dropped
    only once read as closed; at least ``MAX_CONNECTIONS``. A member over the cap is turned
    away, and its watcher can then prove neither its death nor, were it the store's host,
    that the store died with it (``failover``): a fixed 512 turned away members of every
    job of more than 513 nodes. Only a peer that proves the job's key takes a place."""
    return max(MAX_CONNECTIONS, 2 * max_nodes)


def pending_cap(max_nodes: int) -> int:
    """How many connections a port keeps while they owe their HELLO, in a job of up to
    ``max_nodes`` nodes: one per node, at least ``MAX_PENDING``. After a round every peer
    dials every other at once, each answering a challenge only between two of its own dials:
    with a fixed 128, a burst of more peers pushed out ones that had not answered yet, and
    they went unwatched."""
    return max(MAX_PENDING, max_nodes)


def challenge(nonce: bytes) -> bytes:
    return _PREFIX + nonce.hex().encode() + b"\n"


def read_challenge(data: bytes) -> bytes | None:
    """The nonce in a server's challenge; None if ``data`` is not one (another protocol)."""
    if len(data) != CHALLENGE_LEN or not data.startswith(_PREFIX) or data[-1:] != b"\n":
        return None
    try:
        return bytes.fromhex(data[len(_PREFIX) : -1].decode("ascii"))
    except ValueError:
        return None


def hello(key: JobKey, nonce: bytes, member: str) -> bytes:
    """A peer's answer to ``nonce``: it holds ``key``, as ``member``."""
    tag = handshake_tag(key, nonce, member).hex().encode()
    return _PREFIX + member.encode() + b" " + tag + b"\n"


def check_hello(key: JobKey, nonce: bytes, line: bytes) -> str | None:
    """The member that answered ``nonce`` with ``line``, if the line proves it holds ``key``;
    None for anything else (a wrong key, another nonce, a malformed or oversized line)."""
    if len(line) > MAX_HELLO or not line.endswith(b"\n") or line.count(b"\n") != 1:
        return None
    parts = line[:-1].split(b" ")
    if len(parts) != 3 or parts[0] != VERSION:
        return None
    try:
        member, tag = parts[1].decode("utf-8"), bytes.fromhex(parts[2].decode("ascii"))
    except ValueError:  # UnicodeDecodeError is one
        return None
    if not member or not hmac.compare_digest(tag, handshake_tag(key, nonce, member)):
        return None
    return member


@dataclasses.dataclass
class _Conn:
    nonce: bytes
    deadline: float  # for HELLO
    got: bytes = b""
    member: str | None = None  # set once greeted: held from then on, however long


class PresenceServer:
    """This agent's port: accepts peers' connections and holds the members' while it lives."""

    def __init__(
        self,
        host: str,
        key: JobKey,
        *,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        max_pending: int = MAX_PENDING,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self._key = key
        self._handshake_timeout_s = handshake_timeout_s
        self._max_pending, self._max_connections = max_pending, max_connections
        # oldest first: all share one timeout, so the first is the first to expire
        self._pending: collections.OrderedDict[socket.socket, _Conn] = collections.OrderedDict()
        self._held: dict[socket.socket, _Conn] = {}
        # refused: a HELLO without the key, malformed, or over the members' cap; timed out:
        # no HELLO in time; evicted: pending, pushed out by a newer connection
        self.accepted = self.refused = self.timed_out = self.evicted = 0
        self._exhausted = fd_limit.ExhaustionStreak(
            "presence", "new peers wait until a file is free; the job goes on"
        )
        self._paused_until: float | None = None  # accepts paused: no file was left
        # every peer dials us at once after a round: a full accept queue drops their SYNs,
        # and a dial that times out leaves that peer unwatched (the kernel caps it: somaxconn)
        self._sock = socket.create_server((host, 0), backlog=max_connections + max_pending)
        self._sock.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="presence", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    @property
    def held(self) -> int:
        """Members' connections held now."""
        return len(self._held)

    @property
    def pending(self) -> int:
        """Connections still owing their HELLO."""
        return len(self._pending)

    def _serve(self) -> None:
        while not self._closed.is_set():
            self._resume_accepting()
            for key, _ in self._selector.select(timeout=self._wait_s()):
                sock: Any = key.fileobj
                if sock is self._sock:
                    self._accept()
                elif sock in self._pending or sock in self._held:  # not pushed out meanwhile
                    self._read(sock, key.data)
            self._expire()

    def _wait_s(self) -> float:
        due = [next(iter(self._pending.values())).deadline] if self._pending else []
        if self._paused_until is not None:
            due.append(self._paused_until)
        return max(0.0, min([0.5, *(d - time.monotonic() for d in due)]))

    def _accept(self) -> None:
        try:
            sock, _ = self._sock.accept()
        except OSError as exc:  # never out of this thread, and never a busy loop
            if fd_limit.is_exhausted(exc):
                self._pause_accepting()
            return  # else one that reset before we took it: nothing to do
        self.accepted += 1
        if len(self._pending) >= self._max_pending:
            oldest = next(iter(self._pending))
            self.evicted += 1
            self._drop(oldest, refuse=True)
        conn = _Conn(os.urandom(NONCE_BYTES), time.monotonic() + self._handshake_timeout_s)
        try:
            sock.setblocking(False)
            sock.send(challenge(conn.nonce))  # 44 bytes into an empty buffer: all of them
        except OSError:
            sock.close()
            return
        self._pending[sock] = conn
        self._selector.register(sock, selectors.EVENT_READ, conn)

    def _pause_accepting(self) -> None:
        """No file descriptor left: say so (once per streak) and stop selecting the listening
        socket for a moment; it stays readable, and would be selected again at once."""
        self._exhausted.failed()
        self._selector.unregister(self._sock)
        self._paused_until = time.monotonic() + ACCEPT_BACKOFF_S

    def _resume_accepting(self) -> None:
        if self._paused_until is not None and time.monotonic() >= self._paused_until:
            self._paused_until = None
            self._selector.register(self._sock, selectors.EVENT_READ)

    def _read(self, sock: socket.socket, conn: _Conn) -> None:
        try:
            data = sock.recv(1 if conn.member else MAX_HELLO - len(conn.got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if conn.member or not data:  # a peer closed its end (it re-watches each round, or died)
            self._drop(sock)
            return
        conn.got += data
        if b"\n" not in conn.got and len(conn.got) < MAX_HELLO:
            return  # more to come, before the deadline
        member = check_hello(self._key, conn.nonce, conn.got)
        if member is None or len(self._held) >= self._max_connections:
            self.refused += 1
            self._drop(sock, refuse=True)
            return
        conn.member, conn.got = member, b""
        self._held[sock] = self._pending.pop(sock)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            sock, conn = next(iter(self._pending.items()))
            if conn.deadline > now:
                return
            self.timed_out += 1
            self._drop(sock, refuse=True)

    def _drop(self, sock: socket.socket, *, refuse: bool = False) -> None:
        self._selector.unregister(sock)
        self._pending.pop(sock, None)
        self._held.pop(sock, None)
        if refuse:
            _turn_away(sock)
        else:
            sock.close()

    def say_goodbye(self, goodbye: bytes = BYE) -> None:
        """Tell every member watching us that we leave on purpose (preempted; or
        ``BYE_STRAGGLER``), before our workers stop: their workers' failure that follows is
        our leaving, not a crash. The connections stay open (each watcher ends its own on the
        goodbye)."""
        if goodbye not in GOODBYES:
            raise ValueError(f"not a goodbye: {goodbye!r}")
        for sock in list(self._held):
            with contextlib.suppress(OSError):
                sock.send(goodbye)

    def close(self) -> None:
        """Say goodbye on every connection (we leave on purpose), then close."""
        self._closed.set()
        self._thread.join(timeout=2)
        for sock in [*self._pending, *self._held]:
            with contextlib.suppress(OSError):
                sock.send(BYE)
            sock.close()
        self._sock.close()
        self._selector.close()


def _turn_away(sock: socket.socket) -> None:
    """REFUSED, then an orderly close: what the client sent is read first, since closing on
    unread data resets the connection instead."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        sock.send(REFUSED)
        sock.shutdown(socket.SHUT_WR)
        sock.recv(4096)
    sock.close()


@dataclasses.dataclass
class _Link:
    sock: socket.socket
    address: tuple[str, int]  # the peer's port, as published
    dialed_at: float  # monotonic; a connect still under way after CONNECT_TIMEOUT_S ends
    connected: bool = False
    got: bytes = b""  # of the server's challenge
    answered: bool = False


class PeerWatch:
    """One connection to each watched peer's presence port; ``lost()`` never blocks.

    A peer we hold no answered connection to (its connect timed out or failed, its port
    turned us away, its challenge was not one) is dialed again, from ``lost()``, after
    ``RETRY_FIRST_S`` and then twice as long each time, up to ``RETRY_MAX_S``: a peer left
    unwatched until the next round could prove neither its own death nor, were it the
    store's host, the store's (``failover``). Connects never block: every peer is dialed at
    once, and the kernel says which ones completed."""

    def __init__(
        self, key: JobKey, member: str, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._key, self._member = key, member  # what we answer challenges with, as whom
        self._clock = clock
        self._peers: dict[Any, tuple[str, int]] = {}  # what ``watch`` was given
        # each address as resolved once: a redial from the supervisor's loop must not wait
        # on a resolver (a name's lookup can take the resolver's 5 s timeout)
        self._resolved: dict[tuple[str, int], tuple[int, int, int, Any]] = {}
        self._links: dict[Any, _Link] = {}
        self._redial_at: dict[Any, float] = {}  # node -> when it is dialed again
        self._waited: dict[Any, float] = {}  # node -> the last wait before a redial
        # every link's socket, for ``lost()``: the kernel says which turned readable (a
        # goodbye, EOF or reset) or finished connecting, so a check of N links is one call
        self._poller = select.poll()
        self._node_of: dict[int, Any] = {}  # fd -> node
        self._lost: set[Any] = set()
        self._left: set[Any] = set()
        self._stragglers: set[Any] = set()  # of ``_left``: left as stragglers

    def watch(self, peers: Mapping[Any, tuple[str, int]]) -> None:
        """Watch exactly ``peers`` (node -> (host, port)) from now on. A connection to a peer
        already watched at the same address, answered and still open, is kept: every member
        connecting to every other after each round was N² connections and handshakes per
        re-form (16,000 at 128 agents). What was found lost or left before is forgotten:
        those are not in a new round."""
        self.lost()  # settles every connection: a closed one or a goodbye ends it
        self._peers = {node: (address[0], address[1]) for node, address in peers.items()}
        kept = set(self._peers.values())
        self._resolved = {a: r for a, r in self._resolved.items() if a in kept}
        for node, link in list(self._links.items()):
            if not link.answered or self._peers.get(node) != link.address:
                self._end(node, None)
        self._redial_at.clear()  # a new round: every peer not held is dialed now
        self._waited.clear()
        self._lost.clear()
        self._left.clear()
        self._stragglers.clear()
        for node in self._peers.keys() - self._links.keys():
            self._dial(node)
        self._answer_all(ANSWER_WAIT_S)

    def _dial(self, node: Any) -> None:
        """Start a connect to ``node``'s port without waiting for it (``_service`` goes on)."""
        self._redial_at.pop(node, None)
        address = self._peers[node]
        try:
            if address not in self._resolved:
                family, kind, proto, _, sockaddr = socket.getaddrinfo(
                    address[0], address[1], type=socket.SOCK_STREAM
                )[0]
                self._resolved[address] = (family, kind, proto, sockaddr)
            family, kind, proto, sockaddr = self._resolved[address]
            sock = socket.socket(family, kind, proto)
        except OSError:  # a name not resolved now, or no file left: unknown, try again
            self._retry(node)
            return
        sock.setblocking(False)  # from here on, only what has arrived is read
        error = sock.connect_ex(sockaddr)
        if error == errno.ECONNREFUSED:
            sock.close()
            self._lost.add(node)  # nothing listens there: its agent is gone
            return
        if error not in (0, errno.EINPROGRESS):
            sock.close()
            self._retry(node)  # unreachable: unknown, the heartbeat expiry decides meanwhile
            return
        self._links[node] = _Link(sock, address, self._clock(), connected=error == 0)
        self._poller.register(sock, select.POLLIN if error == 0 else select.POLLOUT)
        self._node_of[sock.fileno()] = node

    def _retry(self, node: Any) -> None:
        """Dial ``node`` again later, waiting twice as long as the last time."""
        if node not in self._peers:
            return
        wait = min(RETRY_MAX_S, 2 * self._waited.get(node, RETRY_FIRST_S / 2))
        self._waited[node], self._redial_at[node] = wait, self._clock() + wait

    def _redial_due(self) -> None:
        now = self._clock()
        for node, link in list(self._links.items()):
            if not link.connected and now - link.dialed_at >= CONNECT_TIMEOUT_S:
                self._end(node, None)  # no answer to our connect: unknown, dialed again
        for node, when in list(self._redial_at.items()):
            if when <= now and node not in self._links:
                self._dial(node)

    def _answer_all(self, wait_s: float) -> None:
        """Complete the connects and answer the peers' challenges as they come, for up to
        ``wait_s``. One that sends none by then (a frozen agent) is answered later, by
        ``lost()``: its connection turns readable, which wakes the supervisor's loop
        (``fds``)."""
        deadline = time.monotonic() + wait_s  # a wait in the kernel: on its clock
        while any(not link.answered for link in self._links.values()):
            left = deadline - time.monotonic()
            self._service(self._poller.poll(max(0.0, left) * 1000))
            self._redial_due()
            if left <= 0:
                return

    def _service(self, ready: list[tuple[int, int]]) -> None:
        """Act on what the kernel reported of the links: a connect done, a challenge come, a
        goodbye, EOF or reset."""
        for fd, _ in ready:
            node = self._node_of.get(fd)
            if node is None:  # ended by an earlier entry of this list
                continue
            link = self._links[node]
            if not link.connected:
                self._connected(node, link)
            elif not link.answered:
                self._greet(node)
            else:
                self._read_end(node, link)

    def _connected(self, node: Any, link: _Link) -> None:
        error = link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error == errno.ECONNREFUSED:
            self._end(node, self._lost)  # nothing listens there: its agent is gone
        elif error:
            self._end(node, None)  # unreachable: unknown, dialed again
        else:
            link.connected = True
            self._poller.modify(link.sock, select.POLLIN)  # its challenge comes next

    def _greet(self, node: Any) -> None:
        """Read what came of ``node``'s challenge; answer it once whole."""
        link = self._links[node]
        try:
            data = link.sock.recv(CHALLENGE_LEN - len(link.got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""  # reset
        if not data:  # EOF or reset: the process is gone
            self._end(node, self._lost)
            return
        link.got += data
        if not _PREFIX.startswith(link.got[: len(_PREFIX)]):  # REFUSED, BYE or not ours
            self._end_with(node, link.got[:1])
        elif len(link.got) == CHALLENGE_LEN:
            self._answer(node, link)

    def _answer(self, node: Any, link: _Link) -> None:
        nonce = read_challenge(link.got)
        with contextlib.suppress(OSError):
            if nonce is not None:
                link.sock.send(hello(self._key, nonce, self._member))  # fits an empty buffer
                link.answered = True
                self._waited.pop(node, None)
        if not link.answered:
            self._end(node, None)  # unknown, the heartbeat expiry decides

    def _read_end(self, node: Any, link: _Link) -> None:
        """An answered link turned readable: what its first byte says."""
        try:
            data: bytes | None = link.sock.recv(1, _PEEK)
        except (BlockingIOError, InterruptedError, TimeoutError):
            return  # woken, nothing to read after all: alive
        except OSError:
            data = None  # reset
        if data in GOODBYES:
            self._end_with(node, data)
        elif data == REFUSED:
            self._end(node, None)  # turned away: unknown, the heartbeat expiry decides
        else:  # EOF or reset without a goodbye: the process is gone
            self._end(node, self._lost)

    def _end(self, node: Any, into: set[Any] | None) -> None:
        """Stop watching ``node``'s link; ``into``: lost or left. None when unknown: dialed
        again later (``_retry``)."""
        sock = self._links.pop(node).sock
        self._poller.unregister(sock)
        del self._node_of[sock.fileno()]
        sock.close()
        if into is not None:
            into.add(node)
        else:
            self._retry(node)

    def _end_with(self, node: Any, first: bytes) -> None:
        """Stop watching ``node``, whose first unread byte is ``first``: a goodbye (left), or
        REFUSED or not ours (unknown)."""
        if first == BYE_STRAGGLER:
            self._stragglers.add(node)
        self._end(node, self._left if first in GOODBYES else None)

    def lost(self) -> set[Any]:
        """Peers whose connection was closed or reset, or whose port no longer listens (read
        without blocking); one their port turned away is no longer watched, and not lost
        (dialed again later). Only connections with something to read are read: an open,
        quiet one is a live peer."""
        self._service(self._poller.poll(0))
        self._redial_due()
        return set(self._lost)

    def left(self) -> set[Any]:
        """Peers that said goodbye (done or preempted): gone, but not lost. Call after
        ``lost()``, which reads the connections."""
        return set(self._left)

    def left_as_stragglers(self) -> set[Any]:
        """Of ``left()``: peers whose goodbye said they leave as stragglers."""
        return set(self._stragglers)

    def fds(self) -> list[int]:
        """The links' fds: readable once a peer closes or resets one (its supervisor's loop
        waits on them, ``StopRequest.wait_for_change``), once a late challenge arrives or a
        connect fails; ``lost`` then reads it."""
        return [link.sock.fileno() for link in self._links.values()]

    def watching(self) -> set[Any]:
        """Peers whose connection is open (connected, answered or not yet)."""
        return {node for node, link in self._links.items() if link.connected}

    def close(self) -> None:
        self._peers = {}
        for node in list(self._links):
            self._end(node, None)
        self._redial_at.clear()
        self._waited.clear()
        self._lost.clear()
        self._left.clear()
        self._stragglers.clear()

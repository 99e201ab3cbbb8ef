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
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import ipaddress
import selectors
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

CONNECT_TIMEOUT_S = 2.0
BYE = b"b"  # sent by an agent that exits on purpose (done, preempted): not a lost node


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


# Anyone who can reach the port can connect, so what a connection may hold is bounded: a
# peer says HELLO at once (else it is dropped), and connections per address and in all are
# capped. A connection turned away is told so (REFUSED): its peer is unknown, not lost.
HELLO = b"presence/1\n"  # the first bytes on every watch connection
REFUSED = b"r"
HANDSHAKE_TIMEOUT_S = 5.0
MAX_PER_PEER = 8  # agents of one job sharing a host (and so an address) each hold one
MAX_CONNECTIONS = 512  # well below the common 1,024 open files


@dataclasses.dataclass
class _Conn:
    peer: str  # the remote address, whatever its port
    deadline: float  # for HELLO
    got: bytes = b""
    greeted: bool = False


class PresenceServer:
    """This agent's port: accepts peers' connections and holds them while the agent lives."""

    def __init__(
        self,
        host: str,
        *,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        max_per_peer: int = MAX_PER_PEER,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self._handshake_timeout_s = handshake_timeout_s
        self._max_per_peer, self._max_connections = max_per_peer, max_connections
        self._per_peer: collections.Counter[str] = collections.Counter()
        self.refused = 0  # over a cap, or not a HELLO
        self.timed_out = 0  # no HELLO in time
        self._sock = socket.create_server((host, 0), backlog=128)
        self._sock.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="presence", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    def _serve(self) -> None:
        while not self._closed.is_set():
            for key, _ in self._selector.select(timeout=self._wait_s()):
                if key.fileobj is self._sock:
                    self._accept()
                else:
                    self._read(key.fileobj, key.data)  # type: ignore[arg-type]
            self._expire()

    def _pending(self) -> list[tuple[socket.socket, _Conn]]:
        """Connections still owing their HELLO (the listening socket has no ``_Conn``)."""
        keys = list(self._selector.get_map().values())
        pending = [k for k in keys if k.data is not None and not k.data.greeted]
        return [(k.fileobj, k.data) for k in pending]  # type: ignore[misc]

    def _wait_s(self) -> float:
        deadlines = [conn.deadline for _, conn in self._pending()]
        return max(0.0, min([0.5, *(d - time.monotonic() for d in deadlines)]))

    def _accept(self) -> None:
        try:
            sock, address = self._sock.accept()
        except OSError:
            return
        peer = str(address[0])
        held = len(self._selector.get_map()) - 1
        if held >= self._max_connections or self._per_peer[peer] >= self._max_per_peer:
            self.refused += 1
            _turn_away(sock)
            return
        sock.setblocking(False)
        conn = _Conn(peer, time.monotonic() + self._handshake_timeout_s)
        self._selector.register(sock, selectors.EVENT_READ, conn)
        self._per_peer[peer] += 1

    def _read(self, sock: socket.socket, conn: _Conn) -> None:
        try:
            data = sock.recv(len(HELLO))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if conn.greeted or not data:  # a peer closed its end (it re-watches each round, or died)
            self._drop(sock, conn)
            return
        conn.got += data
        if not HELLO.startswith(conn.got):
            self.refused += 1
            self._drop(sock, conn, refuse=True)
        elif conn.got == HELLO:
            conn.greeted = True  # held from now on, however long

    def _expire(self) -> None:
        now = time.monotonic()
        for sock, conn in self._pending():
            if conn.deadline <= now:
                self.timed_out += 1
                self._drop(sock, conn, refuse=True)

    def _drop(self, sock: socket.socket, conn: _Conn, *, refuse: bool = False) -> None:
        self._selector.unregister(sock)
        self._per_peer[conn.peer] -= 1
        if not self._per_peer[conn.peer]:
            del self._per_peer[conn.peer]  # addresses come and go: keep only those held
        if refuse:
            _turn_away(sock)
        else:
            sock.close()

    def close(self) -> None:
        """Say goodbye on every held connection (we leave on purpose), then close."""
        self._closed.set()
        self._thread.join(timeout=2)
        for key in list(self._selector.get_map().values()):
            sock: Any = key.fileobj
            with contextlib.suppress(OSError):
                if sock is not self._sock:
                    sock.send(BYE)
                sock.close()
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


class PeerWatch:
    """One connection to each watched peer's presence port; ``lost()`` never blocks."""

    def __init__(self) -> None:
        self._socks: dict[Any, socket.socket] = {}
        self._lost: set[Any] = set()
        self._left: set[Any] = set()

    def watch(self, peers: Mapping[Any, tuple[str, int]]) -> None:
        """Watch exactly ``peers`` (node -> (host, port)) from now on."""
        self.close()
        for node, address in peers.items():
            try:
                sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
            except ConnectionRefusedError:
                self._lost.add(node)  # nothing listens there: its agent is gone
                continue
            except OSError:
                continue  # unreachable or slow: unknown, the heartbeat expiry decides
            try:
                sock.sendall(HELLO)
            except OSError:
                sock.close()  # unknown, as above
                continue
            sock.setblocking(False)  # lost() only peeks
            self._socks[node] = sock

    def lost(self) -> set[Any]:
        """Peers whose connection was closed or reset (read without blocking); one their port
        turned away is no longer watched, and not lost."""
        for node, sock in list(self._socks.items()):
            try:
                data: bytes | None = sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError, TimeoutError):
                continue  # open, nothing to read: alive
            except OSError:
                data = None  # reset
            if data == BYE:
                self._left.add(node)
            elif data == REFUSED:
                pass  # its port is full: unknown, the heartbeat expiry decides
            else:  # EOF or reset without a goodbye: the process is gone
                self._lost.add(node)
            sock.close()
            del self._socks[node]
        return set(self._lost)

    def left(self) -> set[Any]:
        """Peers that said goodbye (done or preempted): gone, but not lost. Call after
        ``lost()``, which reads the connections."""
        return set(self._left)

    def fds(self) -> list[int]:
        """The open connections' fds: readable once a peer closes or resets one (its
        supervisor's loop waits on them, ``StopRequest.wait_for_change``); ``lost`` then
        reads and closes it."""
        return [sock.fileno() for sock in self._socks.values()]

    def watching(self) -> set[Any]:
        """Peers whose connection is still open."""
        return set(self._socks)

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()
        self._lost.clear()
        self._left.clear()


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)

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

import contextlib
import ipaddress
import selectors
import socket
import threading
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


class PresenceServer:
    """This agent's port: accepts peers' connections and holds them while the agent lives."""

    def __init__(self, host: str) -> None:
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
            for key, _ in self._selector.select(timeout=0.5):
                sock = key.fileobj
                if sock is self._sock:
                    with contextlib.suppress(OSError):
                        conn, _ = self._sock.accept()
                        conn.setblocking(False)
                        self._selector.register(conn, selectors.EVENT_READ)
                else:  # a peer closed its end (it re-watches each round, or it died)
                    self._selector.unregister(sock)
                    sock.close()  # type: ignore[union-attr]

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
                sock.setblocking(False)  # lost() only peeks
                self._socks[node] = sock
            except ConnectionRefusedError:
                self._lost.add(node)  # nothing listens there: its agent is gone
            except OSError:
                pass  # unreachable or slow: unknown, the heartbeat expiry decides

    def lost(self) -> set[Any]:
        """Peers whose connection was closed or reset (read without blocking)."""
        for node, sock in list(self._socks.items()):
            try:
                data: bytes | None = sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError, TimeoutError):
                continue  # open, nothing to read: alive
            except OSError:
                data = None  # reset
            if data == BYE:
                self._left.add(node)
            else:  # EOF or reset without a goodbye: the process is gone
                self._lost.add(node)
            sock.close()
            del self._socks[node]
        return set(self._lost)

    def left(self) -> set[Any]:
        """Peers that said goodbye (done or preempted): gone, but not lost. Call after
        ``lost()``, which reads the connections."""
        return set(self._left)

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

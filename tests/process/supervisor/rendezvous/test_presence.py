"""Presence: a dead peer's closed connection is seen at once; a slow or frozen one is not lost."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from elastic_trainer.supervisor.rendezvous import presence
from elastic_trainer.supervisor.rendezvous.presence import PeerWatch, PresenceServer

PEER = (
    "import time\n"
    "from elastic_trainer.supervisor.rendezvous.presence import PresenceServer\n"
    "server = PresenceServer('127.0.0.1')\n"
    "print(server.port, flush=True)\n"
    "time.sleep(120)\n"
)


@pytest.fixture
def peer():
    """A peer agent's presence port, in a process of its own (so it can die or freeze)."""
    proc = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())  # type: ignore[union-attr]
    yield proc, port
    proc.kill()
    proc.wait(10)


def lost_within(watch: PeerWatch, bound_s: float) -> set:
    """Poll until something is lost; a generous did-not-hang bound, not a timing target."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if lost := watch.lost():
            return lost
        time.sleep(0.01)
    return set()


def test_a_killed_peer_is_lost_at_once(peer) -> None:
    proc, port = peer
    watch = PeerWatch()
    watch.watch({"b": ("127.0.0.1", port)})
    assert watch.lost() == set()
    proc.send_signal(signal.SIGKILL)
    assert lost_within(watch, 10.0) == {"b"}


def test_a_frozen_peer_is_not_lost(peer) -> None:
    """SIGSTOP: the process lives, its kernel keeps the connection: heartbeats decide."""
    proc, port = peer
    watch = PeerWatch()
    watch.watch({"b": ("127.0.0.1", port)})
    proc.send_signal(signal.SIGSTOP)
    status = psutil.Process(proc.pid)
    deadline = time.monotonic() + 10
    while status.status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
        time.sleep(0.01)
    assert status.status() == psutil.STATUS_STOPPED
    assert all(watch.lost() == set() for _ in range(20))
    proc.send_signal(signal.SIGCONT)


def test_a_peer_that_leaves_on_purpose_is_not_lost() -> None:
    server = PresenceServer("127.0.0.1")
    watch = PeerWatch()
    watch.watch({"b": ("127.0.0.1", server.port)})
    server.close()  # says goodbye first
    deadline = time.monotonic() + 10
    while watch.watching() and time.monotonic() < deadline:
        assert watch.lost() == set()
        time.sleep(0.01)
    assert not watch.watching() and watch.lost() == set()
    assert watch.left() == {"b"}  # gone all the same: the next round does not wait for it


def test_nothing_listening_is_lost_and_an_unknown_peer_is_not() -> None:
    with socket.socket() as s:  # a closed loopback port: bound, never listening
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
        watch = PeerWatch()
        watch.watch({"gone": ("127.0.0.1", closed_port)})
    assert watch.lost() == {"gone"}


@pytest.mark.parametrize(
    ("local_addr", "rdzv_host", "bind"),
    [
        (None, "127.0.0.1", "127.0.0.1"),
        (None, "localhost", "127.0.0.1"),
        ("10.1.2.3", "127.0.0.1", "10.1.2.3"),
        (None, "trainer-0.cluster", "0.0.0.0"),
    ],
)
def test_where_to_listen(local_addr, rdzv_host, bind) -> None:
    assert presence.bind_host(local_addr, rdzv_host) == bind


@pytest.mark.parametrize(("host", "text"), [("127.0.0.1", "127.0.0.1:80"), ("::1", "[::1]:80")])
def test_addresses_round_trip(host, text) -> None:
    assert presence.format_address(host, 80) == text
    assert presence.parse_address(text) == (host, 80)


def turned_away(sock: socket.socket) -> bool:
    """The server said REFUSED and closed (the 5 s timeout is a did-not-hang bound)."""
    sock.settimeout(5)
    return sock.recv(1) == presence.REFUSED and sock.recv(1) == b""


def test_a_connection_without_hello_is_dropped_and_a_real_peer_is_kept() -> None:
    server = PresenceServer("127.0.0.1", handshake_timeout_s=0.2)
    watch = PeerWatch()
    try:
        watch.watch({"b": ("127.0.0.1", server.port)})  # first: its deadline passes first
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(5)]
        junk = socket.create_connection(("127.0.0.1", server.port))
        junk.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert all(turned_away(sock) for sock in [*idle, junk])
        assert (server.timed_out, server.refused) == (5, 1)
        assert watch.lost() == set() and watch.watching() == {"b"}
    finally:
        for sock in [*idle, junk]:
            sock.close()
        server.close()
        watch.close()


@pytest.mark.parametrize("caps", [{"max_per_peer": 3}, {"max_connections": 3}])
def test_connections_over_a_cap_are_refused_and_their_peer_is_not_lost(caps) -> None:
    server = PresenceServer("127.0.0.1", **caps)
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
    watch = PeerWatch()
    try:
        for sock in held:
            sock.sendall(presence.HELLO)
        extra = socket.create_connection(("127.0.0.1", server.port))
        assert turned_away(extra)
        watch.watch({"b": ("127.0.0.1", server.port)})
        deadline = time.monotonic() + 10
        while watch.watching() and time.monotonic() < deadline:
            assert watch.lost() == set()
            time.sleep(0.01)
        assert not watch.watching() and watch.lost() == set() and watch.left() == set()
        assert server.refused == 2
        for sock in held:  # still held: each reads nothing until the server says goodbye
            with pytest.raises(BlockingIOError):
                sock.recv(1, socket.MSG_DONTWAIT)
    finally:
        for sock in held:
            sock.close()
        server.close()
        watch.close()


def test_a_killed_peer_ends_the_supervisor_loops_wait(peer) -> None:
    """Its supervisor sees the loss when it happens, not at its next monitor tick."""
    from elastic_trainer.supervisor.processes.signals import StopRequest

    proc, port = peer
    watch = PeerWatch()
    watch.watch({"b": ("127.0.0.1", port)})
    fds = watch.fds()
    assert len(fds) == 1
    proc.send_signal(signal.SIGKILL)
    began = time.monotonic()
    assert StopRequest().wait_for_change(600.0, fds) is False
    assert time.monotonic() - began < 30  # did-not-hang bound: the wait is 600 s
    assert watch.lost() == {"b"} and watch.fds() == []

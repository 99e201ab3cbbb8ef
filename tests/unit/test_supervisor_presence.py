"""Presence: a dead peer's closed connection is seen at once; a slow or frozen one is not lost."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from elastic_trainer.supervisor import presence
from elastic_trainer.supervisor.presence import PeerWatch, PresenceServer

PEER = (
    "import time\n"
    "from elastic_trainer.supervisor.presence import PresenceServer\n"
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

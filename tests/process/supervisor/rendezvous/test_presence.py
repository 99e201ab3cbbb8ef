"""Presence: a dead peer's closed connection is seen at once; a slow or frozen one is not lost;
only members (who hold the job's secret) are held, however many others connect."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil
import pytest
from structlog.testing import capture_logs

from elastic_trainer.contract.auth import JobKey
from elastic_trainer.contract.endpoint import split_address
from elastic_trainer.supervisor.processes import fd_limit
from elastic_trainer.supervisor.rendezvous import presence
from elastic_trainer.supervisor.rendezvous.membership import MembershipWatch
from elastic_trainer.supervisor.rendezvous.presence import PeerWatch, PresenceServer
from tests.local_users import as_user

KEY = JobKey.generate()

# A peer agent's presence port in a process of its own (so it can die, freeze or run out of
# files). argv: the key in hex, the handshake timeout, the soft open-file limit to take on
# beyond the files it has open (0: its own). Each line on stdin asks for its figures.
PEER = """
import json, os, resource, sys
import structlog
from structlog.testing import LogCapture
from elastic_trainer.contract.auth import JobKey
from elastic_trainer.supervisor.rendezvous.presence import PresenceServer

capture = LogCapture()
structlog.configure(processors=[capture])
server = PresenceServer('127.0.0.1', JobKey(bytes.fromhex(sys.argv[1])),
                        handshake_timeout_s=float(sys.argv[2]))
if int(sys.argv[3]):
    spare = len(os.listdir('/proc/self/fd')) + int(sys.argv[3])
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (spare, hard))
print(server.port, flush=True)
for _ in sys.stdin:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({
        "held": server.held, "pending": server.pending, "timed_out": server.timed_out,
        "events": [e["event"] for e in capture.entries],
        "cpu_s": usage.ru_utime + usage.ru_stime,
    }), flush=True)
"""


class Peer:
    def __init__(self, handshake_timeout_s: float = 5.0, spare_files: int = 0) -> None:
        argv = [KEY.secret.hex(), str(handshake_timeout_s), str(spare_files)]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PEER, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.port = int(self.proc.stdout.readline())  # type: ignore[union-attr]

    def figures(self) -> dict[str, Any]:
        self.proc.stdin.write("?\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]


@pytest.fixture
def peer() -> Iterator[Peer]:
    running = Peer()
    yield running
    running.proc.kill()
    running.proc.wait(10)


def member(name: str = "a", key: JobKey = KEY) -> PeerWatch:
    return PeerWatch(key, name)


def wait_until(predicate: Callable[[], Any], bound_s: float, what: str) -> Any:
    """Poll ``predicate`` until true; ``bound_s`` is a did-not-hang bound, not a timing."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.01)
    raise AssertionError(f"not within {bound_s} s: {what}")


def held(watch: PeerWatch, figure: Callable[[], int], count: int = 1) -> None:
    """Wait until the server holds ``count`` members, ``watch`` answering a late challenge
    meanwhile (as the supervisor's loop does, woken by its ``fds``)."""
    wait_until(lambda: not watch.lost() and figure() == count, 10, f"{count} held")


def lost_within(watch: PeerWatch, bound_s: float) -> set:
    return wait_until(watch.lost, bound_s, "a peer lost")


def test_a_killed_peer_is_lost_at_once(peer) -> None:
    watch = member()
    watch.watch({"b": ("127.0.0.1", peer.port)})
    assert watch.lost() == set()
    peer.proc.send_signal(signal.SIGKILL)
    assert lost_within(watch, 10.0) == {"b"}


def test_a_frozen_peer_is_not_lost(peer) -> None:
    """SIGSTOP: the process lives, its kernel keeps the connection: heartbeats decide."""
    watch = member()
    watch.watch({"b": ("127.0.0.1", peer.port)})
    peer.proc.send_signal(signal.SIGSTOP)
    status = psutil.Process(peer.proc.pid)
    wait_until(lambda: status.status() == psutil.STATUS_STOPPED, 10, "the peer stopped")
    assert all(watch.lost() == set() for _ in range(20))
    peer.proc.send_signal(signal.SIGCONT)


def test_a_peer_frozen_when_watched_is_answered_once_it_wakes(peer) -> None:
    """Its challenge comes late: the watch goes on without it, wakes on it (``fds``) and
    answers it from ``lost()``; the peer then holds the connection."""
    peer.proc.send_signal(signal.SIGSTOP)
    status = psutil.Process(peer.proc.pid)
    wait_until(lambda: status.status() == psutil.STATUS_STOPPED, 10, "the peer stopped")
    watch = member()
    watch.watch({"b": ("127.0.0.1", peer.port)})  # returns without the challenge
    assert watch.watching() == {"b"} and watch.lost() == set()
    peer.proc.send_signal(signal.SIGCONT)
    assert select.select(watch.fds(), [], [], 10)[0], "the challenge arrived"
    assert watch.lost() == set()  # answered here
    held(watch, lambda: peer.figures()["held"])
    peer.proc.send_signal(signal.SIGKILL)
    assert lost_within(watch, 10.0) == {"b"}


def test_a_peer_that_leaves_on_purpose_is_not_lost() -> None:
    server = PresenceServer("127.0.0.1", KEY)
    watch = member()
    watch.watch({"b": ("127.0.0.1", server.port)})
    server.close()  # says goodbye first
    deadline = time.monotonic() + 10
    while watch.watching() and time.monotonic() < deadline:
        assert watch.lost() == set()
        time.sleep(0.01)
    assert not watch.watching() and watch.lost() == set()
    assert watch.left() == {"b"}  # gone all the same: the next round does not wait for it


def test_a_straggler_s_goodbye_says_why_it_leaves() -> None:
    slow, preempted = PresenceServer("127.0.0.1", KEY), PresenceServer("127.0.0.1", KEY)
    watch = member()
    watch.watch({"slow": ("127.0.0.1", slow.port), "preempted": ("127.0.0.1", preempted.port)})
    held(watch, lambda: slow.held + preempted.held, count=2)  # a goodbye goes to members
    slow.say_goodbye(presence.BYE_STRAGGLER)
    preempted.say_goodbye()
    deadline = time.monotonic() + 10
    while watch.watching() and time.monotonic() < deadline:
        assert watch.lost() == set()
        time.sleep(0.01)
    assert watch.left() == {"slow", "preempted"} and watch.lost() == set()
    assert watch.left_as_stragglers() == {"slow"}
    slow.close()
    preempted.close()
    with pytest.raises(ValueError, match="not a goodbye"):
        slow.say_goodbye(b"x")


def test_peers_ending_in_one_check_are_told_apart_and_a_new_watch_sees_its_own() -> None:
    """``lost()`` reads only the connections the kernel reports readable: a loss and a
    goodbye that arrive together are each named, the quiet peers are left alone, and a
    peer watched later (whose connection may take a freed descriptor) is seen in turn."""
    quiet, leaving = PresenceServer("127.0.0.1", KEY), PresenceServer("127.0.0.1", KEY)
    first, second = Peer(), Peer()
    try:
        watch = member()
        watch.watch(
            {
                "quiet": ("127.0.0.1", quiet.port),
                "leaving": ("127.0.0.1", leaving.port),
                "killed": ("127.0.0.1", first.port),
            }
        )
        held(watch, lambda: quiet.held + leaving.held + first.figures()["held"], count=3)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        leaving.close()  # says goodbye
        wait_until(lambda: watch.lost() and watch.watching() == {"quiet"}, 10, "both ended")
        assert watch.lost() == {"killed"} and watch.left() == {"leaving"}
        watch.watch({"quiet": ("127.0.0.1", quiet.port), "new": ("127.0.0.1", second.port)})
        assert watch.watching() == {"quiet", "new"} and watch.lost() == set()
        second.proc.send_signal(signal.SIGKILL)
        assert lost_within(watch, 10.0) == {"new"}
        assert watch.watching() == {"quiet"} and quiet.held == 1
    finally:
        for peer in (first, second):
            peer.proc.kill()
            peer.proc.wait(10)
        quiet.close()


class Publishing:
    """The rendezvous handler as ``MembershipWatch.open_presence`` uses it: it publishes."""

    this_node = type("Node", (), {"addr": "127.0.0.1", "pid": 1, "local_id": 0})()
    address = ""

    def publish_presence(self, address: str) -> None:
        self.address = address


def test_a_port_holds_every_member_of_a_job_larger_than_512_nodes() -> None:
    """A port held at most 512 members whatever the job's size: in a job of more than 513
    nodes every agent turned some peers away, which then could prove neither that agent's
    death nor, were it the store's host, the store's (no failover)."""
    fd_limit.raise_soft_limit()  # 2 x 599 connections in this process
    nodes = 600
    handler = Publishing()
    membership = MembershipWatch(
        handler, endpoint="127.0.0.1:1", check_every_s=1.0, dead_after_s=3.0
    )
    membership.open_presence("127.0.0.1", KEY, max_nodes=nodes)
    peers = member()
    try:
        address = split_address(handler.address)
        peers.watch({f"n{i}": address for i in range(nodes - 1)})
        server = membership._server  # what the port holds; no public view of its own
        held(peers, lambda: server.held, count=nodes - 1)
        assert server.refused == 0 and len(peers.watching()) == nodes - 1
    finally:
        peers.close()
        membership.close()


def test_a_burst_of_more_members_than_128_dialing_at_once_is_held() -> None:
    """After a round every peer dials every other at once and answers a challenge only
    between its own dials: with a fixed 128 pending places the 129th dial pushed out a
    member that had not answered yet, which then went unwatched."""
    nodes = 300
    handler = Publishing()
    membership = MembershipWatch(
        handler, endpoint="127.0.0.1:1", check_every_s=1.0, dead_after_s=3.0
    )
    membership.open_presence("127.0.0.1", KEY, max_nodes=nodes)
    server = membership._server  # what the port holds; no public view of its own
    dials = [socket.create_connection(split_address(handler.address)) for _ in range(nodes)]
    try:
        wait_until(lambda: server.accepted == nodes, 10, "every dial accepted")
        for i, sock in enumerate(dials):  # every one answers only now
            nonce = presence.read_challenge(sock.recv(presence.CHALLENGE_LEN, socket.MSG_WAITALL))
            sock.sendall(presence.hello(KEY, nonce, f"127.0.0.1:{i}"))
        wait_until(lambda: server.held == nodes, 10, f"{nodes} held")
        assert server.evicted == 0 and server.refused == 0
    finally:
        for sock in dials:
            sock.close()
        membership.close()


@pytest.mark.parametrize(("max_nodes", "pending"), [(1, 128), (128, 128), (300, 300)])
def test_the_pending_cap_grows_with_the_job(max_nodes, pending) -> None:
    assert presence.pending_cap(max_nodes) == pending


@pytest.mark.parametrize(("max_nodes", "cap"), [(1, 512), (256, 512), (600, 1200), (2048, 4096)])
def test_the_member_cap_grows_with_the_job(max_nodes, cap) -> None:
    assert presence.member_cap(max_nodes) == cap


def test_a_file_limit_below_what_the_job_may_need_is_said_once_with_the_fix(monkeypatch) -> None:
    limits = {"now": (2_000, 2_000)}
    monkeypatch.setattr(fd_limit.resource, "getrlimit", lambda _: limits["now"])
    with capture_logs() as logs:
        assert fd_limit.check_for_nodes(4)  # 5 x 4 + 256 files
        assert not fd_limit.check_for_nodes(2048)
    (event,) = [e for e in logs if e["event"] == "resources.fd_limit_low"]
    assert event["log_level"] == "warning"
    assert (event["limit"], event["needed"], event["max_nodes"]) == (2_000, 10_496, 2048)
    assert "ulimit -Hn" in event["consequence"] and "10496" in event["consequence"]


def test_nothing_listening_is_lost_and_an_unknown_peer_is_not() -> None:
    with socket.socket() as s:  # a closed loopback port: bound, never listening
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
        watch = member()
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


def turned_away(sock: socket.socket) -> bool:
    """The server challenged, then said REFUSED and closed (the 10 s timeout is a
    did-not-hang bound)."""
    sock.settimeout(10)
    got = b""
    while chunk := sock.recv(4096):
        got += chunk
    return got.startswith(presence.VERSION) and got.endswith(presence.REFUSED)


def dial(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port))


@pytest.fixture
def server() -> Iterator[PresenceServer]:
    running = PresenceServer("127.0.0.1", KEY, handshake_timeout_s=0.5)
    yield running
    running.close()


def test_a_member_with_the_key_is_held(server) -> None:
    watch = member()
    watch.watch({"b": ("127.0.0.1", server.port)})
    held(watch, lambda: server.held)
    assert (server.refused, server.timed_out) == (0, 0)
    assert watch.watching() == {"b"} and watch.lost() == set()
    watch.close()


def _local_ports(watch: PeerWatch) -> set[int]:
    """The local ports of ``watch``'s connections: a new connection has a new one."""
    ports = set()
    for fd in watch.fds():
        with socket.socket(fileno=os.dup(fd)) as sock:
            ports.add(sock.getsockname()[1])
    return ports


def test_a_member_of_the_next_round_too_keeps_its_connection(server) -> None:
    """Every member connecting to every other after each round: N² connections and
    handshakes per re-form. A peer watched again at the same address keeps its own."""
    watch = member()
    watch.watch({"b": ("127.0.0.1", server.port)})
    held(watch, lambda: server.held)
    before = _local_ports(watch)
    watch.watch({"b": ("127.0.0.1", server.port)})
    assert _local_ports(watch) == before and server.held == 1
    other = PresenceServer("127.0.0.1", KEY)
    watch.watch({"b": ("127.0.0.1", other.port)})  # another address: another connection
    held(watch, lambda: other.held)
    assert _local_ports(watch).isdisjoint(before)
    watch.watch({})
    assert watch.watching() == set()
    wait_until(lambda: server.held == 0 and other.held == 0, 10, "both closed")
    other.close()
    watch.close()


def test_a_goodbye_from_the_last_round_is_not_carried_into_the_next(server) -> None:
    """A straggler said goodbye and is a member of the next round again (it rejoined after
    its cool-down) before our watch read the goodbye: it is watched, not gone."""
    watch = member()
    watch.watch({"b": ("127.0.0.1", server.port)})
    held(watch, lambda: server.held)
    server.say_goodbye(presence.BYE_STRAGGLER)
    assert select.select(watch.fds(), [], [], 10)[0], "the goodbye arrived"
    watch.watch({"b": ("127.0.0.1", server.port)})
    assert watch.watching() == {"b"}
    held(watch, lambda: server.held)  # the new connection, answered
    assert watch.lost() == set() and watch.left() == set() and watch.watching() == {"b"}
    watch.close()


def test_a_peer_gone_between_two_rounds_is_lost_in_the_next(peer) -> None:
    watch = member()
    watch.watch({"b": ("127.0.0.1", peer.port)})
    held(watch, lambda: peer.figures()["held"])
    peer.proc.send_signal(signal.SIGKILL)
    peer.proc.wait(10)
    watch.watch({"b": ("127.0.0.1", peer.port)})  # the round formed before it was seen gone
    assert lost_within(watch, 10.0) == {"b"}


def test_a_wrong_key_is_refused_and_its_peer_is_unknown(server) -> None:
    watch = member(key=JobKey.generate())
    watch.watch({"b": ("127.0.0.1", server.port)})
    wait_until(lambda: not watch.lost() and not watch.watching(), 10, "turned away")
    assert watch.left() == set()  # unknown, not lost: the heartbeat expiry decides
    assert (server.refused, server.held) == (1, 0)


def test_a_connection_without_an_answer_is_closed_at_the_deadline_and_a_member_kept(
    server,
) -> None:
    watch = member()
    idle: list[socket.socket] = []
    try:
        watch.watch({"b": ("127.0.0.1", server.port)})
        idle = [dial(server.port) for _ in range(5)]
        junk = dial(server.port)
        junk.sendall(b"GET / HTTP/1.0\r\n\r\n")
        idle.append(junk)
        assert all(turned_away(sock) for sock in idle)
        assert (server.timed_out, server.refused, server.held) == (5, 1, 1)
        assert watch.lost() == set() and watch.watching() == {"b"}
    finally:
        for sock in idle:
            sock.close()
        watch.close()


@pytest.fixture
def unanswering() -> Iterator[list[tuple[str, int]]]:
    """Four ports whose connects time out: listeners with a full backlog drop new SYNs."""
    listeners, fillers = [], []
    for _ in range(4):
        listener = socket.create_server(("127.0.0.1", 0), backlog=0)
        fillers.append(socket.create_connection(listener.getsockname(), timeout=5))  # the one
        listeners.append(listener)
    yield [s.getsockname() for s in listeners]
    for sock in [*listeners, *fillers]:
        sock.close()


def test_a_member_answers_without_waiting_for_slow_connects_to_others(
    monkeypatch, unanswering
) -> None:
    """Peers are connected one by one, each connect bounded (here 0.5 s): a challenge is
    answered before the next connect, not once all are done (2 s here, past the deadline)."""
    monkeypatch.setattr(presence, "CONNECT_TIMEOUT_S", 0.5)
    server = PresenceServer("127.0.0.1", KEY, handshake_timeout_s=1.2)
    watch = member()
    try:
        peers = {"b": ("127.0.0.1", server.port)}
        peers.update({f"slow{n}": address for n, address in enumerate(unanswering)})
        watch.watch(peers)
        held(watch, lambda: server.held)
        assert server.refused == server.timed_out == 0 and watch.watching() == {"b"}
    finally:
        server.close()
        watch.close()


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_whose_connect_timed_out_is_dialed_again_and_found_lost_once_it_is_gone(
    monkeypatch,
) -> None:
    """A dial that times out proves nothing, but the peer was left unwatched for the rest of
    the round: its death was then found by heartbeat only, and a store host's not at all.
    It is dialed again, and a port that no longer listens is a lost peer."""
    monkeypatch.setattr(presence, "CONNECT_TIMEOUT_S", 0.3)
    monkeypatch.setattr(presence, "RETRY_FIRST_S", 0.05)
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    filler = socket.create_connection(listener.getsockname(), timeout=5)  # the queue is full
    watch = member()
    try:
        watch.watch({"x": listener.getsockname()})
        wait_until(lambda: not watch.fds(), 10, "the connect given up")
        assert watch.lost() == set() and watch.watching() == set()
        listener.close()  # its agent is gone: nothing listens there any more
        assert lost_within(watch, 10.0) == {"x"}
    finally:
        filler.close()
        listener.close()
        watch.close()


def test_a_member_turned_away_by_a_full_port_is_held_once_a_place_is_free(monkeypatch) -> None:
    monkeypatch.setattr(presence, "RETRY_FIRST_S", 0.05)
    server = PresenceServer("127.0.0.1", KEY, max_connections=1)
    first, second = member("first"), member("second")
    try:
        first.watch({"b": ("127.0.0.1", server.port)})
        held(first, lambda: server.held)
        second.watch({"b": ("127.0.0.1", server.port)})
        wait_until(lambda: server.refused >= 1, 10, "the second turned away")
        first.close()  # a place is free once the server reads the close
        wait_until(
            lambda: not second.lost() and second.watching() == {"b"} and server.held == 1,
            10,
            "the second held",
        )
        server.close()  # says goodbye: the second, watching it now, knows it left
        wait_until(lambda: not second.lost() and second.left() == {"b"}, 10, "the goodbye")
    finally:
        server.close()
        for watch in (first, second):
            watch.close()


def test_a_peer_not_held_is_dialed_again_after_waits_that_double_up_to_a_bound(
    unanswering,
) -> None:
    clock = Clock()
    watch = PeerWatch(KEY, "a", clock=clock)
    try:
        watch.watch({"x": unanswering[0]})  # the wait for answers ends on the real clock
        dials = []
        for _ in range(9):
            assert len(watch.fds()) == 1  # dialed, the connect under way
            clock.now += presence.CONNECT_TIMEOUT_S
            watch.lost()
            assert watch.fds() == []  # given up
            began = clock.now
            while not watch.fds():
                clock.now += 0.25
                watch.lost()
            dials.append(clock.now - began)
        assert dials == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0]
        watch.watch({})  # no longer a member: not dialed again
        clock.now += 60
        assert watch.lost() == set() and watch.fds() == []
    finally:
        watch.close()


def test_a_flood_from_the_members_own_address_never_keeps_it_out() -> None:
    """Every local process shares 127.0.0.1: a cap per address was used up by 8 connections
    of another user. Pending connections are capped apart, the oldest pushed out first."""
    server = PresenceServer("127.0.0.1", KEY, max_pending=8)
    flood = [dial(server.port) for _ in range(100)]
    watch = member()
    try:
        wait_until(lambda: server.accepted == 100, 10, "the flood accepted")
        assert server.pending == 8 and server.evicted == 92
        watch.watch({"b": ("127.0.0.1", server.port)})
        held(watch, lambda: server.held)
        assert watch.watching() == {"b"} and watch.lost() == set()
        assert all(turned_away(sock) for sock in flood[:90])  # pushed out, or turned away
    finally:
        for sock in flood:
            sock.close()
        server.close()
        watch.close()


def test_members_over_the_cap_are_refused_and_unknown() -> None:
    server = PresenceServer("127.0.0.1", KEY, max_connections=3)
    watches = [member(str(n)) for n in range(4)]
    try:
        for watch in watches[:3]:
            watch.watch({"b": ("127.0.0.1", server.port)})
        wait_until(
            lambda: [w.lost() for w in watches[:3]] == [set()] * 3 and server.held == 3,
            10,
            "three members held",
        )
        extra = watches[3]
        extra.watch({"b": ("127.0.0.1", server.port)})
        wait_until(lambda: not extra.lost() and not extra.watching(), 10, "the fourth refused")
        assert extra.lost() == set() and extra.left() == set() and server.refused == 1
        assert server.held == 3
        assert all(w.watching() == {"b"} and w.lost() == set() for w in watches[:3])
    finally:
        server.close()
        for watch in watches:
            watch.close()


# Another local user (``nobody``) holds 20 connections to the port until the server closes
# them; it prints how many it opened and how many the server closed.
HOLD = """
import json, socket
port = {port}
held = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
closed = 0
for sock in held:
    sock.settimeout(30)
    try:
        while sock.recv(4096):
            pass
        closed += 1
    except OSError:
        pass
print(json.dumps({{"opened": len(held), "closed": closed}}))
"""


def test_connections_another_user_holds_never_keep_a_member_out(other) -> None:
    server = PresenceServer("127.0.0.1", KEY, handshake_timeout_s=3.0)
    watch = member()
    try:
        with ThreadPoolExecutor(1) as pool:
            holding = pool.submit(as_user, other, HOLD.format(port=server.port))
            wait_until(lambda: server.accepted >= 20 or holding.done(), 60, "20 connections")
            assert not holding.done(), holding.result()  # a skip or a failure, raised here
            watch.watch({"b": ("127.0.0.1", server.port)})
            held(watch, lambda: server.held)
            assert watch.watching() == {"b"} and watch.lost() == set()
            done = holding.result()
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"opened": 20, "closed": 20}
        assert server.timed_out == 20 and server.held == 1
    finally:
        server.close()
        watch.close()


def test_a_port_out_of_files_says_so_once_and_lets_a_member_in_once_free() -> None:
    """accept() failing with EMFILE: it never leaves the server's thread nor spins on the
    still-readable listening socket; once files are free again a member gets in."""
    peer = Peer(handshake_timeout_s=30.0, spare_files=8)
    flood = [dial(peer.port) for _ in range(40)]  # into the backlog beyond the 8
    watch = member()
    try:
        wait_until(lambda: "resources.fd_exhausted" in peer.figures()["events"], 10, "EMFILE")
        before = peer.figures()["cpu_s"]
        time.sleep(1.0)  # a window to measure CPU over: a busy loop burns all of it
        after = peer.figures()
        assert after["cpu_s"] - before < 0.5, "the server spins on EMFILE"
        assert after["events"] == ["resources.fd_exhausted"] and after["pending"] < len(flood)
        for sock in flood:
            sock.close()
        watch.watch({"b": ("127.0.0.1", peer.port)})
        held(watch, lambda: peer.figures()["held"])
    finally:
        for sock in flood:
            sock.close()
        peer.proc.kill()
        peer.proc.wait(10)
        watch.close()


def test_a_killed_peer_ends_the_supervisor_loops_wait(peer) -> None:
    """Its supervisor sees the loss when it happens, not at its next monitor tick."""
    from elastic_trainer.supervisor.processes.signals import StopRequest

    watch = member()
    watch.watch({"b": ("127.0.0.1", peer.port)})
    fds = watch.fds()
    assert len(fds) == 1
    peer.proc.send_signal(signal.SIGKILL)
    began = time.monotonic()
    assert StopRequest().wait_for_change(600.0, fds) is False
    assert time.monotonic() - began < 30  # did-not-hang bound: the wait is 600 s
    assert watch.lost() == {"b"} and watch.fds() == []

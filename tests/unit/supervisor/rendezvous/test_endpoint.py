"""endpoint.py on loopback: bad input at once, a store not up yet retried, every wait bounded."""

from __future__ import annotations

import errno
import signal
import socket
import threading
import time

import pytest
from structlog.testing import capture_logs

from elastic_trainer import listeners
from elastic_trainer.supervisor.rendezvous import endpoint
from elastic_trainer.supervisor.rendezvous.endpoint import EndpointError, StoreUnreachable
from tests.e2e.workers.harness import not_a_store

pytestmark = pytest.mark.timeout(60)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(endpoint, "HANDSHAKE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(endpoint, "RETRY_MAX_WAIT_S", 0.5)
    monkeypatch.setattr(endpoint, "SILENT_LIMIT_S", 3.0)


@pytest.fixture
def silent_port():
    with not_a_store("silent") as (port, _):
        yield port


@pytest.fixture
def store_port():
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False
    )
    yield store.port
    del store


def test_a_name_that_cannot_resolve_is_bad_input():
    with pytest.raises(EndpointError, match="does not resolve"):
        endpoint.check("no-such-store.invalid", 29400, read_timeout_s=5)


def test_a_closed_port_passes_the_check_it_is_only_not_up_yet():
    endpoint.check("127.0.0.1", _closed_port(), read_timeout_s=5)


@pytest.mark.usefixtures("fast")
@pytest.mark.parametrize("kind", ["silent", "http"])
def test_a_listener_that_is_not_a_store_is_bad_input_within_a_bound(kind):
    began = time.monotonic()
    with not_a_store(kind) as (port, _), pytest.raises(EndpointError, match="not a c10d store"):
        endpoint.connect("127.0.0.1", port, deadline_s=30, read_timeout_s=5)
    assert time.monotonic() - began < 20  # did not hang (the bound is 1 s here)
    assert not [t for t in threading.enumerate() if t.name == "c10d-handshake"]


@pytest.mark.usefixtures("fast")
def test_a_refused_port_is_retried_with_one_warning_until_the_deadline():
    with capture_logs() as logs, pytest.raises(StoreUnreachable, match="within 2s") as info:
        endpoint.connect("127.0.0.1", _closed_port(), deadline_s=2, read_timeout_s=5)
    assert info.value.exit_code == 1
    warnings = [e for e in logs if e["event"] == "store.unreachable"]
    assert len(warnings) == 1
    assert (warnings[0]["log_level"], warnings[0]["retrying"]) == ("warning", True)


def test_a_store_connects_and_answers(store_port):
    store = endpoint.connect("127.0.0.1", store_port, deadline_s=10, read_timeout_s=5)
    store.set("k", "v")
    assert store.get("k") == b"v"


@pytest.mark.usefixtures("fast")
def test_a_store_too_busy_to_accept_at_once_is_waited_for_not_bad_input(store_port, monkeypatch):
    """Regression: at 32 nodes on one machine the survivors of a store host's loss all dialled
    the failed-over store at once; some clients' connects timed out after torch's 1 s, and
    those survivors exited 2 with "answers but is not a c10d store"."""
    from torch.distributed import DistNetworkError

    real, calls = endpoint._client, []

    def busy_then_up(host: str, port: int, *, read_timeout_s: float):
        calls.append(port)
        if len(calls) < 3:
            raise DistNetworkError(
                f"The client socket has timed out after 1000ms while trying to connect to "
                f"({host}, {port})."
            )
        return real(host, port, read_timeout_s=read_timeout_s)

    monkeypatch.setattr(endpoint, "_client", busy_then_up)
    with capture_logs():
        store = endpoint.connect("127.0.0.1", store_port, deadline_s=30, read_timeout_s=5)
    assert store.check(["nothing"]) is False and len(calls) == 3
    monkeypatch.setattr(endpoint, "_client", busy_then_up)
    calls.clear()
    assert endpoint.try_once("127.0.0.1", store_port, 5) is None  # not up for us: try again


@pytest.mark.usefixtures("fast")
def test_the_jobs_own_store_that_does_not_answer_in_time_is_tried_again(silent_port):
    """Regression: at 32 nodes on one machine the failed-over store answered some survivors'
    handshakes after the bound, and they exited 2 ("not a c10d store"). A store a member of
    the job serves is tried again until the failover's deadline (which trusts only a store
    that proves it is the job's); a user's endpoint that does not answer stays bad input."""
    assert endpoint.try_once("127.0.0.1", silent_port, 5) is None  # one attempt proves nothing
    assert endpoint.try_job_store("127.0.0.1", silent_port, 5) is None
    assert endpoint.try_job_store("127.0.0.1", _closed_port(), 5) is None


@pytest.mark.usefixtures("fast")
def test_a_store_that_answers_its_handshake_late_is_waited_for_not_bad_input(
    store_port, monkeypatch
):
    """Regression: 128 agents dialling one store on a loaded 2-core machine; a fifth of them
    had no handshake answer within the bound and exited 2 ("not a c10d store"). Unanswered
    handshakes are tried again for ``SILENT_LIMIT_S``; only a listener silent that long is
    bad input (test_a_listener_that_is_not_a_store_is_bad_input_within_a_bound)."""
    real, calls = endpoint.handshake, []

    def late(host: str, port: int, *, read_timeout_s: float):
        calls.append(port)
        if len(calls) < 3:
            raise endpoint._Silent("no c10d handshake answer within 1s")
        return real(host, port, read_timeout_s=read_timeout_s)

    monkeypatch.setattr(endpoint, "handshake", late)
    with capture_logs():
        store = endpoint.connect("127.0.0.1", store_port, deadline_s=30, read_timeout_s=5)
    assert store.check(["nothing"]) is False and len(calls) == 3


def test_hosting_on_a_taken_port_is_bad_input_only_when_asked_to_host(store_port):
    with pytest.raises(EndpointError, match="cannot host"):
        endpoint.open_store(
            "127.0.0.1", store_port, serve=True, explicit=True, deadline_s=5, read_timeout_s=5
        )
    # inferred: another agent on this machine hosts it -> become its client
    store = endpoint.open_store(
        "127.0.0.1", store_port, serve=True, explicit=False, deadline_s=5, read_timeout_s=5
    )
    assert store.check(["nothing"]) is False


def test_a_stop_signal_ends_a_blocked_handshake(silent_port):
    class Stop(BaseException):
        pass

    def handler(signum, frame):
        raise Stop  # what signals.StopRequest.handler does while interruptible

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    began = time.monotonic()
    try:
        with pytest.raises(Stop):
            endpoint.handshake("127.0.0.1", silent_port, read_timeout_s=5)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - began < endpoint.HANDSHAKE_TIMEOUT_S  # not the full bound
    # the C++ client blocked in its read was released: no thread left behind
    assert not [t for t in threading.enumerate() if t.name == "c10d-handshake"]


def test_store_connections_get_a_silence_limit() -> None:
    """A partition sends no reset: without a limit a blocked store call waits for TCP's
    ~15 minute retransmission timeout (found on a real namespaced network)."""
    import socket as socket_module

    from elastic_trainer.supervisor.rendezvous.endpoint import bound_silent_connections

    if not hasattr(socket_module, "TCP_USER_TIMEOUT"):
        pytest.skip("TCP_USER_TIMEOUT is Linux-only")
    with socket_module.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket_module.create_connection(("127.0.0.1", port)) as client:
            assert bound_silent_connections("127.0.0.1", port, timeout_s=9.0) == 1
            level, name = socket_module.IPPROTO_TCP, socket_module.TCP_USER_TIMEOUT
            assert client.getsockopt(level, name) == 9000
            keepalive = client.getsockopt(socket_module.SOL_SOCKET, socket_module.SO_KEEPALIVE)
            assert keepalive == 1


def _listening_addresses(port: int) -> set[str]:
    import psutil

    return {
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def test_the_hosted_store_listens_on_the_endpoints_address_only():
    port = _closed_port()
    with capture_logs() as logs:
        store = endpoint.open_store(
            "127.0.0.1", port, serve=True, explicit=True, deadline_s=5, read_timeout_s=5
        )
    assert _listening_addresses(port) == {"127.0.0.1"}  # not every interface
    assert "store.exposed" not in [e["event"] for e in logs]  # loopback stays quiet
    client = endpoint.connect("127.0.0.1", port, deadline_s=5, read_timeout_s=5)
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_an_endpoint_address_not_on_this_machine_is_hosted_everywhere_and_said_so(monkeypatch):
    real = listeners.listen

    def not_here(host, port, **kwargs):  # a Service/NAT address: bind says EADDRNOTAVAIL
        if host:
            raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")
        return real(host, port, **kwargs)

    monkeypatch.setattr(listeners, "listen", not_here)
    port = _closed_port()
    with capture_logs() as logs:
        store = endpoint.open_store(
            "127.0.0.1", port, serve=True, explicit=True, deadline_s=5, read_timeout_s=5
        )
    assert _listening_addresses(port) == {"0.0.0.0"}
    exposed = [e for e in logs if e["event"] == "store.exposed"]
    assert len(exposed) == 1 and exposed[0]["log_level"] == "warning"
    assert exposed[0]["port"] == port and "authentication" in exposed[0]["hint"]
    del store


def test_this_machines_name_resolved_to_loopback_is_hosted_everywhere(monkeypatch):
    real = socket.getaddrinfo

    def debian_hosts(host, *args, **kwargs):  # /etc/hosts: "127.0.1.1 node7"
        return real("127.0.1.1" if host == "node7" else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", debian_hosts)
    assert listeners.own_name_on_loopback("node7")
    assert not listeners.own_name_on_loopback("localhost")
    assert not listeners.own_name_on_loopback("127.0.0.1")
    port = _closed_port()
    store = endpoint.open_store(
        "node7", port, serve=True, explicit=True, deadline_s=5, read_timeout_s=5
    )
    assert _listening_addresses(port) == {"0.0.0.0"}  # the other nodes use its real address
    del store


def test_the_agent_that_claims_the_port_first_hosts_and_the_later_one_is_its_client():
    from elastic_trainer.supervisor.rendezvous import handler as rendezvous

    port = _closed_port()
    first = endpoint.claim_port("127.0.0.1", port)
    assert first is not None
    assert endpoint.claim_port("127.0.0.1", port) is None  # the later agent never hosts
    # until the first agent serves (its preflight runs), the port refuses: not up yet
    assert endpoint.try_once("127.0.0.1", port, read_timeout_s=5) is None
    opened = dict(serve=True, explicit=False, deadline_s=5, read_timeout_s=5)
    store, hosts = endpoint.open_store_hosted("127.0.0.1", port, claimed=first, **opened)
    client, client_hosts = endpoint.open_store_hosted("127.0.0.1", port, **opened)
    assert (hosts, client_hosts) == (True, False)
    assert rendezvous.store_host(client, "job") is None  # a standalone store: nobody named
    store.set(rendezvous.store_host_key("job"), "a")
    # c10d's set has no reply: a read on the same connection is what orders it before the
    # client's read on another one (CI once read None here)
    store.get(rendezvous.store_host_key("job"))
    assert rendezvous.store_host(client, "job") == "a"


@pytest.mark.usefixtures("fast")
def test_a_handshake_that_answers_as_it_is_cut_off_is_tried_again_not_handed_back(
    store_port, monkeypatch
):
    """Regression: a handshake past its bound is cut off (its connections shut down) while
    it may still complete; one that completed then was handed back with its socket shut, and
    its first operation failed with "Broken pipe" (38 of 256 agents on one machine exited
    1 so at their start, their handshakes slowed by 5 s reverse DNS lookups)."""
    real_client, real_abort = endpoint._client, endpoint._abort

    def slow(host: str, port: int, *, read_timeout_s: float):
        time.sleep(endpoint.HANDSHAKE_TIMEOUT_S + 0.2)
        return real_client(host, port, read_timeout_s=read_timeout_s)

    def abort_after_it_answered(thread: threading.Thread, host: str, port: int) -> None:
        thread.join()  # the worst order: it completed, then its connection is shut down
        real_abort(thread, host, port)
        endpoint.shut_down_connections(host, port)

    monkeypatch.setattr(endpoint, "_client", slow)
    monkeypatch.setattr(endpoint, "_abort", abort_after_it_answered)
    with pytest.raises(endpoint._Transient, match="cut off"):
        endpoint.handshake("127.0.0.1", store_port, read_timeout_s=5)
    monkeypatch.setattr(endpoint, "_client", real_client)
    store = endpoint.connect("127.0.0.1", store_port, deadline_s=30, read_timeout_s=5)
    assert store.check(["nothing"]) is False  # the next attempt's connection works


@pytest.fixture
def other_process_store_port():
    """A store hosted by another process: a master ``TCPStore`` is also a client of itself,
    a connection of this process to its port that a client of another node would not have."""
    import subprocess
    import sys

    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, torch.distributed as d; "
            "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
            "print(s.port, flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        yield int(host.stdout.readline())
    finally:
        host.kill()
        host.wait()


@pytest.mark.usefixtures("fast")
def test_a_client_slow_to_connect_is_the_machines_dns_not_a_silent_listener(
    other_process_store_port, monkeypatch
):
    """Regression: torch's client looks the store address's name up (reverse DNS) before it
    connects; with a resolver that dropped queries those lookups took 5-10 s, and 41 of 256
    agents on one machine exited 2 ("answers but is not a c10d store") although the store
    answered every connection it got. A client that had not connected when its handshake
    was cut off is a transient fault, tried again until the deadline."""
    real, calls = endpoint._client, []

    def lookup_stalls_twice(host: str, port: int, *, read_timeout_s: float):
        calls.append(port)
        if len(calls) <= 2:
            time.sleep(2 * endpoint.HANDSHAKE_TIMEOUT_S + 2)  # past the cut-off: no connection
        return real(host, port, read_timeout_s=read_timeout_s)

    monkeypatch.setattr(endpoint, "_client", lookup_stalls_twice)
    with pytest.raises(endpoint._Transient, match="had not sent") as caught:
        endpoint.handshake("127.0.0.1", other_process_store_port, read_timeout_s=5)
    assert not isinstance(caught.value, endpoint._Silent)

    def connects_then_stalls(host: str, port: int, *, read_timeout_s: float):
        with socket.create_connection((host, port)):  # connected, nothing sent yet
            time.sleep(2 * endpoint.HANDSHAKE_TIMEOUT_S + 2)

    monkeypatch.setattr(endpoint, "_client", connects_then_stalls)
    with pytest.raises(endpoint._Transient, match="had not sent") as caught:
        endpoint.handshake("127.0.0.1", other_process_store_port, read_timeout_s=5)
    assert not isinstance(caught.value, endpoint._Silent)
    monkeypatch.setattr(endpoint, "_client", lookup_stalls_twice)
    with capture_logs():
        store = endpoint.connect(
            "127.0.0.1", other_process_store_port, deadline_s=60, read_timeout_s=5
        )
    assert store.check(["nothing"]) is False and len(calls) == 3

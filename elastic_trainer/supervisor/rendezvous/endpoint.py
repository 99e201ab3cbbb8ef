"""Reaching the c10d rendezvous store: bad input fails at once, a store not up yet is waited for.

Three kinds of trouble, three answers:

- bad input (a host name that does not resolve, a port held by something that is not a c10d
  store): ``EndpointError``, a ``ConfigError``, exit 2 at once -- retrying cannot fix it; a
  listener that takes connections and never answers, after ``SILENT_LIMIT_S`` of that (a
  store starved of CPU answers late, not never);
- nothing listens yet, or the connect times out: transient. Nodes of one job boot in any
  order, so a node whose store host is not up yet waits, with backoff, up to the rendezvous
  join timeout, says so once (``store.unreachable``, ``retrying=True``), and only then gives
  up with ``StoreUnreachable`` (exit 1: systemd and Kubernetes restart it);
- a store that answers: the connected ``TCPStore``.

Every step is bounded. torch's ``TCPStore`` client blocks in C++ without a timeout while it
waits for the handshake's answer (torch 2.15: an HTTP server or a silent
listener keeps it there for good, and no signal handler runs meanwhile). So the TCP connect
is done in Python (interruptible), and the c10d handshake runs in a thread that the main
thread waits for interruptibly; past ``HANDSHAKE_TIMEOUT_S``, or on a stop signal, the
thread's socket is shut down, which ends its blocking read at once.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any

import psutil
import tenacity

from elastic_trainer.contract.endpoint import EndpointError, ResolverNotReady, resolve
from elastic_trainer.contract.events import emit
from elastic_trainer.errors import ElasticTrainError, first_line
from elastic_trainer.listeners import bound_listener, plain_address

# One handshake attempt: a c10d store answers in milliseconds.
HANDSHAKE_TIMEOUT_S = 5.0
# A store starved of CPU can leave handshakes unanswered for seconds (128 agents dialling one
# store on a loaded 2-core machine: a fifth of them had no answer within 5 s and exited 2 as if
# misconfigured), so an unanswered handshake is tried again; a listener that answers none of
# them for this long is not a store.
SILENT_LIMIT_S = 10.0
# One TCP connect attempt (a dropped SYN: the host or its firewall is not up yet).
CONNECT_TIMEOUT_S = 3.0
# How long torch's client keeps reconnecting on its own before it reports a failure.
CLIENT_RETRY_S = 1.0
# Backoff between attempts while the store is not up: 0.5 s, doubling, capped here.
RETRY_MAX_WAIT_S = 5.0
# How long a connection to a store on another host may stay silent (unacknowledged data, or
# idle keep-alive probes unanswered) before the kernel aborts it: a node cut off from its
# store notices within this, instead of TCP's ~15 minutes (``bound_silent_connections``).
STORE_SILENCE_LIMIT_S = 10.0
# A key nobody writes: the handshake's one real store operation only asks whether it exists.
_PROBE_KEY = "elastic-train/probe"


# No attempt starts past the deadline.
_STOP_BEFORE = tenacity.stop_before_delay


class StoreUnreachable(ElasticTrainError):
    """Nothing answered at the endpoint within the rendezvous join timeout."""

    exit_code = 1


class _Transient(Exception):
    """Nothing listens there (yet): worth another try."""


class _Silent(_Transient):
    """The listener took the connection but did not answer the handshake in time: a store too
    busy to, or a listener that is not one (``SILENT_LIMIT_S`` tells them apart)."""


def _resolve(host: str, port: int) -> None:
    try:
        resolve(host, port)
    except ResolverNotReady as exc:
        raise _Transient(str(exc)) from exc


def reach(host: str, port: int) -> None:
    """One TCP connect, in Python so that signals are handled meanwhile; ``_Transient`` if
    nothing answers."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise _Transient(exc.strerror or str(exc) or type(exc).__name__) from exc


def handshake(host: str, port: int, *, read_timeout_s: float) -> Any:
    """A c10d client: ``TCPStore`` plus one store operation, bounded by ``HANDSHAKE_TIMEOUT_S``.

    Returns the connected store (its operations time out after ``read_timeout_s``). Raises
    ``EndpointError`` when the listener there answers but not in c10d, ``_Silent`` when it
    does not answer in time, ``_Transient`` when it went away meanwhile.
    """
    import torch.distributed  # noqa: F401  # here, not in the thread: an import is no handshake

    outcome: dict[str, Any] = {}
    done = threading.Event()

    def attempt() -> None:
        try:
            outcome["store"] = _client(host, port, read_timeout_s=read_timeout_s)
        except Exception as exc:  # reported to the caller below
            outcome["error"] = exc
        finally:
            done.set()

    thread = threading.Thread(target=attempt, name="c10d-handshake", daemon=True)
    thread.start()
    spoke = 0
    try:
        done.wait(HANDSHAKE_TIMEOUT_S)  # a stop signal's handler raises out of this wait
    finally:
        if not done.is_set():
            outcome["aborted"] = True
            spoke = _abort(thread, host, port)
    if "store" in outcome and "aborted" not in outcome:
        return outcome["store"]
    if "store" in outcome:
        # it answered while being cut off: ``_abort`` may have shut its socket down after it
        # connected (handed back, its first operation failed with "Broken pipe": 38 of 256
        # agents on one machine exited so, their handshakes slowed by reverse DNS lookups)
        raise _Transient("the c10d handshake answered only as it was cut off")
    reach(host, port)
    if "aborted" in outcome and not spoke:
        # torch's client looks the address's name up (reverse DNS) before it connects: a
        # lookup that waits out the resolver's timeout (5 s) is this machine's DNS, not a
        # listener that does not answer, and must not end in "not a c10d store" (exit 2)
        raise _Transient(
            f"torch's c10d client had not sent its handshake within {HANDSHAKE_TIMEOUT_S:g}s "
            "(a slow reverse DNS lookup of the address?)"
        )  # refused now: the store went away while we talked to it (transient)
    if "error" in outcome and "aborted" not in outcome and _not_accepted(outcome["error"]):
        # a store too busy to accept us within the client's own retry time (a failed-over
        # store that every survivor dials at once): not up for us yet, not bad input
        raise _Transient(_first_line(outcome["error"]))
    if "error" not in outcome or "aborted" in outcome:
        raise _Silent(f"no c10d handshake answer within {HANDSHAKE_TIMEOUT_S:g}s")
    raise _not_a_store(host, port, f"its c10d handshake failed: {_first_line(outcome['error'])}")


def _not_a_store(host: str, port: int, reason: str) -> EndpointError:
    return EndpointError(
        f"--rdzv-endpoint={host}:{port} answers but is not a c10d store ({reason}): "
        "point it at the store host (elastic-train store) or free the port"
    )


def _not_accepted(error: BaseException) -> bool:
    """torch's client gave up connecting (``timed out ... while trying to connect``): the
    listener did not take the connection in time; one that is not a store fails after."""
    text = str(error)
    return isinstance(error, TimeoutError) or ("timed out" in text and "to connect" in text)


def _abort(thread: threading.Thread, host: str, port: int) -> int:
    """End a handshake stuck in C++: shut its socket down (the client may reconnect and block
    again within its own timeout, so repeat until the thread is done). Returns how many of
    its connections had sent the listener anything when it was cut off (0: it had not
    connected yet, or connected and not written: stuck in itself, not waiting for an answer)."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S + 1
    spoke = shut_down_connections(host, port, spoken_only=True)
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(0.05)
        shut_down_connections(host, port)
    return spoke


def _client(host: str, port: int, *, read_timeout_s: float) -> Any:
    from torch.distributed import TCPStore

    store = TCPStore(
        host,
        port,
        is_master=False,
        # bounds the client's own reconnect loop: after ``_abort`` cut its read, it retries
        # for this long (``reach`` just connected, so the first connect is immediate)
        timeout=timedelta(seconds=CLIENT_RETRY_S),
        wait_for_workers=False,
    )
    store.check([_PROBE_KEY])
    store.set_timeout(timedelta(seconds=read_timeout_s))
    return store


def shut_down_connections(host: str, port: int, *, spoken_only: bool = False) -> int:
    """Shut down this process's TCP connections to ``host:port``; how many (``spoken_only``:
    how many of them had sent anything, ``_has_sent``)."""
    targets = _addresses(host, port)
    count = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if (
            conn.raddr
            and conn.fd >= 0
            and (plain_address(conn.raddr.ip), conn.raddr.port) in targets
        ):
            with contextlib.suppress(OSError):
                # a duplicate of the fd: shutting it down shuts down the one socket behind both
                with socket.socket(fileno=os.dup(conn.fd)) as sock:
                    sent = _has_sent(sock)
                    sock.shutdown(socket.SHUT_RDWR)
                count += 1 if sent or not spoken_only else 0
    return count


# struct tcp_info (linux/tcp.h): 8 bytes of u8 fields and 24 u32 fields, then u64
# pacing_rate, max_pacing_rate and bytes_acked (the handshake's SYN counts as one byte).
_TCP_INFO_BYTES_ACKED = 120
_TCP_INFO_LEN = 232


def _has_sent(sock: socket.socket) -> bool:
    """Has this connection sent anything the peer acknowledged (True where the kernel does
    not say)?"""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        return bool(struct.unpack_from("=Q", info, _TCP_INFO_BYTES_ACKED)[0] > 1)
    except (AttributeError, OSError, struct.error):
        return True


def bound_silent_connections(host: str, port: int, *, timeout_s: float) -> int:
    """Bound how long our connections to the store may stay silent: ``TCP_USER_TIMEOUT``
    (data unacknowledged that long: the kernel aborts the connection) plus keep-alive probes
    (an idle one is checked too). A store cut off without a reset (a partition) then fails the
    blocked call with ETIMEDOUT within seconds instead of TCP's ~15 minute retransmission
    limit, and the calls blocked behind it (torch's heartbeat lock) return. Linux; a no-op
    elsewhere. Returns how many connections were bounded."""
    if not hasattr(socket, "TCP_USER_TIMEOUT"):
        return 0
    idle = max(1, int(timeout_s / 3))
    options = [
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(timeout_s * 1000)),
        (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle),
        (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, idle),
        (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3),
    ]
    targets = _addresses(host, port)
    count = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if (
            conn.raddr
            and conn.fd >= 0
            and (plain_address(conn.raddr.ip), conn.raddr.port) in targets
        ):
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(conn.fd)) as sock:
                for level, name, value in options:  # the dup shares the one socket's options
                    sock.setsockopt(level, name, value)
                count += 1
    return count


def _addresses(host: str, port: int) -> set[tuple[str, int]]:
    with contextlib.suppress(OSError):
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return {(plain_address(info[4][0]), port) for info in infos}
    return set()


def connect(host: str, port: int, *, deadline_s: float, read_timeout_s: float) -> Any:
    """The connected store, waiting up to ``deadline_s`` for it to come up (see module)."""
    warned = False

    def warn_once(state: tenacity.RetryCallState) -> None:
        nonlocal warned
        if not warned:
            warned = True
            emit(
                "store.unreachable",
                level="warning",
                endpoint=f"{host}:{port}",
                error=_first_line(state.outcome.exception() if state.outcome else None),
                consequence="waiting for the store host to come up",
                retrying=True,
                deadline_s=deadline_s,
            )

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(_Transient),
        stop=_STOP_BEFORE(deadline_s),
        wait=tenacity.wait_exponential_jitter(multiplier=0.5, max=RETRY_MAX_WAIT_S),
        before_sleep=warn_once,
        reraise=True,
    )
    silent_since: float | None = None

    def attempt() -> Any:
        nonlocal silent_since
        try:
            store = _attempt(host, port, read_timeout_s)
        except _Silent as exc:
            now = time.monotonic()
            silent_since = now if silent_since is None else silent_since
            if now - silent_since >= SILENT_LIMIT_S:
                raise _not_a_store(
                    host, port, f"no c10d handshake answer within {SILENT_LIMIT_S:g}s"
                ) from exc
            raise
        except _Transient:
            silent_since = None  # gone, not silent: a store starting or restarting
            raise
        return store

    try:
        return retrying(attempt)
    except _Transient as exc:
        raise StoreUnreachable(
            f"--rdzv-endpoint={host}:{port}: no store answered within {deadline_s:g}s "
            f"({exc}): start the store host, or check HOST:PORT and the firewall"
        ) from exc


def try_once(host: str, port: int, read_timeout_s: float) -> Any:
    """One bounded attempt: the connected store, or None when nothing answers (yet)."""
    try:
        return _attempt(host, port, read_timeout_s)
    except _Transient:
        return None


def try_job_store(host: str, port: int, read_timeout_s: float) -> Any:
    """One bounded attempt at a store that a member of this job serves (the failed-over
    store, the one the snapshot folder's signed record names): None while it is not up, and
    also where its handshake failed or was not answered in time. Every survivor of a store
    host's loss dials the new store at once, and at 32 nodes on one machine it answered some
    of them after ``HANDSHAKE_TIMEOUT_S``: those exited 2 ("not a c10d store"). The caller
    trusts only a store that proves it is the job's (its signed host record) and retries
    until its own deadline, so a listener that is not the job's ends there, not here."""
    try:
        return _attempt(host, port, read_timeout_s)
    except (_Transient, EndpointError):
        return None


def _attempt(host: str, port: int, read_timeout_s: float) -> Any:
    _resolve(host, port)
    reach(host, port)
    return handshake(host, port, read_timeout_s=read_timeout_s)


def open_store(
    host: str, port: int, *, serve: bool, explicit: bool, deadline_s: float, read_timeout_s: float
) -> Any:
    """Host the store here (``serve``) or connect to it (see ``connect``).

    A host that was only inferred from the address (``explicit`` False) falls back to being
    a client when the port is taken: several agents on one machine share one store.
    """
    return open_store_hosted(
        host, port, serve=serve, explicit=explicit, deadline_s=deadline_s,
        read_timeout_s=read_timeout_s,
    )[0]  # fmt: skip


def claim_port(host: str, port: int) -> socket.socket | None:
    """The store's listening socket, bound now; None when another process holds the port.
    An agent that may host claims the port as soon as it starts, before its preflight, so
    that of the agents on one machine the one started first hosts the store, not the one
    whose preflight happened to finish first. Where old connections of a previous store
    hold the port (TIME_WAIT), no claim: the store binds later, as any agent may."""
    try:
        return bound_listener(host, port, reuse=False)
    except OSError:
        return None


def open_store_hosted(
    host: str,
    port: int,
    *,
    serve: bool,
    explicit: bool,
    deadline_s: float,
    read_timeout_s: float,
    claimed: socket.socket | None = None,
) -> tuple[Any, bool]:
    """``open_store``, and whether this process hosts the store; ``claimed``: the port
    bound earlier (``claim_port``), which the store then serves on."""
    if serve:
        try:
            return _server(host, port, read_timeout_s=read_timeout_s, claimed=claimed), True
        except (RuntimeError, OSError) as exc:  # the port is taken (EADDRINUSE)
            if explicit:
                raise EndpointError(
                    f"--rdzv-endpoint={host}:{port}: cannot host the store here "
                    f"({_first_line(exc)}): pick a free port or stop what holds it"
                ) from exc
    return connect(host, port, deadline_s=deadline_s, read_timeout_s=read_timeout_s), False


# Pending connections the hosted store's listener queues (as `elastic-train store`'s default).
LISTEN_BACKLOG = 512
EXPOSED_HINT = (
    "c10d has no authentication: whoever reaches this port can join or break the job; "
    "keep it on a private network or firewall it to the nodes"
)


def _server(
    host: str, port: int, *, read_timeout_s: float, claimed: socket.socket | None = None
) -> Any:
    from torch.distributed import TCPStore

    listener = claimed if claimed is not None else bound_listener(host, port)
    bound_host = listener.getsockname()[0]
    try:
        # Its connections inherit this: once the store is gone, their TIME_WAIT must not keep
        # another store (a survivor's, after a failover on this machine) off the port for a
        # minute. A claim went without it (see ``_listen``); listening, no second socket can
        # bind the port either way.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.listen(LISTEN_BACKLOG)
        store = TCPStore(
            bound_host,
            port,
            is_master=True,
            timeout=timedelta(seconds=read_timeout_s),
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
            use_libuv=True,
        )
    except BaseException:
        listener.close()  # torch did not take it
        raise
    listener.detach()  # the TCPStore owns the descriptor now and closes it when deleted
    if not ipaddress.ip_address(plain_address(bound_host)).is_loopback:
        everywhere = ipaddress.ip_address(plain_address(bound_host)).is_unspecified
        emit(
            "store.exposed",
            level="warning" if everywhere else "info",
            host=bound_host,
            port=port,
            hint=EXPOSED_HINT,
        )
    return store


def serve(host: str, port: int, *, read_timeout_s: float) -> Any:
    """Host a store on exactly ``host:port`` (store failover: OSError while the port is
    still held, e.g. by the old store of a host that is leaving on this machine)."""
    return _server(host, port, read_timeout_s=read_timeout_s)


def check(host: str, port: int, *, read_timeout_s: float) -> None:
    """Before anything starts: exit 2 on bad input; a store that is not up yet is fine."""
    with contextlib.suppress(_Transient):
        _attempt(host, port, read_timeout_s)  # a probe: the rendezvous opens its own


def _first_line(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown"
    return first_line(str(exc), limit=300) or type(exc).__name__

"""``elastic-train store``: a standalone c10d rendezvous store that outlives any training node.

With torchrun's c10d backend the rendezvous store lives inside one training node's agent, so
preempting that node ends the whole job (pytorch #67742). This process hosts torch's own
``TCPStore`` on a machine that is not preempted (the Slurm batch host, a small on-demand VM, a
Kubernetes Deployment); agents join it as clients with ``--rdzv-conf is_host=false``.

c10d has no authentication and no encryption: anyone who can reach the port can read and
rewrite the rendezvous state. Bind it to a private address only.

torch's ``TCPStore`` server listens on every interface whatever host name it is given, so we
bind the listening socket ourselves, to exactly the address asked for, and hand torch the
file descriptor (``master_listen_fd``).
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from elastic_trainer.cliparse import OneLineParser
from elastic_trainer.contract.endpoint import DEFAULT_PORT, format_endpoint
from elastic_trainer.contract.events import emit
from elastic_trainer.errors import ConfigError, ElasticTrainError

DEFAULT_HOST = "127.0.0.1"
_ALL_INTERFACES = frozenset({"0.0.0.0", "::", ""})
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """What ``elastic-train store`` serves, validated."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    backlog: int = 1024
    ready_file: str | None = None
    timeout_s: float = 60.0
    linger_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port} is out of range: use 1-65535 (0 = any free)")
        if self.backlog < 1:
            raise ConfigError(f"--backlog {self.backlog} must be at least 1")
        if self.timeout_s <= 0:
            raise ConfigError(f"--timeout {self.timeout_s} must be positive seconds")
        if self.linger_s < 0:
            raise ConfigError(f"--linger {self.linger_s} must be >= 0 seconds")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """argv -> namespace; a bad flag is one ConfigError line."""
    parser = OneLineParser(
        prog="elastic-train store",
        description="Host a c10d rendezvous store (torch TCPStore) for elastic-train agents. "
        "c10d has no authentication: bind it to a private network address.",
    )
    parser.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help="address to listen on (default %(default)s); 0.0.0.0 or :: only on a private net",
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    parser.add_argument(
        "--ready-file", help="written (HOST:PORT) once the store accepts connections"
    )
    parser.add_argument("--backlog", type=int, default=1024, help="listen queue length")
    parser.add_argument(
        "--timeout", type=float, default=60.0, dest="timeout_s", help="store op timeout, s"
    )
    parser.add_argument(
        "--linger",
        type=float,
        default=0.0,
        dest="linger_s",
        help="after SIGTERM keep serving up to this many seconds (agents finishing their "
        "final round: under Slurm SIGTERM reaches the store too); SIGINT stops at once",
    )
    parser.add_argument("--job-id", default=None, help="job id carried by every event")
    parser.add_argument("--log-format", choices=("json", "console", "auto"), default="auto")
    parser.add_argument("--log-file", default=None, help="also append JSON lines here")
    return parser.parse_args(list(argv))


def config_from_args(ns: argparse.Namespace) -> StoreConfig:
    return StoreConfig(
        host=ns.host,
        port=ns.port,
        backlog=ns.backlog,
        ready_file=ns.ready_file,
        timeout_s=ns.timeout_s,
        linger_s=ns.linger_s,
    )


def resolve(host: str, port: int) -> tuple[socket.AddressFamily, tuple[Any, ...]]:
    """``host`` -> (family, sockaddr) to bind. Raises ConfigError for an unknown name."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise ConfigError(
            f"--host {host!r} is not an address of this machine ({exc.strerror}): "
            "pass an IP address or a resolvable host name"
        ) from exc
    family, _, _, _, sockaddr = infos[0]
    return family, sockaddr


def bind_listener(config: StoreConfig) -> socket.socket:
    """A listening TCP socket on exactly ``config.host``; ConfigError if it cannot be had."""
    family, sockaddr = resolve(config.host, config.port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # Lets a restarted store take its port back while old connections sit in TIME_WAIT;
        # on Linux it does not allow two live listeners on one port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and config.host not in _ALL_INTERFACES:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(sockaddr)
        sock.listen(config.backlog)
    except OSError as exc:
        sock.close()
        raise ConfigError(_bind_error(config, exc)) from exc
    return sock


def _bind_error(config: StoreConfig, exc: OSError) -> str:
    where = f"{config.host}:{config.port}"
    if exc.errno == errno.EADDRINUSE:
        return f"port {config.port} is already in use on {config.host}: pick another --port"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"--host {config.host} is not an address of this machine: use one of its own"
    if exc.errno == errno.EACCES:
        return f"no permission to listen on {where}: use a port above 1023"
    return f"cannot listen on {where} ({exc.strerror}): check --host and --port"


def start_store(config: StoreConfig, listener: socket.socket) -> Any:
    """Start torch's TCPStore server on the already-bound ``listener``."""
    from torch.distributed import TCPStore  # import late: `--help` stays fast

    host, port = listener.getsockname()[:2]
    return TCPStore(
        host,
        port,
        is_master=True,
        # The server never waits for a fixed number of clients: agents come and go.
        wait_for_workers=False,
        timeout=timedelta(seconds=config.timeout_s),
        master_listen_fd=listener.fileno(),
        use_libuv=True,
    )


def write_ready_file(path: str, host: str, port: int) -> None:
    """Publish ``HOST:PORT`` atomically, so a reader never sees half a line."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"{format_endpoint(host, port)}\n")
    os.replace(tmp, path)


def serve(config: StoreConfig, stop: Stopper) -> int:
    """Bind, start the store, announce it, and block until ``stop`` says so."""
    listener = bind_listener(config)
    try:
        store = start_store(config, listener)
    except (RuntimeError, ValueError) as exc:
        listener.close()  # torch did not take it
        raise ConfigError(
            f"cannot start the TCPStore on {config.host}:{config.port} ({exc}): "
            "check --host and --port"
        ) from exc
    host, port = listener.getsockname()[:2]
    listener.detach()  # the TCPStore owns the descriptor now and closes it when deleted
    if config.ready_file:
        write_ready_file(config.ready_file, host, port)
    emit("store.started", host=host, port=port, endpoint=format_endpoint(host, port))
    if config.host in _ALL_INTERFACES:
        emit(
            "store.exposed",
            level="warning",
            host=host,
            port=port,
            hint="c10d has no authentication: keep this port on a private network",
        )
    stop.wait()
    del store  # closes the server: connected agents see the store go away
    return 0


def decide(signum: int, linger_s: float, lingering: bool) -> str:
    """``"linger"`` (keep serving a while) or ``"stop"``, for a signal that just arrived."""
    if signum == signal.SIGTERM and linger_s > 0 and not lingering:
        return "linger"
    return "stop"


class Stopper:
    """Turns SIGTERM/SIGINT into a stop, after an optional grace of ``linger_s`` seconds."""

    def __init__(self, linger_s: float = 0.0) -> None:
        self.linger_s = linger_s
        self.signals: list[str] = []
        self._now = threading.Event()
        self._deadline: float | None = None

    def handler(self, signum: int, _frame: Any = None) -> None:
        self.signals.append(signal.Signals(signum).name)
        if decide(signum, self.linger_s, self._deadline is not None) == "linger":
            self._deadline = time.monotonic() + self.linger_s
        else:
            self._now.set()

    def install(self) -> None:
        for sig in _STOP_SIGNALS:
            signal.signal(sig, self.handler)

    def wait(self) -> None:
        """Block until told to stop now, or until the linger time after SIGTERM is over."""
        announced = False
        while not self._now.wait(0.2):
            if self._deadline is None:
                continue
            if not announced:  # log here, not in the signal handler
                emit("store.lingering", linger_s=self.linger_s)
                announced = True
            if time.monotonic() >= self._deadline:
                return


def main(argv: Sequence[str] | None = None) -> int:
    from elastic_trainer.logging import configure_logging
    from elastic_trainer.supervisor.processes import fd_limit

    fd_limit.raise_soft_limit()  # the store's connections are unbounded (fd_limit.py)

    try:
        ns = parse_args(sys.argv[1:] if argv is None else argv)
        config = config_from_args(ns)
        configure_logging(
            fmt=ns.log_format, log_file=ns.log_file, static_fields={"job_id": ns.job_id}
        )
        stop = Stopper(config.linger_s)
        stop.install()
        code = serve(config, stop)
    except ElasticTrainError as exc:
        print(f"elastic-train: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    emit("store.stopped", signal=", ".join(stop.signals) or None)
    return code

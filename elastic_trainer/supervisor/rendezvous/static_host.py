"""Static mode: a second node given ``--node-rank 0`` on another host.

Node rank 0 hosts the rendezvous store at ``--master-addr:--master-port`` (torchrun's rule).
A second node rank 0 on the same host finds the port taken (``run._static_host_hint``). On
another host the port is free: it hosted a store of its own, and each of the two waited alone
for the other until the join timeout, as under torchrun.

Here a node rank 0 whose ``--master-addr`` is not one of its own addresses writes a random
token into its store and probes ``--master-addr`` until a store answers there. Its own token
means the address routes here (a Kubernetes Service, NAT): the probe ends. Another store is a
conflict: one line naming it is written into both stores, where each node's waiting
rendezvous finds it (``FastRecoveryRendezvousHandler``) and exits 2 with that line. Either
node may start first: the probe waits for the other store to come up.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from elastic_trainer.supervisor.rendezvous import endpoint

if TYPE_CHECKING:
    from elastic_trainer.contract.config import RunConfig

PROBE_EVERY_S = 1.0  # between probes of --master-addr while nothing answers there


def token_key(job_id: str) -> str:
    return f"elastic-train/{job_id}/static-host/token"


def conflict_key(job_id: str) -> str:
    return f"elastic-train/{job_id}/static-host/conflict"


def is_local_address(host: str) -> bool:
    """Whether ``host`` resolves to an address of this machine: one a socket can bind to (no
    traffic is sent). Not torch's ``_matches_machine_hostname`` (``torch_compat``): it only
    knows the addresses the hostname resolves to, so a node's ``--local-addr`` on a second
    NIC would count as elsewhere."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address[0], 0))
            return True
    return False


def conflict_in(store: Any, job_id: str) -> str | None:
    """The conflict a node found and wrote into ``store``, or None (one not signed by the
    job is none)."""
    from elastic_trainer.supervisor.rendezvous.signed_store import TamperedValue

    key = conflict_key(job_id)
    if not store.check([key]):
        return None
    try:
        return bytes(store.get(key)).decode("utf-8", errors="replace")
    except TamperedValue:
        return None


def conflict_line(*, node: str, host: str, port: int, num_nodes: int) -> str:
    return (
        f"--node-rank=0 is given to 2 nodes ({node}, and the node at --master-addr "
        f"{host}:{port}, which hosts the store there): give each of the {num_nodes} nodes its "
        f"own --node-rank, 0 .. {num_nodes - 1}, and node rank 0 to the node at {host}"
    )


class HostProbe:
    """On a node rank 0 whose ``--master-addr`` is elsewhere: whose store answers there."""

    def __init__(
        self,
        store: Any,
        *,
        job_id: str,
        host: str,
        port: int,
        line: str,
        read_timeout_s: float,
        for_s: float,
    ) -> None:
        """``for_s``: how long to keep probing while nothing answers (the join timeout: by
        then a node rank 0 elsewhere would have failed its rendezvous anyway)."""
        self._store, self._job_id = store, job_id
        self._host, self._port, self._line = host, port, line
        self._read_timeout_s = read_timeout_s
        self._until = time.monotonic() + for_s
        self._token = secrets.token_hex(16)
        self._stopped = threading.Event()
        store.set(token_key(job_id), self._token)
        self._thread = threading.Thread(target=self._run, name="static-host-probe", daemon=True)

    def start(self) -> HostProbe:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.is_set() and time.monotonic() < self._until:
            with contextlib.suppress(Exception):  # nothing there yet, or not a store: later
                other = endpoint.try_once(self._host, self._port, self._read_timeout_s)
                if other is not None:
                    self._check(other)
                    return
            self._stopped.wait(PROBE_EVERY_S)

    def _check(self, other: Any) -> None:
        from elastic_trainer.supervisor.rendezvous.signed_store import signed

        other = signed(other, self._store.key)  # the same job's store has the same key
        key = token_key(self._job_id)
        if other.check([key]) and bytes(other.get(key)).decode() == self._token:
            return  # our own store: --master-addr routes here
        for store in (other, self._store):  # both nodes' rendezvous find it
            store.set(conflict_key(self._job_id), self._line)


def start_probe(cfg: RunConfig, store: Any, *, serving: bool) -> HostProbe | None:
    """The probe, for a static-mode node rank 0 hosting a store while ``--master-addr`` is not
    one of its addresses; else None (the usual case: nothing to check)."""
    if cfg.torchrun.node_rank != 0 or not serving or is_local_address(cfg.rdzv_host):
        return None
    line = conflict_line(
        node=cfg.node, host=cfg.rdzv_host, port=cfg.rdzv_port, num_nodes=cfg.max_nodes
    )
    return HostProbe(
        store,
        job_id=cfg.job_id,
        host=cfg.rdzv_host,
        port=cfg.rdzv_port,
        line=line,
        read_timeout_s=cfg.rdzv.read_timeout,
        for_s=cfg.rdzv.join_timeout,
    ).start()

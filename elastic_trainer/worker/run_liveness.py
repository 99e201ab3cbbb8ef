"""Is the run recorded in a snapshot folder's ``owner.json`` still alive? Asked before a
folder is refused as a live run's (``snapshots.ownership.claim``'s probe).

A job killed hard (the machine reclaimed, an OOM kill, ``kill -9``) and started again at
once found its own dead run's record fresh, and was refused for two minutes while the
heartbeat aged. Now the record says where the run lives, and:

- on the same host and boot, its supervisor's pid (with its start time: pids are reused)
  answers at once: gone is gone (``local_verdict``);
- elsewhere, its rendezvous store: nothing listening there (refused), or a store that holds
  another lineage (the job started again on the same endpoint) means the run is gone; the
  store answering with the run's own lineage means it lives;
- a host that does not answer at all proves nothing: None, and the heartbeat's age decides.

Every probe is bounded (``PROBE_S``): a silent listener costs that, never a hang.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Mapping
from datetime import timedelta

import psutil

from elastic_trainer.contract import auth, protocol
from snapshots import Owner

PROBE_S = 3.0
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    try:
        with open(BOOT_ID_PATH) as f:
            return f.read().strip()
    except OSError:
        return ""


def started_at(pid: int) -> float | None:
    """A live process's start time (unix s); None when no such process."""
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, ValueError):
        return None


def this_run(
    job_id: str, run_token: str, lineage: str, environ: Mapping[str, str] = os.environ
) -> Owner:
    """This worker's run, with where it lives (its node's supervisor, its rendezvous store)."""
    text = environ.get(protocol.ENV_SUPERVISOR_PID, "")
    pid = int(text) if text.isdigit() else None
    return Owner(
        job_id=job_id,
        run_token=run_token,
        lineage=lineage,
        host=socket.gethostname(),
        boot_id=boot_id(),
        pid=pid,
        pid_started=started_at(pid) if pid is not None else None,
        store=environ.get(protocol.ENV_RDZV_ENDPOINT, ""),
    )


def local_verdict(recorded: Owner, *, host: str, boot: str, started: float | None) -> bool | None:
    """Pure: what the recorded run's supervisor pid says, seen from ``host`` in ``boot``
    (``started``: the start time of the process that has that pid now, None if none)."""
    if not (recorded.host and recorded.boot_id and recorded.pid) or recorded.host != host:
        return None
    if recorded.boot_id != boot:
        return False  # the host rebooted since: every process of the run is gone
    if started is None:
        return False
    if recorded.pid_started is None:
        return True  # something has that pid: it may be the run's
    return abs(started - recorded.pid_started) < 1.0


def store_verdict(answer: bytes | None, lineage: str) -> bool:
    """Pure: the recorded store answered with ``answer`` (its lineage key's value; None: no
    such key): alive only if that is the recorded lineage."""
    if answer is None:
        return False
    return auth.unverified_payload(answer) == lineage.encode()


def probe(recorded: Owner) -> bool | None:
    local = local_verdict(
        recorded,
        host=socket.gethostname(),
        boot=boot_id(),
        started=started_at(recorded.pid) if recorded.pid else None,
    )
    if local is not None:
        return local
    if not recorded.store or not recorded.lineage:
        return None
    return _ask_store(recorded.store, recorded.job_id, recorded.lineage)


def _ask_store(endpoint: str, job_id: str, lineage: str) -> bool | None:
    host, _, port_text = endpoint.rpartition(":")
    host = host.strip("[]")
    if not host or not port_text.isdigit():
        return None
    port = int(port_text)
    try:
        socket.create_connection((host, port), timeout=PROBE_S).close()
    except ConnectionRefusedError:
        return False  # nothing listens where the run's store was: the run is gone
    except OSError:
        return None  # no answer at all: proves nothing
    found: dict[str, bytes | None] = {}
    done = threading.Event()

    def ask() -> None:
        from torch.distributed import TCPStore

        with contextlib.suppress(Exception):
            store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=PROBE_S))
            key = f"elastic-train/{job_id}/lineage"
            found["answer"] = bytes(store.get(key)) if store.check([key]) else None
        done.set()

    threading.Thread(target=ask, name="owner-probe", daemon=True).start()
    if not done.wait(PROBE_S * 2) or "answer" not in found:
        return None  # not a store, or a silent one: proves nothing
    return store_verdict(found["answer"], lineage)

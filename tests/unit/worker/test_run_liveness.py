"""Whether the run an owner record names still lives: its supervisor's pid on this host, its
rendezvous store elsewhere; every answer bounded, "cannot tell" when nothing answers."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import psutil
from torch.distributed import TCPStore

from elastic_trainer.contract import auth, protocol
from elastic_trainer.worker import run_liveness
from snapshots import Owner

HERE = dict(host="node-a", boot="boot-1")


def _owner(**where: object) -> Owner:
    return Owner(job_id="j", run_token="r", lineage="lin", **where)  # type: ignore[arg-type]


def test_the_supervisor_pid_decides_on_its_own_host() -> None:
    rec = _owner(host="node-a", boot_id="boot-1", pid=42, pid_started=100.0)
    assert run_liveness.local_verdict(rec, started=100.2, **HERE) is True
    assert run_liveness.local_verdict(rec, started=None, **HERE) is False  # no such pid
    assert run_liveness.local_verdict(rec, started=900.0, **HERE) is False  # pid reused
    assert run_liveness.local_verdict(rec, host="node-a", boot="boot-2", started=100.0) is False
    assert run_liveness.local_verdict(rec, host="node-b", boot="boot-1", started=100.0) is None
    assert run_liveness.local_verdict(_owner(), started=100.0, **HERE) is None  # older record


def test_this_run_says_where_it_lives() -> None:
    env = {protocol.ENV_SUPERVISOR_PID: str(os.getpid()), protocol.ENV_RDZV_ENDPOINT: "h:1"}
    me = run_liveness.this_run("j", "r", "lin", env)
    assert (me.pid, me.store, me.host) == (os.getpid(), "h:1", socket.gethostname())
    assert me.pid_started == psutil.Process().create_time()
    assert run_liveness.probe(me) is True  # this very process: alive


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_elsewhere_the_store_decides() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=5))  # fmt: skip
    key = protocol.lineage_key("j")
    store.set(key, auth.sign_value(auth.JobKey.generate(), key, b"lin"))
    there = _owner(store=f"127.0.0.1:{store.port}", host="elsewhere")
    assert run_liveness.probe(there) is True  # its store answers with its lineage
    store.set(key, auth.sign_value(auth.JobKey.generate(), key, b"another"))
    assert run_liveness.probe(there) is False  # the job started again on that endpoint
    assert run_liveness.probe(_owner(store=f"127.0.0.1:{_free_port()}", host="x")) is False


def test_a_silent_listener_is_cannot_tell_within_the_bound() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        began = time.monotonic()
        found = run_liveness.probe(_owner(store=f"127.0.0.1:{silent.getsockname()[1]}", host="x"))
        assert found is None
        assert time.monotonic() - began < run_liveness.PROBE_S * 2 + 5  # bounded, no hang

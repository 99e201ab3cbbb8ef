"""Real agents by the hundred on one machine (bench/scale.py): each agent is its own process
running the real supervisor (``elastic_trainer.cli.main``), forked from this process after it
imported torch and elastic_trainer once.

``import torch`` leaves ~290 MB of private anonymous memory in every process that does it (the
operator tables torch builds at import); a forked agent shares those pages with this process
until it writes them, so an agent's own cost (its USS) is what the control plane allocates and
touches. Everything else is as a started ``elastic-train``: its own pid, sockets, store
connection, heartbeat thread, presence port and worker subprocesses.

Store traffic is counted at the client, in each agent: every call on the signed store (the
handler's, presence's, failover's and torch's own through it) and every raw call of the state
backend, with the bytes of the keys and values each way. The counters live in one shared
anonymous mapping made before the forks (one slot per agent), so reading them costs the agents
nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import signal
import struct
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from elastic_trainer import cli
from elastic_trainer.supervisor.rendezvous import signed_store, state_backend

SLOTS = 1024
FIELDS = 3  # operations, bytes sent, bytes received
_SLOT = struct.Struct(f"{FIELDS}q")
_counters = mmap.mmap(-1, SLOTS * _SLOT.size)  # MAP_SHARED | MAP_ANONYMOUS: seen after fork
_slot = -1  # this agent's slot (set in the child)
_lock = threading.Lock()  # the heartbeat thread and the agent's loop both count
PR_SET_PDEATHSIG = 1


def _size(value: Any) -> int:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, (list, tuple)):
        return sum(_size(v) for v in value)
    return 8  # an integer or a timeout


def _count(sent: int, received: int) -> None:
    if _slot < 0:
        return
    at = _slot * _SLOT.size
    with _lock:
        ops, out, got = _SLOT.unpack_from(_counters, at)
        _SLOT.pack_into(_counters, at, ops + 1, out + sent, got + received)


def _counted(method: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: Any, *args: Any) -> Any:
        result = method(self, *args)
        _count(_size(args), _size(result) if result is not None else 0)
        return result

    return call


def _instrument() -> None:
    store = signed_store.SignedStore
    for name in (
        "set",
        "get",
        "compare_set",
        "add",
        "check",
        "wait",
        "delete_key",
        "multi_get",
        "get_each",
    ):
        if name in store.__dict__:
            setattr(store, name, _counted(store.__dict__[name]))
    backend = state_backend.SignedStateBackend
    original = backend._call

    def call(self: Any, op: str, *args: Any) -> Any:
        result = original(self, op, *args)
        _count(_size(args), _size(result) if result is not None else 0)
        return result

    backend._call = call  # type: ignore[method-assign]


_instrument()


def counters() -> list[tuple[int, int, int]]:
    """(operations, bytes sent, bytes received) per slot, so far."""
    return [_SLOT.unpack_from(_counters, i * _SLOT.size) for i in range(SLOTS)]


def start_agent(slot: int, argv: list[str], out_path: str, env: dict[str, str]) -> int:
    """Fork an agent running ``elastic-train argv`` in its own process group (a node loss is
    a SIGKILL to the group: agent and workers), its output in ``out_path``; its pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        global _slot
        _slot = slot
        os.setpgid(0, 0)
        with contextlib.suppress(OSError, AttributeError):  # dies with the bench
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["elastic-train", *argv]
        code = cli.main(argv)
    except BaseException:  # the child must never return into the bench
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    return 0  # not reached

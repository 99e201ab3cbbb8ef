"""Every use of torch's private internals, in one place, each with why and where checked.

torch.distributed.elastic gives us the engine (c10d rendezvous, the elastic agent) but not
every knob fast recovery needs. What we need beyond its public API is reached only through
this module; ``tests/unit/test_torch_compat.py`` asserts that each name still exists with the
shape we use, so a torch release that moves one fails a millisecond test, not a job.

Checked against torch 2.14.1 and 2.15.0 (``TESTED_TORCH``; pyproject pins the same range).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import subprocess
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    _PeriodicTimer,
    _RendezvousExitOp,
)

# The oldest and newest torch release this module was checked against (pyproject's range).
TESTED_TORCH = ("2.14", "2.15")

# --- torch/distributed/elastic/rendezvous/dynamic_rendezvous.py --------------------------
# _PeriodicTimer: the handler's own heartbeat timer class. We restart heartbeats at half the
#   keep-alive interval (torch ticks at the interval and skips a beat that is not yet due, so
#   beats can be two intervals apart and a live node can expire).
# _RendezvousExitOp: the op torch's shutdown() runs minus the close: a preempted node leaves
#   the round without closing the rendezvous for every other node.

# Private attributes of DynamicRendezvousHandler instances that the functions below read.
HANDLER_ATTRIBUTES = (
    "_settings",  # RendezvousSettings: timeout, keep_alive_interval, keep_alive_max_attempt
    "_state_holder",  # .state (round, participants, last_heartbeats) and .sync()
    "_this_node",  # our _NodeDesc
    "_heartbeat_lock",  # serialises store writes with the heartbeat thread
    "_op_executor",  # .run(op, deadline)
    "_keep_alive_timer",  # replaced by ours in start_fast_heartbeats
)
HANDLER_METHODS = ("_keep_alive_weak", "_start_heartbeats", "_stop_heartbeats")


def set_last_call_timeout(handler: DynamicRendezvousHandler, last_call: timedelta) -> None:
    """RendezvousTimeout has no setter; the handler reads ``_last_call`` when it opens the last
    call of a round it joins (a patient first round, short later ones)."""
    handler._settings.timeout._last_call = last_call


def keep_alive(handler: DynamicRendezvousHandler) -> tuple[float, int]:
    """(keep_alive_interval seconds, keep_alive_max_attempt) of the handler's settings."""
    interval = handler._settings.keep_alive_interval
    seconds = interval.total_seconds() if isinstance(interval, timedelta) else float(interval)
    return seconds, int(handler._settings.keep_alive_max_attempt)


def close_timeout_s(handler: DynamicRendezvousHandler) -> float:
    return float(handler._settings.timeout.close.total_seconds())


def start_fast_heartbeats(handler: DynamicRendezvousHandler) -> None:
    """Heartbeats every half keep-alive interval, on torch's own timer and callback."""
    interval = handler._settings.keep_alive_interval
    timer = _PeriodicTimer(interval / 2, handler._keep_alive_weak, weakref.ref(handler))
    timer.set_name(f"RendezvousKeepAliveTimer_{handler._this_node.local_id}")
    timer.start()
    handler._keep_alive_timer = timer


def rendezvous_state(handler: DynamicRendezvousHandler, *, sync: bool = False) -> Any:
    """The handler's view of the rendezvous state (round, participants, last_heartbeats);
    ``sync`` re-reads it from the store first."""
    if sync:
        with handler._heartbeat_lock:
            handler._state_holder.sync()
    return handler._state_holder.state


def this_node(handler: DynamicRendezvousHandler) -> Any:
    return handler._this_node


def exit_round(handler: DynamicRendezvousHandler, deadline: float) -> None:
    """Stop heartbeats and leave the current round without closing the rendezvous."""
    handler._stop_heartbeats()
    with handler._heartbeat_lock:
        handler._op_executor.run(_RendezvousExitOp(), deadline)


# --- torch/distributed/elastic/agent/server ---------------------------------------------
# SimpleElasticAgent is a template method: these protected hooks are meant to be overridden
# (its docstring says so), but they are underscore names all the same, so they are checked.
AGENT_HOOKS = (
    "_rendezvous",
    "_start_workers",
    "_stop_workers",
    "_monitor_workers",
    "_initialize_workers",
    "_exit_barrier",
    "_shutdown",
)
# _remaining_restarts: torch's own restart counter, read when it builds the workers' env
#   (TORCHELASTIC_RESTART_COUNT = max_restarts - remaining): we keep it equal to ours.
# _pcontext: LocalElasticAgent's process context, whose subprocess handlers hold the
#   workers' Popen objects (we track and kill their whole process trees ourselves).
# local_elastic_agent.start_processes: the module-level name _start_workers calls
#   (processes_started_by swaps it for the warm pool's while we start workers).
# SubprocessContext._start: PContext's hook that creates the processes; the warm pool's
#   context overrides it (see _subprocess_context_check).
AGENT_ATTRIBUTES = ("_remaining_restarts", "_pcontext", "_worker_group")


def set_remaining_restarts(agent: Any, remaining: int) -> None:
    agent._remaining_restarts = remaining


@contextlib.contextmanager
def processes_started_by(factory: Callable[..., Any]) -> Iterator[None]:
    """Within this block, ``LocalElasticAgent._start_workers`` starts its workers through
    ``factory(original_start_processes, **its_keyword_arguments)``.

    torch builds each worker's environment, arguments and log destinations and passes them
    to ``start_processes``, which it calls by its module-level name: this is the one place
    where the warm pool (``supervisor/warm_workers.py``) can take over creating the processes
    without rebuilding torch's worker environment. Restored on exit; the agent starts workers
    from its main thread only, so nothing else sees the swap.
    """
    from torch.distributed.elastic.agent.server import local_elastic_agent

    original = local_elastic_agent.start_processes
    local_elastic_agent.start_processes = functools.partial(factory, original)
    try:
        yield
    finally:
        local_elastic_agent.start_processes = original


def worker_popens(agent: Any) -> dict[int, subprocess.Popen]:
    """local rank -> Popen of the agent's current workers (empty before the first start)."""
    pcontext = agent._pcontext
    if pcontext is None:
        return {}
    return {lr: handler.proc for lr, handler in pcontext.subprocess_handlers.items()}


# --- torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py --------------------
# The c10d backend keeps a job's whole rendezvous state under one store key, base64 of a
# pickled _RendezvousState. ``elastic-train status --rdzv-endpoint`` reads it without joining
# (and without C10dRendezvousBackend, whose constructor writes the key). The pickle comes from
# the job's own store, but we still unpickle only the few classes a state is made of.
RENDEZVOUS_KEY_PREFIX = "torch.rendezvous."
RENDEZVOUS_EMPTY = b"Y2FuaW1hZGFt"  # C10dRendezvousBackend._NULL_SENTINEL: no state yet
_STATE_CLASSES = {
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
    ("datetime", "datetime"),
    ("datetime", "timezone"),
    ("datetime", "timedelta"),
    ("builtins", "set"),
}


def rendezvous_key(run_id: str) -> str:
    return RENDEZVOUS_KEY_PREFIX + run_id


def decode_rendezvous_state(encoded: bytes) -> Any:
    """A stored rendezvous state (round, complete, closed, participants {node: rank},
    wait_list, last_heartbeats {node: datetime}); None for the backend's empty sentinel.
    Raises ValueError for anything else (never loads another class)."""
    import base64
    import binascii
    import io
    import pickle

    if encoded == RENDEZVOUS_EMPTY:  # written by the backend before the first round
        return None
    try:
        raw = base64.b64decode(encoded, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"not a c10d rendezvous state: {exc}") from None

    class _StateOnly(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) not in _STATE_CLASSES:
                raise pickle.UnpicklingError(f"{module}.{name} is not part of a rendezvous state")
            return super().find_class(module, name)

    try:
        return _StateOnly(io.BytesIO(raw)).load()
    except Exception as exc:
        raise ValueError(f"not a c10d rendezvous state: {exc}") from None


# --- torch/distributed/elastic/rendezvous/utils.py --------------------------------------
def matches_machine_hostname(host: str) -> bool:
    """torch's own test of whether HOST is this machine (it decides who hosts the store)."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return bool(_matches_machine_hostname(host))


def checks() -> dict[str, Callable[[], bool]]:
    """Name -> a check that the private piece is still there with the shape we use."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.rendezvous import utils

    handler_init = DynamicRendezvousHandler.__init__.__code__.co_names
    return {
        "_PeriodicTimer(interval, fn, *args).set_name/start": lambda: all(
            hasattr(_PeriodicTimer, m) for m in ("set_name", "start", "cancel")
        ),
        "_RendezvousExitOp()": lambda: callable(_RendezvousExitOp()),
        "RendezvousTimeout._last_call": lambda: "_last_call" in _timeout_slots(),
        **{
            f"DynamicRendezvousHandler.{a}": _attr_check(a, handler_init)
            for a in HANDLER_ATTRIBUTES
        },
        **{
            f"DynamicRendezvousHandler.{m}()": _has(DynamicRendezvousHandler, m)
            for m in HANDLER_METHODS
        },
        **{f"LocalElasticAgent.{h}()": _has(LocalElasticAgent, h) for h in AGENT_HOOKS},
        **{f"LocalElasticAgent.{a}": _agent_attr(a) for a in AGENT_ATTRIBUTES},
        "C10dRendezvousBackend key 'torch.rendezvous.<run_id>'": _key_format,
        "local_elastic_agent.start_processes called by _start_workers": _start_processes_check,
        "SubprocessContext._start() fills subprocess_handlers[lr].proc": _subprocess_context_check,
        "rendezvous.utils._matches_machine_hostname": lambda: callable(
            getattr(utils, "_matches_machine_hostname", None)
        ),
    }


def _key_format() -> bool:
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    backend = c10d_rendezvous_backend.C10dRendezvousBackend
    empty = getattr(backend, "_NULL_SENTINEL", "").encode()
    return (
        RENDEZVOUS_KEY_PREFIX in backend.__init__.__code__.co_consts and empty == RENDEZVOUS_EMPTY
    )


def _start_processes_check() -> bool:
    from torch.distributed.elastic.agent.server import local_elastic_agent

    start = inspect.unwrap(local_elastic_agent.LocalElasticAgent._start_workers)
    return callable(getattr(local_elastic_agent, "start_processes", None)) and (
        "start_processes" in start.__code__.co_names
    )


def _subprocess_context_check() -> bool:
    """warm_workers.WarmContext overrides PContext's ``_start`` hook and fills the handlers
    that SubprocessContext's polling, pids and close read (each handler's ``proc``)."""
    from torch.distributed.elastic.multiprocessing.api import PContext, SubprocessContext

    readers = (
        SubprocessContext._capture_process_failures,
        SubprocessContext.pids,
        SubprocessContext._close,
    )
    return "_start" in getattr(PContext, "__abstractmethods__", ()) and all(
        "subprocess_handlers" in fn.__code__.co_names for fn in readers
    )


def _timeout_slots() -> set[str]:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    return set(getattr(RendezvousTimeout, "__annotations__", {})) | set(vars(RendezvousTimeout))


def _attr_check(name: str, init_names: tuple[str, ...]) -> Callable[[], bool]:
    # _keep_alive_timer is created in _start_heartbeats, the others in __init__
    source = DynamicRendezvousHandler._start_heartbeats.__code__.co_names
    return lambda: name in init_names or name in source


def _has(cls: type, name: str) -> Callable[[], bool]:
    return lambda: callable(getattr(cls, name, None))


def _agent_attr(name: str) -> Callable[[], bool]:
    def check() -> bool:
        from torch.distributed.elastic.agent.server import api, local_elastic_agent

        names = set()
        for cls in (api.SimpleElasticAgent, local_elastic_agent.LocalElasticAgent):
            for member in vars(cls).values():
                code = getattr(member, "__code__", None)
                if code is not None:
                    names.update(code.co_names)
        return name in names

    return check

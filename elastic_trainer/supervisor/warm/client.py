"""Workers forked by the warm pool, as torch's ``start_processes`` hands them out (the pool
process: ``entrypoints/warm_pool.py``; starting it and asking it for forks: ``launcher.py``).

torch's ``LocalElasticAgent._start_workers`` builds each worker's environment, arguments and
log destinations, then hands them to ``start_processes``. With a warm pool, ``start_processes``
(swapped in through ``torch_compat.processes_started_by``) returns a ``WarmContext``: torch's
own ``SubprocessContext`` -- same log files, tee threads, polling and shutdown -- whose
processes come from the pool instead of ``Popen``. Each is a ``WarmProcess``, a Popen-like
handle on a child of ours (see ``warm_pool``: workers are re-parented to the supervisor), so
the agent, ``ProcessTracker`` and torch's monitoring treat both kinds alike.

A fresh process stays the fallback, per worker: no pool (``--no-warm-workers``, not Linux, not a
subreaper, ``--no-python``, NUMA binding), a pool that died or refused, or an environment whose
import-time settings differ from the pool's (``warm_decisions.import_env_mismatch``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import sys
from collections.abc import Callable, Mapping
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler

from elastic_trainer.supervisor.warm.decisions import import_env_mismatch, pool_argv
from elastic_trainer.supervisor.warm.launcher import WarmPool, WarmPoolUnavailable
from elastic_trainer.supervisor.warm.process import WarmProcess


class WarmHandler:
    """torch's ``SubprocessHandler`` surface (``proc``, ``local_rank_id``, ``close``)."""

    def __init__(self, proc: WarmProcess, local_rank_id: int) -> None:
        self.proc = proc
        self.local_rank_id = local_rank_id

    def close(self, death_sig: signal.Signals | None = None) -> None:
        # the worker leads a session of its own, as torch's do: signal its whole group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, death_sig or signal.SIGTERM)


def all_warm(popens: Mapping[int, Any]) -> bool:
    return bool(popens) and all(isinstance(p, WarmProcess) for p in popens.values())


# ---- torch's start_processes, with workers from the pool ---------------------------------
class WarmContext(SubprocessContext):
    """torch's context for binary workers, starting each from the warm pool if it can."""

    def __init__(self, *, pool: WarmPool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._pool = pool

    def _start(self) -> None:
        self.subprocess_handlers = {lr: self._start_one(lr) for lr in range(self.nprocs)}

    def _start_one(self, local_rank: int) -> Any:
        env = {**os.environ, **self.envs[local_rank]}
        argv = pool_argv(self.entrypoint, self.args[local_rank], executable=sys.executable)  # type: ignore[arg-type]
        if argv is not None and not import_env_mismatch(self._pool.env, env):
            with contextlib.suppress(WarmPoolUnavailable):
                return self._fork(local_rank, argv, env)
        return get_subprocess_handler(
            entrypoint=self.entrypoint,  # type: ignore[arg-type]  # a str: see start_processes
            args=self.args[local_rank],
            env=self.envs[local_rank],
            stdout=self.stdouts[local_rank],
            stderr=self.stderrs[local_rank],
            local_rank_id=local_rank,
        )

    def _fork(self, local_rank: int, argv: list[str], env: dict[str, str]) -> WarmHandler:
        # torch's handler opens the log files itself ("w"); without one the worker shares
        # our stdout/stderr, as a Popen child inherits them
        with contextlib.ExitStack() as files:
            outs = [
                files.enter_context(open(path, "w")).fileno() if path else default
                for path, default in (
                    (self.stdouts[local_rank], 1),
                    (self.stderrs[local_rank], 2),
                )
            ]
            pid = self._pool.spawn(argv, env, [0, *outs])
        return WarmHandler(WarmProcess(pid, [self.entrypoint, *argv]), local_rank)  # type: ignore[list-item]


def start_processes(original: Callable[..., Any], pool: WarmPool, **kwargs: Any) -> Any:
    """torch's ``start_processes``, with a ``WarmContext`` where the pool can serve."""
    accepted = set(inspect.signature(SubprocessContext.__init__).parameters) - {"self"}
    fits = (
        pool.failure is None
        and isinstance(kwargs.get("entrypoint"), str)
        and kwargs.get("numa_options") is None
        and set(kwargs) - {"start_method"} <= accepted  # a new torch argument: torch's way
    )
    if not fits:
        return original(**kwargs)
    kwargs.pop("start_method", None)
    context = WarmContext(pool=pool, **kwargs)
    context.start()
    return context

"""The supervisor's side of the warm pool (``warm_pool.py``): start it, ask it for workers.

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
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler

from elastic_trainer.contract.config import RunConfig
from elastic_trainer.contract.events import emit
from elastic_trainer.errors import ElasticTrainError
from elastic_trainer.supervisor.processes.procs import ProcessTracker, is_subreaper
from elastic_trainer.supervisor.warm import pool as warm_pool
from elastic_trainer.supervisor.warm.decisions import (
    import_env_mismatch,
    modules_to_preload,
    pool_argv,
    pool_refusal,
)

POOL_MODULE = "elastic_trainer.supervisor.warm.pool"
# The pool imports torch while the first rendezvous runs, which on a loaded machine can take
# many seconds (``import_s`` of ``warm_pool.ready``): the bound is generous. Past it the first
# workers start as fresh processes.
READY_TIMEOUT_S = 60.0
SPAWN_TIMEOUT_S = 30.0  # one fork; a pool that does not answer is treated as dead
FALLBACK = "workers start as fresh processes"
# What each of those pays that a forked one does not: the interpreter and its imports.
COST = "each worker start pays python and its imports again"
# The exit status of a worker someone else reaped: unknown, so never a false success.
STATUS_LOST = 255


class WarmPoolUnavailable(ElasticTrainError):
    """The warm pool cannot start this worker; the caller starts it as a fresh process."""


def start_pool(cfg: RunConfig, tracker: ProcessTracker) -> WarmPool | None:
    """Start the warm pool for this job, or None where workers start as fresh processes."""
    if pool_refusal(cfg, subreaper=is_subreaper()) is not None:
        return None
    try:
        pool = WarmPool.start(modules_to_preload(cfg.entrypoint.argv()))
    except OSError as exc:
        emit(
            "warm_pool.unavailable",
            level="warning",
            reason=f"it could not start ({exc})",
            consequence=FALLBACK,
        )
        return None
    tracker.spare(pool.pid)  # not a stray to reap between attempts
    return pool


# ---- a worker of ours --------------------------------------------------------------------
class WarmProcess:
    """What torch and ``ProcessTracker`` use of ``subprocess.Popen``, for a worker the pool
    forked. It is our child (re-parented to us), so ``waitpid`` reaps it as Popen would."""

    def __init__(self, pid: int, args: Sequence[str] = ()) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped behind our back: its status is lost
                self.returncode = STATUS_LOST
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            _until_exit(self.pid, 0.5 if left is None else min(left, 0.5))
        return self.returncode  # type: ignore[return-value]  # set by poll

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _until_exit(pid: int, timeout: float) -> None:
    """Block until ``pid`` exits or ``timeout`` passes (a pidfd where the kernel has one)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        time.sleep(min(timeout, 0.02))
        return
    try:
        select.select([fd], [], [], timeout)
    finally:
        os.close(fd)


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


# ---- the pool, from the supervisor -------------------------------------------------------
class WarmPool:
    """One warm pool process and our end of its socket. Once it fails it stays failed
    (``failure`` says why); every worker after that starts as a fresh
    process."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, env: Mapping[str, str]):
        self.proc = proc
        self.env = dict(env)  # what the pool imported torch under
        self.failure: str | None = None
        self._sock = sock
        self._ready = False
        self._import_s: float | None = None  # what the pool's imports took: a worker's too

    @classmethod
    def start(cls, modules: Sequence[str], env: Mapping[str, str] | None = None) -> WarmPool:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ if env is None else env)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-u", "-m", POOL_MODULE, str(theirs.fileno()), *modules],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # a Ctrl-C on the terminal is for the supervisor
            )
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(proc, ours, env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def ready(self) -> bool:
        """Known ready (``wait_ready`` read its message): forks can be asked for now."""
        return self._ready and self.failure is None

    def wait_ready(self, timeout: float, cancelled: Callable[[], bool] = lambda: False) -> bool:
        """True once the pool has imported its modules; False if it failed or ``timeout``
        passed (it is then given up) or ``cancelled()`` turned true (it is not)."""
        deadline = time.monotonic() + timeout
        while not self._ready and self.failure is None:
            left = deadline - time.monotonic()
            if cancelled():
                return False
            try:
                if left <= 0:
                    self._fail(f"not ready within {timeout:g} s")
                self._ready = self._read_ready(min(left, 0.2))
            except WarmPoolUnavailable:
                return False
        return self._ready and self.failure is None

    def _read_ready(self, timeout: float) -> bool:
        try:
            message = self._receive(timeout)
        except TimeoutError:
            return False
        except WarmPoolUnavailable:
            return False
        if not message.get("ready"):
            self._fail(f"it answered {message!r} instead of ready")
        self._import_s = float(message.get("import_s", 0.0))
        emit(
            "warm_pool.ready",
            pid=self.pid,
            import_s=round(self._import_s, 3),
            modules=list(message.get("loaded", [])),
            warm_up_s=round(float(message.get("warm_up_s", 0.0)), 3),
            threads=message.get("threads"),
        )
        return True

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], stdio: Sequence[int]) -> int:
        """Fork a worker running ``argv`` (the bootstrap's) with this environment and these
        stdin/stdout/stderr fds; its pid. WarmPoolUnavailable if the pool cannot."""
        if self.failure is not None or not self._ready:
            raise WarmPoolUnavailable(self.failure or "the warm pool is not ready")
        request = {"op": "spawn", "argv": list(argv), "env": dict(env), "cwd": os.getcwd()}
        try:
            warm_pool.send(self._sock, request, list(stdio))
        except OSError as exc:
            self._fail(f"it stopped listening ({exc})")
        answer = self._receive(SPAWN_TIMEOUT_S)
        if "pid" not in answer:
            self._fail(str(answer.get("error", answer)))
        return int(answer["pid"])

    def _receive(self, timeout: float) -> dict[str, Any]:
        self._sock.settimeout(timeout)
        try:
            message, _ = warm_pool.receive(self._sock)
        except TimeoutError:
            if self._ready:  # a spawn that does not come back: the pool is wedged
                self._fail(f"no answer within {timeout:g} s")
            raise
        except (OSError, ValueError) as exc:
            self._fail(f"its socket failed ({exc})")
        if message is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=1)  # EOF comes first; the status is worth waiting for
            self._fail(f"it exited with status {self.proc.returncode}")
        return message

    def _fail(self, reason: str) -> NoReturn:
        """Give the pool up (once, with an event) and raise WarmPoolUnavailable."""
        if self.failure is None:
            self.failure = reason
            emit(
                "warm_pool.unavailable",
                level="warning",
                reason=reason,
                consequence=FALLBACK,
                cost=self.cost(),
            )
            self.close()
        raise WarmPoolUnavailable(reason)

    def cost(self) -> str:
        """What giving the pool up costs each worker, in words (measured once it was ready)."""
        if self._import_s is None:
            return COST
        return f"{COST} (the pool's took {self._import_s:.1f} s)"

    def close(self) -> None:
        """End the pool: EOF on its socket ends its loop; a pool that hangs is killed."""
        self._sock.close()
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


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

"""The warm pool process, from the supervisor: start it, wait until it is ready, ask it for a
fork (``entrypoints/warm_pool.py`` is the process itself; ``client.py`` plugs its forks into torch's
``start_processes``).

Nothing here imports torch: the supervisor starts the pool first thing, so that the pool's
``import torch`` runs while the supervisor imports its own and checks its configuration,
instead of after them (``warm_pool.ready``'s ``import_s`` is seconds on a loaded machine).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from elastic_trainer.contract.config import RunConfig
from elastic_trainer.contract.events import emit
from elastic_trainer.contract.protocol import ENV_NODE
from elastic_trainer.errors import ElasticTrainError
from elastic_trainer.supervisor.processes.procs import is_subreaper
from elastic_trainer.supervisor.warm import wire
from elastic_trainer.supervisor.warm.decisions import modules_to_preload, pool_refusal
from elastic_trainer.supervisor.warm.process import WarmProcess

POOL_MODULE = "elastic_trainer.entrypoints.warm_pool"
# The pool imports torch while the supervisor starts and the first rendezvous runs, which on
# a loaded machine can take many seconds (``import_s`` of ``warm_pool.ready``): the bound is
# generous. Past it the first workers start as fresh processes.
READY_TIMEOUT_S = 60.0
SPAWN_TIMEOUT_S = 30.0  # one fork; a pool that does not answer is treated as dead
CLOSE_GRACE_S = 2.0  # for the pool to see its socket's EOF and exit by itself
FALLBACK = "workers start as fresh processes"
# What each of those pays that a forked one does not: the interpreter and its imports.
COST = "each worker start pays python and its imports again"


class WarmPoolUnavailable(ElasticTrainError):
    """The warm pool cannot start this worker; the caller starts it as a fresh process."""


def start_pool(cfg: RunConfig) -> WarmPool | None:
    """Start the warm pool for this job, or None where workers start as fresh processes.

    Call after ``procs.guard_node`` (the pool carries the supervisor's pid and its forks need
    the subreaper) and after the workers' import-time environment is final (``OMP_*``,
    ``GLIBC_TUNABLES``): the pool imports torch under it."""
    if pool_refusal(cfg, subreaper=is_subreaper()) is not None:
        return None
    try:
        env = {**os.environ, ENV_NODE: cfg.node}  # for its title (proc_title.warm_pool)
        pool = WarmPool.start(modules_to_preload(cfg.entrypoint.argv()), env)
    except OSError as exc:
        emit(
            "warm_pool.unavailable",
            level="warning",
            reason=f"it could not start ({exc})",
            consequence=FALLBACK,
        )
        return None
    return pool


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
        self._unannounced: dict[str, Any] | None = None  # its ready message, not emitted yet

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

    def wait_ready(
        self,
        timeout: float,
        cancelled: Callable[[], bool] = lambda: False,
        *,
        announce: bool = True,
    ) -> bool:
        """True once the pool has imported its modules; False if it failed or ``timeout``
        passed (it is then given up) or ``cancelled()`` turned true (it is not).
        ``announce``: emit ``warm_pool.ready`` (once); not for the preflight's fork, which
        may end the start with one line on stderr and nothing else (a refused flag)."""
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
        ready = self._ready and self.failure is None
        if ready and announce and self._unannounced is not None:
            message, self._unannounced = self._unannounced, None
            emit(
                "warm_pool.ready",
                pid=self.pid,
                import_s=round(float(message.get("import_s", 0.0)), 3),
                modules=list(message.get("loaded", [])),
                warm_up_s=round(float(message.get("warm_up_s", 0.0)), 3),
                threads=message.get("threads"),
            )
        return ready

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
        self._unannounced = message
        return True

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], stdio: Sequence[int]) -> int:
        """Fork a worker running ``argv`` (the bootstrap's) with this environment and these
        stdin/stdout/stderr fds; its pid. WarmPoolUnavailable if the pool cannot."""
        if self.failure is not None or not self._ready:
            raise WarmPoolUnavailable(self.failure or "the warm pool is not ready")
        request = {"op": "spawn", "argv": list(argv), "env": dict(env), "cwd": os.getcwd()}
        try:
            wire.send(self._sock, request, list(stdio))
        except OSError as exc:
            self._fail(f"it stopped listening ({exc})")
        answer = self._receive(SPAWN_TIMEOUT_S)
        if "pid" not in answer:
            self._fail(str(answer.get("error", answer)))
        return int(answer["pid"])

    def run(
        self, argv: Sequence[str], env: Mapping[str, str], timeout_s: float
    ) -> subprocess.CompletedProcess[str]:
        """What ``subprocess.run(capture_output=True, text=True)`` gives for ``python -m
        bootstrap ARGV``, forked from the pool once it is ready: without the interpreter's
        start and imports (seconds, beside the pool's own import on a loaded machine).
        WarmPoolUnavailable if the pool cannot fork it; subprocess.TimeoutExpired, the
        process killed, past ``timeout_s``. Its output goes to anonymous memory files, never
        a path another user could reach."""
        if not self.wait_ready(READY_TIMEOUT_S, announce=False):
            raise WarmPoolUnavailable(self.failure or "the warm pool is not ready")
        out = os.memfd_create("stdout", os.MFD_CLOEXEC)
        err = os.memfd_create("stderr", os.MFD_CLOEXEC)
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            proc = WarmProcess(self.spawn(argv, env, [null, out, err]), argv)
            try:
                code = proc.wait(timeout_s)
            except BaseException:  # the timeout, or a stop signal meanwhile: it ends with us
                proc.kill()
                proc.wait()
                raise
            return subprocess.CompletedProcess(list(argv), code, _text(out), _text(err))
        finally:
            for fd in (out, err, null):
                os.close(fd)

    def _receive(self, timeout: float) -> dict[str, Any]:
        self._sock.settimeout(timeout)
        try:
            message, _ = wire.receive(self._sock)
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

    def close(self, grace_s: float | None = None) -> None:
        """End the pool: EOF on its socket ends its loop; a pool that has not ended within
        ``grace_s`` (``CLOSE_GRACE_S``; 0: kill it now) is killed."""
        self._sock.close()
        try:
            self.proc.wait(timeout=CLOSE_GRACE_S if grace_s is None else grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _text(fd: int) -> str:
    """The whole content of the memory file ``fd``, as text."""
    os.lseek(fd, 0, os.SEEK_SET)
    with os.fdopen(os.dup(fd), "rb") as handle:
        return handle.read().decode(errors="replace")

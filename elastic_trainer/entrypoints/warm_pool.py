"""The warm pool: a process that has imported torch once and forks workers on request.

``python -u -m elastic_trainer.entrypoints.warm_pool FD MODULE...``, started by the supervisor
(``launcher.WarmPool``) with one end of a ``SOCK_SEQPACKET`` socket pair as FD. A fresh
worker pays 2-2.7 s of ``python`` + ``import torch`` (+ the script's imports) before its first
line; a worker forked from here pays a ``fork``. The pool imports the MODULEs it is given
(torch, and the job's own known-safe imports), warms torch up (``warm_up``), says ``ready``,
then serves one request at a time: ``spawn`` (argv, env, cwd, with the worker's
stdin/stdout/stderr passed as fds) -> the worker's pid, or an ``error`` the supervisor answers
by starting that worker as a fresh process.

Why this is safe to fork: the pool never starts a thread and never initialises CUDA (both are
checked before every fork, see ``fork_refusal``), and OMP/MKL/OpenBLAS read their thread
settings when torch is loaded, from the same environment the supervisor gives its workers.
The one library that starts threads at import, numpy's OpenBLAS (one per core where no
OMP_NUM_THREADS is set), has them joined before ``ready`` (``stop_blas_threads``).

How a worker is made (``_fork_worker``): the pool forks a short-lived middle process, which
forks the worker and exits at once. The worker is thereby re-parented to the nearest child
subreaper -- the supervisor (``procs.become_subreaper``) -- exactly where a worker started
with ``subprocess.Popen`` sits: the supervisor reaps it with ``waitpid``, its exit status is
the script's, and the parent-death signal (``bootstrap.die_with_supervisor``) is armed against
the supervisor, only after the pool has seen the middle process gone (the "go" byte). Before
that the worker starts a session of its own, as torch does for its workers (``killpg``).
From there it is ``bootstrap.main``: the script runs as ``__main__`` and exits without
finalizing.

The pool itself dies with the supervisor: parent-death signal, EOF on its socket, and the
node sentinel (it carries the supervisor's pid in its environment, like every worker).
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

from elastic_trainer import proc_title
from elastic_trainer.entrypoints import worker
from elastic_trainer.supervisor.warm.wire import receive, send

STDIO_FDS = 3  # stdin, stdout, stderr of the worker, in this order


# ---- the pool ----------------------------------------------------------------------------
def preload(modules: list[str]) -> list[str]:
    """Import what workers will import anyway; one that fails is skipped (the worker will
    meet the same error itself, in its own log, where it belongs)."""
    done = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # any import error: the worker reports it
            continue
        done.append(name)
    return done


def warm_up() -> float:
    """Run once what every training step runs, so that torch's lazy imports happen here and
    not in each worker: the first ``Optimizer.step`` of a process imports ``torch._dynamo``
    (and sympy with it), seconds of CPU (``warm_pool.ready`` reports them as ``warm_up_s``)
    that every worker would otherwise pay. On a throwaway one-element CPU
    tensor, through public API only: no CUDA, no thread (``fork_refusal`` checks both before
    every fork all the same). No backward either: the autograd engine's first run counts the
    CUDA devices (initialising the driver, which a forked child could not use) and starts a
    thread per device; the gradient is set by hand. Seconds it took; 0 without torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0.0
    began = time.monotonic()
    try:
        param = torch.nn.Parameter(torch.zeros(1))
        param.grad = torch.zeros(1)
        optimizer = torch.optim.SGD([param], lr=0.1)
        optimizer.step()
        optimizer.zero_grad()
    except Exception:  # a torch without these: its workers import them themselves
        pass
    return time.monotonic() - began


# What OpenBLAS registers with pthread_atfork itself: join its threads, keep its settings.
# numpy's wheels name it alike; some builds prefix their exported symbols.
BLAS_THREAD_SHUTDOWN = ("blas_thread_shutdown_", "scipy_blas_thread_shutdown_")


def stop_blas_threads() -> int:
    """Join the threads of every OpenBLAS loaded here (numpy's, imported by torch): started at
    import, one per core unless OPENBLAS_NUM_THREADS/OMP_NUM_THREADS say fewer, they left a
    pool without those variables multi-threaded, unable to fork. OpenBLAS does the same before
    any fork (its pthread_atfork handler); its thread count stays what it read from the
    environment -- the worker's, see ``import_env_mismatch`` -- and a worker's first BLAS call
    starts that many again. The number of libraries whose threads were stopped."""
    stopped = 0
    for path in _loaded_libraries("openblas"):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:  # unloaded meanwhile: no threads of its own left
            continue
        shutdown = next((getattr(lib, n) for n in BLAS_THREAD_SHUTDOWN if hasattr(lib, n)), None)
        if shutdown is not None:
            shutdown()
            stopped += 1
    return stopped


def _loaded_libraries(word: str) -> list[str]:
    """Paths of the shared libraries mapped into this process whose name contains ``word``."""
    try:
        with open("/proc/self/maps") as f:
            paths = [line.split(maxsplit=5)[-1].strip() for line in f if ".so" in line]
    except OSError:
        return []
    return [p for p in dict.fromkeys(paths) if word in os.path.basename(p).lower()]


def fork_refusal() -> str | None:
    """Why forking a worker now would be unsafe, or None. A thread (ours or a library's)
    may hold a lock the child would wait on for ever; a CUDA context does not survive fork."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised in the warm pool; a forked worker could not use it"
    threads = _native_threads()
    if threading.active_count() > 1 or threads > 1:
        return f"the warm pool has {threads} threads; it forks only while single-threaded"
    return None


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def serve(sock: socket.socket, modules: list[str]) -> int:
    began = time.monotonic()
    loaded = preload(modules)
    warm_s = warm_up()
    stop_blas_threads()
    # Everything imported so far is the workers' too: move it out of the collector's sight.
    # A worker's collections (and the one of its exit, bootstrap.exit_without_finalizing) then
    # walk its own objects, not the hundreds of thousands of torch and its lazy imports,
    # whose walk would slow every worker's exit; and no copy-on-write of pages the collector
    # would touch.
    gc.collect()
    gc.freeze()
    ready = {"ready": True, "pid": os.getpid(), "loaded": loaded, "warm_up_s": warm_s}
    ready["threads"] = _native_threads()
    try:
        send(sock, {**ready, "import_s": time.monotonic() - began})
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the supervisor ended while we imported: nothing to start
    while True:
        request, fds = receive(sock, max_fds=STDIO_FDS)
        if request is None:
            return 0  # the supervisor closed its end: nothing more to start
        try:
            send(sock, _answer(sock, request, fds))
        finally:
            for fd in fds:
                os.close(fd)


def _answer(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> dict[str, Any]:
    if request.get("op") != "spawn" or len(fds) != STDIO_FDS:
        return {"error": f"bad request {request.get('op')!r} with {len(fds)} fds"}
    refusal = fork_refusal()
    if refusal is not None:
        return {"error": refusal}
    try:
        return {"pid": _fork_worker(sock, request, fds)}
    except OSError as exc:
        return {"error": f"fork failed: {exc}"}


def _fork_worker(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> int:
    """Fork the middle process, wait for it, and let the worker go; the worker's pid."""
    pid_r, pid_w = os.pipe()
    go_r, go_w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the middle process: fork the worker, exit at once
        try:
            sock.close()
            os.close(pid_r)
            os.close(go_w)
            if os.fork() == 0:
                _become_worker(request, fds, pid_w, go_r)
        finally:
            os._exit(0)
    os.close(pid_w)
    os.close(go_r)
    try:
        os.waitpid(middle, 0)  # from now on the worker's parent is the supervisor
        pid = _read_all(pid_r)
        if not pid:
            raise OSError("the worker ended before it started")
        os.write(go_w, b"g")
        return int(pid)
    finally:
        os.close(pid_r)
        os.close(go_w)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 64):
        chunks.append(chunk)
    return b"".join(chunks)


def _become_worker(request: dict[str, Any], fds: list[int], pid_w: int, go_r: int) -> None:
    """In the worker: torch's new session, our pid to the pool, wait for the go, then what
    ``python -u -m bootstrap ARGV`` would do. Never returns."""
    status = 1
    try:
        os.setsid()
        os.write(pid_w, str(os.getpid()).encode())
        os.close(pid_w)
        go = os.read(go_r, 1)
        os.close(go_r)
        if go != b"g":
            os._exit(worker.EXIT_ORPHANED)  # the pool is gone: so is the supervisor
        _adopt(request, fds)
        worker.main(list(request["argv"]))
    except SystemExit as exc:
        status = worker.exit_status(exc.code)
    except KeyboardInterrupt:  # as the interpreter does: die by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # before the script ran: say why, status 1
        traceback.print_exc()
    finally:
        os._exit(status)


def _adopt(request: dict[str, Any], fds: list[int]) -> None:
    """Become the process the supervisor asked for: its stdio, directory, environment."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # no reseeding: ``random`` and numpy's global generator reseed in a forked child


def main(argv: list[str]) -> int:
    if not argv or not argv[0].isdigit():
        raise SystemExit("usage: python -m elastic_trainer.entrypoints.warm_pool FD [MODULE...]")
    worker.die_with_supervisor()
    proc_title.set_title(proc_title.warm_pool(os.environ))
    sock = socket.socket(fileno=int(argv[0]))
    with sock:
        return serve(sock, argv[1:])


def exit_now(status: int) -> None:
    """End the pool without finalizing the interpreter: it has nothing to finish, and the
    libraries it imported for its workers may report at exit on the supervisor's stderr (a
    torch that imported triton prints nanobind "leaked" lines, without a final newline)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))

"""``python -m elastic_trainer.entrypoints.worker (SCRIPT | -m MODULE) [args...]``.

Every worker runs its script through this module. It behaves like ``python SCRIPT`` (same
``sys.argv``, ``sys.path[0]``, ``__main__``, exit status), except at the very end.

Why (docs/how-it-works.md, "Workers and the bootstrap": without it about one successful
plain-DDP run in four looked failed under load): gloo's worker threads drop
their last reference to a finished collective (``AsyncWork``, whose saved thread-local state
holds Python objects) *after* marking it complete, and that drop takes the GIL. If the main
thread has meanwhile finished the script and the interpreter is finalizing, CPython (<= 3.13)
ends a foreign thread that asks for the GIL with ``pthread_exit``; the forced unwind crosses
``noexcept`` C++ frames of ``ProcessGroupGloo::runLoop`` and libstdc++ aborts the process:
"terminate called without an active exception", SIGABRT, exit -6 -- after the training had
succeeded (pytorch #190489). The script's own ``destroy_process_group()`` does not help: a
group lives on while anything references it (DDP's reducer), and any collective's clean-up
can race the exit.

So once the script is done, this module does what the interpreter does up to the point where
the race starts -- wait for non-daemon threads, run the ``atexit`` handlers, collect garbage
(closing files the script left open), flush stdio -- and then ends the process with
``os._exit``: there is no finalization, so no thread can be caught asking for the GIL in it.

It also makes the worker die with its supervisor (``die_with_supervisor``): a SIGKILLed
supervisor must not leave workers training on, re-parented to init. Their own children are
the node sentinel's business (``sentinel.py``).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import io
import os
import runpy
import signal
import sys
import threading
import traceback
from collections.abc import Mapping

from elastic_trainer import proc_title
from elastic_trainer.contract import protocol
from elastic_trainer.errors import ElasticTrainError
from elastic_trainer.worker import failure, group_store

_PR_SET_PDEATHSIG = 1
# The status of a worker whose supervisor was already gone when it started: 128 + SIGKILL,
# as if the parent-death signal had reached it.
EXIT_ORPHANED = 128 + signal.SIGKILL


def die_with_supervisor(environ: Mapping[str, str] = os.environ) -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux).

    The parent-death signal is armed only from now on: if the supervisor died between our
    fork and this call, we have already been re-parented and nothing would ever fire, so
    a parent other than the supervisor (``protocol.ENV_SUPERVISOR_PID``) means exit at once.
    Returns False where this is not available (not Linux, not started by a supervisor).
    Caveat: the signal follows the parent *thread*; the supervisor starts workers from its
    main thread, which lives as long as it does.
    """
    supervisor = environ.get(protocol.ENV_SUPERVISOR_PID, "")
    if not supervisor.isdigit() or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        armed = False
    if os.getppid() != int(supervisor):
        os._exit(EXIT_ORPHANED)  # nothing of the script has run: nothing to finish
    return armed


def run_script(argv: list[str]) -> int:
    """Run ``SCRIPT args`` or ``-m MODULE args`` as ``__main__``; return its exit status."""
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            # like `python -m MODULE`: sys.path[0] is already the working directory
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            # like `python SCRIPT`: the script's directory comes first on the path, not ours
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        return exit_status(exc.code)
    except KeyboardInterrupt:
        raise  # the interpreter's own handling: it dies by SIGINT
    except ElasticTrainError as exc:
        if not failure.is_config_error(exc):
            sys.excepthook(*sys.exc_info())
            copy_on_failure()
            return 1
        return failure.refuse(exc)  # one line and exit 2: the supervisor ends the job
    except BaseException:  # like the interpreter: print it, status 1
        sys.excepthook(*sys.exc_info())
        copy_on_failure()
        return 1
    return 0


def copy_on_failure() -> None:
    """A ``TrainingSession`` the script left open copies its consistent state into the
    node's memory (``worker.memory.on_failure``): the next group resumes from it. Only
    where the script imported it: a plain script's failure costs nothing here."""
    module = sys.modules.get("elastic_trainer.worker.memory.on_failure")
    if module is not None:
        try:
            module.copy_all()
        except Exception:  # the failure being reported matters more than this copy
            traceback.print_exc()


def exit_status(code: object) -> int:
    """``sys.exit(code)`` semantics: None is 0, an int is itself, anything else is printed."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_without_finalizing(status: int) -> None:
    """The interpreter's exit up to, not including, finalization; then ``os._exit``."""
    shutdown = getattr(threading, "_shutdown", None)
    if callable(shutdown):
        shutdown()  # non-daemon threads are waited for, as on a normal exit
    atexit._run_exitfuncs()  # the script's handlers (logging, multiprocessing, ...)
    flush_open_files()
    gc.collect()  # finalizers of unreachable objects still run
    os._exit(status & 0xFF)


# Buffered writers: what finalization would flush. Exact types, not isinstance: an ABC check
# over every live object is slow and trips deprecated attributes of some modules.
_WRITERS = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)


def flush_open_files() -> None:
    """Flush every open buffered file, as finalization does for files the script left open
    (a cyclic collection alone may close the raw file before its buffer is written). The
    standard streams by name: in a worker forked from the warm pool they are the pool's
    objects, frozen out of ``gc.get_objects`` (``warm_pool.serve``)."""
    for obj in [sys.stdout, sys.stderr, *gc.get_objects()]:
        if type(obj) in _WRITERS:
            try:
                if not obj.closed:
                    obj.flush()
            except (OSError, ValueError):  # a broken pipe or a detached wrapper
                traceback.print_exc()


def whole_lines_on_stderr(environ: Mapping[str, str] = os.environ) -> bool:
    """In JSON mode, write stderr a whole line at a time. Every worker of a node writes into
    the supervisor's one stderr pipe (``stderr_router``), where a write of up to 4 KiB never
    mixes with another process's; but ``python -u`` makes ``print`` two writes (the text, then
    the newline), and a peer's line landing between them glued the two into one line of
    output. Line buffering makes it one write per line (a partial line waits for its newline
    or a flush). Console mode keeps ``-u``: its relays read each worker's own stream."""
    if environ.get(protocol.ENV_LOG_FORMAT) != "json":
        return False
    sys.stderr.reconfigure(line_buffering=True, write_through=False)  # type: ignore[union-attr]
    return True


def main(argv: list[str]) -> None:
    die_with_supervisor()
    whole_lines_on_stderr()
    if not argv or argv == ["-m"]:
        raise SystemExit(
            "usage: python -m elastic_trainer.entrypoints.worker (SCRIPT | -m MODULE) [args...]"
        )
    proc_title.set_title(proc_title.worker(os.environ, argv))
    host_group_store()
    exit_without_finalizing(run_script(argv))


def host_group_store() -> None:
    """Rank 0 hosts the workers' store on the job's address only (``group_store``); where it
    cannot, torch's ``init_process_group`` hosts it as it always did, and one line says so."""
    try:
        group_store.host_for_rank0()
    except Exception as exc:
        print(f"elastic-train: the workers' store is left to torch ({exc})", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])

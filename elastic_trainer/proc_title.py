"""What ``ps`` and ``top`` show for each process elastic-train starts, and setting it.

Without titles every worker, and every DataLoader child it forks, showed as the warm pool's
command line (``python -u -m elastic_trainer.entrypoints.warm_pool 6 torch ...``): an operator
could not tell which process runs the training script. Each process now names its role, as
a command line (``ps -ef``, ``top -c``, htop) and a process name (``top``, ``ps -e``):

- ``elastic-train worker 3: train.py --lr 1`` / ``et-worker 3``: a worker, by global rank
  (``entrypoints/worker.py``, before the script runs);
- ``elastic-train warm pool (node n0)`` / ``et-warm-pool`` (``entrypoints/warm_pool.py``);
- ``elastic-train sentinel (supervisor 812)`` / ``et-sentinel``
  (``entrypoints/sentinel.py``);
- ``elastic-train preflight: train.py --lr 1`` / ``et-preflight``
  (``entrypoints/preflight.py``);
- ``elastic-train snapshot writer (rank 3)`` / ``et-writer 3``: ``snapshots/proc_title.py``,
  this module's twin (``snapshots`` never imports us, and importing ``snapshots`` would load
  numpy among others into the light processes here, the sentinel and the bootstrap).
  ``tests/unit/test_proc_title.py`` holds both to one contract.

The supervisor keeps the command line it was started with: it is the operator's own command,
the one a unit file or ``pgrep -f`` looks for. Processes forked from a titled one (DataLoader
workers, the pool's short-lived middle process) show its title until they set their own.

Nothing finds our processes by these titles: the code finds them by pid, and by the
supervisor's pid in their environment (``ELASTIC_TRAIN_SUPERVISOR_PID``), which a title
leaves readable (``_KEEP_ENVIRON``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from elastic_trainer.contract import protocol

PREFIX = "elastic-train"
# The kernel keeps 15 bytes of a process name (TASK_COMM_LEN - 1).
NAME_MAX = 15
# setproctitle writes a long title over the environment strings that follow argv in memory,
# which is what /proc/PID/environ reads: the node sentinel finds our processes there
# (``sentinel.py``). With this set, it writes within argv only: a title longer than the
# command line the process started with is cut to its length.
_KEEP_ENVIRON = "SPT_NOENV"


class Title(NamedTuple):
    text: str  # the whole command line
    name: str  # the process name, NAME_MAX bytes at most


def worker(environ: Mapping[str, str], argv: Sequence[str]) -> Title:
    """A worker running ``argv`` (``SCRIPT args`` or ``-m MODULE args``) as global rank
    ``RANK`` of ``environ`` (absent: a process the bootstrap runs outside a job)."""
    rank = environ.get("RANK", "")
    if not rank:
        return Title(f"{PREFIX} worker: {' '.join(argv)}", "et-worker")
    return Title(f"{PREFIX} worker {rank}: {' '.join(argv)}", _name(f"et-worker {rank}"))


def warm_pool(environ: Mapping[str, str]) -> Title:
    node = environ.get(protocol.ENV_NODE, "")
    where = f" (node {node})" if node else ""
    return Title(f"{PREFIX} warm pool{where}", "et-warm-pool")


def sentinel(supervisor_pid: int) -> Title:
    return Title(f"{PREFIX} sentinel (supervisor {supervisor_pid})", "et-sentinel")


def preflight(argv: Sequence[str]) -> Title:
    return Title(f"{PREFIX} preflight: {' '.join(argv)}", "et-preflight")


def _name(text: str) -> str:
    return text.encode()[:NAME_MAX].decode(errors="ignore")


def set_title(title: Title) -> None:
    """Show ``title`` for this process (call it from the main thread: the name is the
    calling thread's). Never fails the process: without setproctitle, or with a broken
    one, the process keeps the command line it started with."""
    try:
        import setproctitle
    except Exception:  # not installed, or its C extension does not load
        return
    previous = os.environ.get(_KEEP_ENVIRON)
    os.environ[_KEEP_ENVIRON] = "1"  # read once, at the process's first title
    try:
        setproctitle.setproctitle(title.text)  # sets the name too: its first 15 bytes
        setproctitle.setthreadtitle(title.name)  # the main thread's name is the process's
    except Exception:  # a title is never worth a failed process
        pass
    finally:
        if previous is None:  # the script's environment stays the one it was given
            os.environ.pop(_KEEP_ENVIRON, None)
        else:
            os.environ[_KEEP_ENVIRON] = previous

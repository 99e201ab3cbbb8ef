"""What ``ps`` and ``top`` show for the writer process (``write/writer_child.py``).

The twin of ``elastic_trainer/proc_title.py``, which documents every title and why they are
set as they are: this package never imports ``elastic_trainer``, and the light processes
there (the node sentinel, the worker bootstrap) must not pay for importing this package.
``tests/unit/test_proc_title.py`` holds both to one contract.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

# The kernel keeps 15 bytes of a process name (TASK_COMM_LEN - 1).
NAME_MAX = 15
# Keeps /proc/PID/environ readable (the node sentinel finds processes by it): the title is
# then cut to the length of the command line the process started with.
_KEEP_ENVIRON = "SPT_NOENV"


class Title(NamedTuple):
    text: str  # the whole command line
    name: str  # the process name, NAME_MAX bytes at most


def writer(environ: Mapping[str, str], parent_pid: int) -> Title:
    """The writer process of the training process ``parent_pid``, global rank ``RANK``."""
    rank = environ.get("RANK", "")
    if not rank:
        return Title(f"elastic-train snapshot writer (for pid {parent_pid})", "et-writer")
    name = f"et-writer {rank}".encode()[:NAME_MAX].decode(errors="ignore")
    return Title(f"elastic-train snapshot writer (rank {rank})", name)


def set_title(title: Title) -> None:
    """Show ``title`` for this process (from the main thread); never fails it."""
    try:
        import setproctitle
    except Exception:  # not installed, or its C extension does not load
        return
    previous = os.environ.get(_KEEP_ENVIRON)
    os.environ[_KEEP_ENVIRON] = "1"  # read once, at the process's first title
    try:
        setproctitle.setproctitle(title.text)
        setproctitle.setthreadtitle(title.name)
    except Exception:  # a title is never worth a failed save
        pass
    finally:
        if previous is None:
            os.environ.pop(_KEEP_ENVIRON, None)
        else:
            os.environ[_KEEP_ENVIRON] = previous

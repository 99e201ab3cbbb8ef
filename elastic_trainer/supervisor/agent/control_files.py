"""The supervisor's side of the control folder it shares with one attempt's workers: which
ranks left which file (``protocol``'s names), the restart mark, and the just-in-time copies."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

from elastic_trainer.contract import protocol
from elastic_trainer.supervisor.core import decisions

# How long the workers' just-in-time copies may delay a re-form (a copy is one pass over the
# state's bytes in memory; only a worker that cannot answer, hung or frozen, costs all of it).
COPY_WAIT_S = 10.0
COPY_POLL_S = 0.01


def listed(control_dir: str, name_of: Callable[[int], str]) -> set[int]:
    """The local ranks whose file ``name_of(rank)`` is in the control folder."""
    prefix = name_of(0)[:-1]
    with contextlib.suppress(OSError):
        names = os.listdir(control_dir)
        ranks = (n[len(prefix) :] for n in names if n.startswith(prefix))
        return {int(rank) for rank in ranks if rank.isdigit()}
    return set()


def mark_restarting(control_dir: str) -> None:
    """Tell workers the SIGTERM they are about to get is ours (see protocol.RESTART_FILE);
    during a preemption the stop file already says what is happening."""
    if os.path.exists(os.path.join(control_dir, protocol.STOP_FILE)):
        return
    with contextlib.suppress(OSError):
        open(os.path.join(control_dir, protocol.RESTART_FILE), "w").close()


def await_copies(control_dir: str, poll_codes: Callable[[], dict[int, int | None]]) -> None:
    """Ask the workers for their just-in-time copy (``protocol.copy_now_fifo``) and wait
    until each has answered or exited, at most ``COPY_WAIT_S``: the group is about to
    end, and a consistent survivor's state is what the next group resumes from. A worker
    that never said it would answer (a plain script) is not waited for."""
    for rank in listed(control_dir, protocol.copier_file):
        protocol.request_copy(os.path.join(control_dir, protocol.copy_now_fifo(rank)))
    deadline = time.monotonic() + COPY_WAIT_S
    while decisions.copies_pending(
        poll_codes(),
        copiers=listed(control_dir, protocol.copier_file),
        answered=listed(control_dir, protocol.copied_file),
    ):
        if time.monotonic() > deadline:
            return
        time.sleep(COPY_POLL_S)

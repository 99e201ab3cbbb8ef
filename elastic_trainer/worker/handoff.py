"""A new worker that starts while the previous attempt's workers still train waits here.

When a node joins, the supervisor forms the new round and starts the new workers while the
old ones train on (``supervisor/agent/handover.py``); it marks their control folder with
``protocol.HANDOFF_FILE``. Such a worker, its process group up, says it is ready and waits
until the supervisor removes the mark: the old workers have stopped at a step's end and
copied their state by then, so everything the session does next (its snapshot folder, the
in-memory tier, the restore) sees only the new group. Without the mark: no wait.
"""

from __future__ import annotations

import contextlib
import os
import time

from elastic_trainer.contract import protocol

# The supervisor removes the mark as soon as the old workers have exited, at most its kill
# grace after they were told to stop; this bound only ends a wait nobody will end.
HANDOFF_WAIT_S = 300.0
# Checked this often while waiting (the wait is the old group's last step or two).
HANDOFF_POLL_S = 0.002


class HandoffTimeout(RuntimeError):
    pass


def say_aware(control_dir: str | None, local_rank: int) -> None:
    """Tell the supervisor that this worker's successor may start alongside it."""
    if control_dir is not None:
        with contextlib.suppress(OSError):  # then it is replaced after it, as any script
            open(os.path.join(control_dir, protocol.handoff_aware_file(local_rank)), "w").close()


def say_handed_off(control_dir: str | None, local_rank: int) -> None:
    """This worker is done with everything its successor uses; only its exit is left."""
    if control_dir is not None:
        with contextlib.suppress(OSError):
            open(os.path.join(control_dir, protocol.handed_off_file(local_rank)), "w").close()


def await_handoff(
    control_dir: str | None,
    local_rank: int,
    *,
    within_s: float = HANDOFF_WAIT_S,
    poll_s: float = HANDOFF_POLL_S,
) -> bool:
    """Wait for the previous workers' stop if this worker was started alongside them; True
    if it waited. ``HandoffTimeout`` after ``within_s``."""
    if control_dir is None:
        return False
    mark = os.path.join(control_dir, protocol.HANDOFF_FILE)
    if not os.path.exists(mark):
        return False
    ready = os.path.join(control_dir, protocol.handoff_ready_file(local_rank))
    with open(ready, "w"):  # in the supervisor's private control folder
        pass
    deadline = time.monotonic() + within_s
    while os.path.exists(mark):
        if time.monotonic() > deadline:
            raise HandoffTimeout(
                f"the supervisor did not hand the group over within {within_s:g} s "
                f"({mark} is still there): is it alive?"
            )
        time.sleep(poll_s)
    return True

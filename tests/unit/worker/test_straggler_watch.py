"""The session's straggler watch: which flagged rank is the slowest (worker/straggler_watch.py)."""

from __future__ import annotations

from elastic_trainer.worker.straggler_watch import StragglerWatch
from elastic_trainer.worker.stragglers import Straggler, Watch


def watch_with(**slowdowns: float) -> StragglerWatch:
    watch = StragglerWatch(None, attempt=0)
    flagged = {int(r[1:]): Straggler(int(r[1:]), 10, 20, s) for r, s in slowdowns.items()}
    watch.state = Watch(flagged=flagged)
    return watch


def test_of_the_flagged_ranks_only_the_slowest_may_leave_and_a_tie_goes_to_the_lower_rank():
    watch = watch_with(r1=1.6, r2=2.4, r3=2.4)
    assert [watch._slowest(r) for r in (1, 2, 3)] == [False, True, False]
    assert watch_with(r5=1.2)._slowest(5)

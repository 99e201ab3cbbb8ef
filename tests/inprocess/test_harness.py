"""The in-process harness itself (``tests/inprocess/harness.py``): each thread is a rank of its
own group, a fault fires exactly where it is placed, and a failed rank fails its peers at
once (not after the collective timeout), as a dead process does."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from tests.inprocess import harness
from tests.inprocess.harness import Rank

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def ranks_in_threads():
    with harness.thread_local_world():
        yield


def test_torchs_thread_local_world_is_still_there():
    """The private pieces the harness borrows from torch's own threaded tests."""
    assert all(callable(piece) for piece in harness._torch_thread_world())


def test_each_thread_is_one_rank_of_its_own_group():
    def who(rank: Rank) -> tuple[int, int, int]:
        total = torch.tensor([rank.rank + 1])
        dist.all_reduce(total)
        return dist.get_rank(), dist.get_world_size(), int(total)

    attempt = harness.run_attempt(who, 3)
    attempt.raise_first()
    assert attempt.values() == [(0, 3, 6), (1, 3, 6), (2, 3, 6)]
    assert not dist.is_initialized()  # the test's own thread has no group


def _steps(last: int):
    def train(rank: Rank) -> int:
        group = dist.group.WORLD  # held by the failing frame, as a DDP model holds its group
        for step in range(1, last + 1):
            rank.check(step)
            dist.all_reduce(torch.ones(1), group=group)
        return last

    return train


def test_a_fault_fires_once_at_its_rank_and_step_and_fails_the_peers_at_once():
    job = harness.Job(_steps(5), harness.FailureInjector().fail_at(1, 3))
    failed = job.attempt(3)
    assert job.injector.fired == [(0, 1, 3)]
    assert type(failed.outcomes[1].error) is harness.InjectedFailure
    for peer in (0, 2):  # a closed connection, not a timeout
        assert isinstance(failed.outcomes[peer].error, RuntimeError)
        assert "Timed out" not in str(failed.outcomes[peer].error)
    assert job.attempt(3).succeeded  # fired once: the restarted attempt trains through


def test_a_lost_node_is_not_restarted_a_failed_one_is():
    job = harness.Job(_steps(4), harness.FailureInjector().fail_at(0, 2).lose_at(1, 3, attempt=1))
    last = job.run(3)
    assert [a.world_size for a in job.attempts] == [3, 3, 2]
    assert isinstance(job.attempts[1].outcomes[1].error, harness.NodeLost)
    assert last.values() == [4, 4]


def test_a_save_fault_names_a_save_point():
    with pytest.raises(ValueError, match="not a save point"):
        harness.SaveFaultAt("mid_memory_write", save=1)


def test_a_thread_that_a_rank_starts_uses_that_ranks_group():
    """As a process's threads share its group (the snapshot writer's collectives need it)."""

    def from_a_child_thread(rank: Rank) -> int:
        seen: list[int] = []
        child = threading.Thread(target=lambda: seen.append(dist.get_rank()))
        child.start()
        child.join()
        return seen[0]

    attempt = harness.run_attempt(from_a_child_thread, 2)
    attempt.raise_first()
    assert attempt.values() == [0, 1]

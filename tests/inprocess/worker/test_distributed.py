"""``worker.distributed``'s agreements on 3 gloo ranks as threads of this process
(``tests/inprocess/harness.py``)."""

from __future__ import annotations

import torch.distributed as dist

from elastic_trainer.worker import distributed as D
from tests.inprocess.harness import Rank, run_attempt, thread_local_world

WORLD = 3


def _gathered(problems: dict[int, str]) -> list[list[tuple[int, str]]]:
    def fn(rank: Rank) -> list[tuple[int, str]]:
        return D.gather_problems(problems.get(rank.rank))

    with thread_local_world():
        attempt = run_attempt(fn, WORLD)
    attempt.raise_first()
    return attempt.values()


def test_every_rank_learns_each_rank_s_problem_with_its_rank():
    problems = {0: "slot torn", 2: "checksum differs"}
    assert _gathered(problems) == [[(0, "slot torn"), (2, "checksum differs")]] * WORLD


def test_no_problem_anywhere_is_one_all_reduce_and_no_object_collective(monkeypatch):
    gathers: list[int] = []
    real = dist.all_gather_object
    monkeypatch.setattr(
        dist, "all_gather_object", lambda *a, **k: (gathers.append(1), real(*a, **k))[1]
    )
    assert _gathered({}) == [[]] * WORLD
    assert gathers == []  # the texts are gathered only once some rank had one


def test_every_rank_gets_each_rank_s_integers_in_rank_order():
    def fn(rank: Rank) -> list[list[int]]:
        return D.all_gather_ints([rank.rank, -1 if rank.rank == 1 else 10 * rank.rank])

    with thread_local_world():
        attempt = run_attempt(fn, WORLD)
    attempt.raise_first()
    assert attempt.values() == [[[0, 0], [1, -1], [2, 20]]] * WORLD


def test_bytes_sent_point_to_point_reach_each_rank_named_as_sent():
    """Rank 0 sends two messages (tags 0 and 1) to ranks 1 and 2; each receives both, whole
    and in the buffer it made room in; nothing is pickled."""
    data, digest = bytearray(range(256)) * 1000, bytearray(b"0123456789abcdef")

    def fn(rank: Rank) -> tuple[bytes, bytes] | None:
        if rank.rank == 0:
            D.send_bytes(data, [1, 2], tag=0)
            D.send_bytes(digest, [1, 2], tag=1)
            return None
        got, got_digest = bytearray(len(data)), bytearray(len(digest))
        D.recv_bytes_into(got, 0, tag=0)
        D.recv_bytes_into(got_digest, 0, tag=1)
        return bytes(got), bytes(got_digest)

    with thread_local_world():
        attempt = run_attempt(fn, WORLD)
    attempt.raise_first()
    assert attempt.values() == [None] + [(bytes(data), bytes(digest))] * 2

"""The end of a job: a node waits for the round's members that are still running, never for one
that left or died (torch's barrier waited its whole timeout for those, then logged an error)."""

from __future__ import annotations

from collections.abc import Callable

from structlog.testing import capture_logs
from torch.distributed import HashStore

from elastic_trainer.contract.auth import JobKey
from elastic_trainer.supervisor.agent import exit_barrier
from elastic_trainer.supervisor.rendezvous.signed_store import SignedStore

KEY = JobKey.generate()
MEMBERS = {"127.0.0.1:11": "a", "127.0.0.2:22": "b", "127.0.0.3:33": "c"}
A, B, C = MEMBERS


def waits(on_wait: Callable[[int], None] = lambda n: None, stop_at: int = 10**9):
    """A ``wait`` that sleeps not at all, runs ``on_wait(n)`` at its n-th call (0-based) and
    says "stop" from call ``stop_at`` on; ``calls`` counts them."""

    def wait(_: float) -> bool:
        n = wait.calls  # type: ignore[attr-defined]
        wait.calls += 1  # type: ignore[attr-defined]
        on_wait(n)
        return n >= stop_at

    wait.calls = 0  # type: ignore[attr-defined]
    return wait


def barrier(store, *, gone=frozenset(), wait=None, timeout_s=60.0, clock=lambda: 0.0, me=A):
    return exit_barrier.wait_for_peers(
        store=store, run_id="job", round_=3, me=me, members=MEMBERS, gone=lambda: gone,
        wait=wait or waits(), timeout_s=timeout_s, clock=clock,
    )  # fmt: skip


def finish(store: SignedStore, member: str) -> None:
    store.set(exit_barrier.finished_key("job", 3, member), "1")


def test_still_running_is_neither_finished_nor_gone() -> None:
    assert exit_barrier.still_running({A, B, C}, {A}, {C}) == {B}
    assert exit_barrier.still_running({A, B}, {A}, {B}) == set()


def test_members_that_left_or_died_are_not_waited_for() -> None:
    store, wait = SignedStore(HashStore(), KEY), waits()
    with capture_logs() as logs:
        assert barrier(store, gone={B, C}, wait=wait) == set()
    assert wait.calls == 0 and logs == []
    assert store.get(exit_barrier.finished_key("job", 3, A)) == b"1"  # ours, for the others


def test_a_member_still_running_is_waited_for_until_it_finishes() -> None:
    store = SignedStore(HashStore(), KEY)
    finish(store, C)
    wait = waits(lambda n: finish(store, B) if n == 4 else None)
    with capture_logs() as logs:
        assert barrier(store, wait=wait) == set()
    assert wait.calls == 5
    (waiting,) = logs
    assert waiting["event"] == "exit_barrier.waiting" and waiting["nodes"] == ["b", "c"]


def test_a_forged_finished_key_is_not_a_finished_member() -> None:
    store = SignedStore(HashStore(), KEY)
    store.raw.set(exit_barrier.finished_key("job", 3, B), "1")  # anyone can write the store
    finish(store, C)
    assert barrier(store, wait=waits(stop_at=3)) == {B}


def test_the_wait_ends_at_its_timeout_and_says_who_was_still_running() -> None:
    store, now = SignedStore(HashStore(), KEY), [0.0]
    finish(store, C)

    def later(_: int) -> None:
        now[0] += 20.0

    with capture_logs() as logs:
        assert barrier(store, wait=waits(later), timeout_s=60.0, clock=lambda: now[0]) == {B}
    timed_out = [e for e in logs if e["event"] == "exit_barrier.timed_out"]
    assert [(e["nodes"], e["waited_s"], e["log_level"]) for e in timed_out] == [
        (["b"], 60.0, "warning")
    ]


def test_a_member_gone_while_we_wait_ends_the_wait() -> None:
    store, gone = SignedStore(HashStore(), KEY), set()
    finish(store, C)
    wait = waits(lambda n: gone.add(B) if n == 2 else None)
    assert barrier(store, gone=gone, wait=wait) == set()  # the same set, filled meanwhile
    assert wait.calls == 3


def test_a_stop_ends_the_wait_and_a_failed_store_ends_it_quietly() -> None:
    assert barrier(SignedStore(HashStore(), KEY), wait=waits(stop_at=0)) == {B, C}

    class Gone:
        def set(self, *_: object) -> None:
            raise RuntimeError("Connection reset by peer")

    with capture_logs() as logs:
        assert barrier(Gone()) == {B, C}
    assert logs == []


def test_a_poll_is_one_check_of_every_key_not_one_per_member() -> None:
    """Every node waits for every other at a job's end: a check per member and poll was N²
    store round trips a poll (4 million at 2,048 nodes)."""

    checks: list[int] = []

    class Counting(SignedStore):
        def check(self, keys: list[str]) -> bool:
            checks.append(len(keys))
            return super().check(keys)

    store = Counting(HashStore(), KEY)
    finish(store, C)
    assert barrier(store, wait=waits(stop_at=4)) == {B, C}  # c not read alone
    assert checks == [2] * 5  # b's and c's keys, together, at each of the 5 looks


class CountingChecks(SignedStore):
    """A signed store that records the number of keys of each ``check``."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.checks: list[int] = []

    def check(self, keys: list[str]) -> bool:
        self.checks.append(len(keys))
        return super().check(keys)


def test_one_member_collects_and_the_others_poll_one_key() -> None:
    """Every node read every member's key at each poll: N names a poll per node at the
    moment every node of a job ends. The first member not gone reads them; the others wait
    for its one key."""
    store = CountingChecks(HashStore(), KEY)
    finish(store, C)
    said = exit_barrier.all_finished_key("job", 3)
    wait = waits(lambda n: store.set(said, "1") if n == 2 else None)  # a, the collector
    assert barrier(store, wait=wait, me=B) == set()
    assert store.checks == [1, 1, 1, 1]  # one key a look, until the collector's is there


def test_a_forged_all_finished_key_ends_no_wait() -> None:
    store = SignedStore(HashStore(), KEY)
    store.raw.set(exit_barrier.all_finished_key("job", 3), "1")
    finish(store, C)
    assert barrier(store, wait=waits(stop_at=3), me=B) == {A, C}  # not known: a never said


def test_the_collector_says_so_once_all_finished_and_the_next_collects_when_it_is_gone() -> None:
    store = SignedStore(HashStore(), KEY)
    finish(store, C)
    wait = waits(lambda n: finish(store, B) if n == 1 else None)
    assert barrier(store, wait=wait) == set()  # a collects
    said = exit_barrier.all_finished_key("job", 3)
    assert store.get_each_if_all([said]) == [b"1"]
    other = SignedStore(HashStore(), KEY)
    finish(other, C)
    assert barrier(other, gone={A}, me=B) == set()  # a is gone: b collects
    assert other.get_each_if_all([said]) == [b"1"]


def test_the_collector_is_the_first_member_not_gone() -> None:
    assert exit_barrier.collector({A, B, C}, set()) == A
    assert exit_barrier.collector({A, B, C}, {A}) == B
    assert exit_barrier.collector({A}, {A}) is None

"""Store failover: who hosts the store once its host is gone (pure), and the loop that gets
there (scripted serve/connect; the real store and agents: tests/e2e/test_store_failover.py)."""

from __future__ import annotations

import itertools

import pytest
from structlog.testing import capture_logs

from elastic_trainer.supervisor.rendezvous import failover
from elastic_trainer.supervisor.rendezvous.failover import StoreMoveFailed, elect

MEMBERS = {"n:1", "n:2", "n:3"}


def test_the_first_survivor_by_name_hosts_when_the_store_host_is_gone() -> None:
    assert elect(members=MEMBERS, store_host="n:1", gone={"n:1"}, static=False).host == "n:2"
    assert elect(members=MEMBERS, store_host="n:2", gone={"n:2"}, static=False).host == "n:1"
    assert elect(members=MEMBERS, store_host="n:1", gone={"n:1", "n:2"}, static=False).host == (
        "n:3"
    )


@pytest.mark.parametrize(
    ("store_host", "gone", "static", "says"),
    [
        ("n:1", set(), False, "silent"),  # unreachable, not known gone: maybe a partition
        ("n:1", {"n:2"}, False, "silent"),  # another member died, not the host
        (None, {"n:1"}, False, "standalone"),  # elastic-train store: nothing changes
        ("n:9", {"n:9"}, False, "standalone"),  # a host that was not a member of the round
        ("n:1", {"n:1"}, True, "static"),  # --node-rank: rank 0 hosts, always
        ("n:1", MEMBERS, False, "no member"),
    ],
)
def test_no_failover_without_proof_or_for_a_store_that_is_not_ours(
    store_host, gone, static, says
) -> None:
    election = elect(members=MEMBERS, store_host=store_host, gone=gone, static=static)
    assert election.host is None and says in election.why


def test_two_survivors_never_both_host() -> None:
    """Views differ only by deaths not seen yet (a death is never seen where there was none):
    over every pair of such views, at most one survivor elects itself."""
    members = {"n:1", "n:2", "n:3", "n:4"}
    dead = {"n:1", "n:2"}  # the store host and one more, really dead
    views = [{"n:1"}, {"n:1", "n:2"}]  # n:2's death seen or not yet
    survivors = sorted(members - dead)
    for mine, theirs in itertools.product(views, repeat=2):
        hosts = [
            s
            for s, view in zip(survivors, (mine, theirs), strict=True)
            if elect(members=members, store_host="n:1", gone=view, static=False).host == s
        ]
        assert len(hosts) <= 1, (mine, theirs)


class Script:
    """Scripted store operations: what ``move_store`` called, and what they answer."""

    def __init__(self, *, serve_fails: int = 0, up_after: int = 0) -> None:
        self.calls: list[tuple[str, str, int]] = []
        self.serve_fails, self.up_after = serve_fails, up_after
        self.gone: set[str] = {"n:1"}
        self.now = 0.0

    def serve(self, host: str, port: int) -> str:
        self.calls.append(("serve", host, port))
        if self.serve_fails:
            self.serve_fails -= 1
            raise OSError(98, "Address already in use")
        return "hosted"

    def connect(self, host: str, port: int) -> str | None:
        self.calls.append(("connect", host, port))
        self.up_after -= 1
        return "client" if self.up_after < 0 else None

    def clock(self) -> float:
        self.now += 1.0
        return self.now


ADDRESSES = {"n:1": "127.0.0.11:5001", "n:2": "127.0.0.12:5002", "n:3": "[::1]:5003"}


def move(script: Script, me: str, *, served_by=lambda store, member: True, deadline_s=30.0):
    return failover.move_store(
        me=me,
        members=MEMBERS,
        addresses=ADDRESSES,
        store_host="n:1",
        gone=lambda: set(script.gone),
        port=29500,
        deadline_s=deadline_s,
        serve=script.serve,
        connect=script.connect,
        is_served_by=served_by,
        clock=script.clock,
    )


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch):
    monkeypatch.setattr(failover.time, "sleep", lambda s: None)


def test_the_elected_host_serves_on_its_presence_address_and_the_rendezvous_port() -> None:
    script = Script(serve_fails=2)  # the old store's port still held twice (leaving)
    moved = move(script, "n:2")
    assert (moved.store, moved.host, moved.hosted) == ("hosted", "n:2", True)
    assert moved.endpoint == "127.0.0.12:29500"
    assert script.calls == [("serve", "127.0.0.12", 29500)] * 3


def test_the_others_connect_until_the_elected_host_serves_there() -> None:
    script = Script(up_after=2)
    served = iter([False, True])  # the first store to answer there is still the old one
    moved = move(script, "n:3", served_by=lambda store, member: next(served))
    assert (moved.store, moved.host, moved.hosted) == ("client", "n:2", False)
    assert script.calls == [("connect", "127.0.0.12", 29500)] * 4


def test_an_elected_host_that_dies_meanwhile_is_replaced() -> None:
    script = Script(up_after=10**6)  # n:2 never serves: it died too
    calls = 0

    def gone() -> set[str]:
        nonlocal calls
        calls += 1
        return {"n:1"} if calls < 3 else {"n:1", "n:2"}

    moved = failover.move_store(
        me="n:3", members=MEMBERS, addresses=ADDRESSES, store_host="n:1", gone=gone,
        port=29500, deadline_s=30, serve=script.serve, connect=script.connect,
        is_served_by=lambda store, member: True, clock=script.clock,
    )  # fmt: skip
    assert (moved.host, moved.hosted, moved.endpoint) == ("n:3", True, "[::1]:29500")


def test_no_store_within_the_deadline_is_one_line_naming_the_host() -> None:
    with pytest.raises(StoreMoveFailed, match=r"elected host n:2 \(127.0.0.12:29500\) within 5s"):
        move(Script(up_after=10**6), "n:3", deadline_s=5)


def test_a_store_host_not_known_gone_is_never_replaced() -> None:
    script = Script()
    script.gone = set()
    with pytest.raises(StoreMoveFailed, match="not known gone"):
        move(script, "n:2")
    assert script.calls == []  # nothing served, nothing dialled


def test_store_moved_names_both_hosts_and_why() -> None:
    moved = failover.Moved(store=None, host="n:2", endpoint="127.0.0.12:29500", hosted=True)
    with capture_logs() as logs:
        failover.report(old_host="n:1", moved=moved, why="lost", began=0.0)
    (event,) = logs
    assert event["event"] == "store.moved" and event["log_level"] == "warning"
    assert (event["old_host"], event["new_host"], event["why"]) == ("n:1", "n:2", "lost")
    assert event["endpoint"] == "127.0.0.12:29500" and event["hosted_here"] is True

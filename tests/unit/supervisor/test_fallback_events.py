"""The supervisor's slower-but-safe fallbacks say so with catalogued events (not stdlib logs):
presence off, lost nodes not expired in the rendezvous, a leave that did not reach the store."""

from __future__ import annotations

from typing import Any

from structlog.testing import capture_logs

from elastic_trainer.contract.auth import JobKey
from elastic_trainer.supervisor import torch_compat
from elastic_trainer.supervisor.rendezvous.handler import FastRecoveryRendezvousHandler
from elastic_trainer.supervisor.rendezvous.membership import MembershipWatch


class Node:
    def __init__(self, addr: str, pid: int) -> None:
        self.addr, self.pid = addr, pid


def store_gone(*_: Any, **__: Any) -> None:
    raise ConnectionResetError("Connection reset by peer\nmore detail")


class HandlerWithoutStore:
    this_node = Node("127.0.0.1", 1)

    def publish_presence(self, address: str) -> None:
        store_gone()


def named(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


def bare_handler(monkeypatch) -> FastRecoveryRendezvousHandler:
    """A handler whose store is gone (no torch state needed: the store calls fail first)."""
    monkeypatch.setattr(torch_compat, "close_timeout_s", lambda handler: 1.0)
    return object.__new__(FastRecoveryRendezvousHandler)


def test_presence_that_cannot_publish_says_lost_nodes_wait_for_heartbeats() -> None:
    watch = MembershipWatch(
        HandlerWithoutStore(), endpoint="127.0.0.1:1", check_every_s=1.0, dead_after_s=3.0
    )
    with capture_logs() as logs:
        watch.open_presence("127.0.0.1", JobKey.generate(), max_nodes=2)
    (event,) = named(logs, "presence.unavailable")
    assert event["log_level"] == "warning"
    assert event["error"] == "Connection reset by peer"
    assert "heartbeat" in event["consequence"]
    assert watch.peers is None  # heartbeats only


def test_lost_nodes_not_expired_in_the_rendezvous_are_named(monkeypatch) -> None:
    handler = bare_handler(monkeypatch)
    monkeypatch.setattr(torch_compat, "expire_nodes", store_gone)
    handler.mark_dead({Node("127.0.0.2", 42), Node("127.0.0.3", 7)})
    with capture_logs() as logs:
        handler._expire_dead()
    (event,) = named(logs, "rendezvous.expire_failed")
    assert event["nodes"] == ["127.0.0.2:42", "127.0.0.3:7"]
    assert event["error"] == "Connection reset by peer"


def test_a_leave_that_cannot_reach_the_store_is_reported_and_returns_false(monkeypatch) -> None:
    handler = bare_handler(monkeypatch)
    monkeypatch.setattr(torch_compat, "exit_round", store_gone)
    with capture_logs() as logs:
        assert handler.leave() is False
    (event,) = named(logs, "rendezvous.leave_failed")
    assert event["log_level"] == "warning"
    assert "heartbeats expire" in event["consequence"]

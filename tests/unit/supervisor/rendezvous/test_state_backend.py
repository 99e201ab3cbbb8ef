"""The rendezvous state as signed JSON: exact round trips, and a value the job did not write
never reaches torch's state holder (refused, reported, replaced by the last good state)."""

from __future__ import annotations

import base64
import pickle
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from structlog.testing import capture_logs
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from elastic_trainer.contract import auth
from elastic_trainer.supervisor import torch_compat
from elastic_trainer.supervisor.rendezvous import state_backend, state_codec
from elastic_trainer.supervisor.rendezvous.signed_store import SignedStore, TamperedValue
from elastic_trainer.supervisor.rendezvous.state_backend import SignedStateBackend

KEY = auth.JobKey.generate()
NAME = torch_compat.rendezvous_key("job")


def _state() -> Any:
    a, b = _NodeDesc("10.0.0.1", 7, 0), _NodeDesc("host-b", 8, 1)
    state = _RendezvousState()
    state.round, state.complete, state.closed = 4, True, False
    state.deadline = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
    state.participants = {a: 0, b: 1}
    state.wait_list = {_NodeDesc("c", 9, 0)}
    state.redundancy_list = set()
    state.last_heartbeats = {a: state.deadline - timedelta(microseconds=1), b: state.deadline}
    return state


def test_a_state_round_trips_exactly() -> None:
    plain = torch_compat.state_to_plain(_state())
    again = torch_compat.state_from_plain(
        state_codec.decode(state_codec.encode(plain, fingerprint="k"))
    )
    assert vars(again) == vars(_state())
    assert state_codec.decode(state_codec.encode(None, fingerprint="k")) is None


def test_a_node_named_twice_is_no_state() -> None:
    plain = torch_compat.state_to_plain(_state())
    plain["participants"].append(list(plain["participants"][0]))
    with pytest.raises(ValueError, match="twice"):
        state_codec.decode(state_codec.encode(plain, fingerprint="k"))


def _backend(store: HashStore, key: auth.JobKey = KEY) -> SignedStateBackend:
    return SignedStateBackend(SignedStore(store, key), "job")


def _write(backend: SignedStateBackend, state: Any) -> None:
    stored = backend.get_state()
    token = None if stored is None else stored[1]
    assert backend.set_state(pickle.dumps(state), token)[2]


def test_a_value_the_job_did_not_write_is_replaced_by_the_last_good_state() -> None:
    store = HashStore()
    backend = _backend(store)
    _write(backend, _state())
    planted = base64.b64encode(pickle.dumps(print))  # torch's format: never unpickled
    store.set(NAME, planted)
    with capture_logs() as logs:
        bits, token = backend.get_state()
    assert vars(pickle.loads(bits)) == vars(_state()) and token == planted
    assert [(e["event"], e["reason"]) for e in logs] == [("store.tampered", "bad_tag")]
    _write(backend, pickle.loads(bits))  # the holder's next write replaces the plant
    assert bytes(store.get(NAME)) != planted
    assert vars(_backend(store).peek()) == vars(_state())


def test_a_node_that_never_saw_a_good_state_starts_from_an_empty_one() -> None:
    store = HashStore()
    store.set(NAME, b"garbage planted before the first node")
    backend = _backend(store)
    bits, _ = backend.get_state()
    assert vars(pickle.loads(bits)) == vars(_RendezvousState())


def test_peek_refuses_what_it_cannot_verify() -> None:
    store = HashStore()
    backend = _backend(store)
    _write(backend, _state())
    forged = state_codec.encode(torch_compat.state_to_plain(_state()), fingerprint="x")
    store.set(NAME, auth.sign_value(auth.JobKey.generate(), NAME, forged))
    with pytest.raises(TamperedValue):
        backend.peek()


def _micros(t: datetime) -> int:
    return (t - datetime(1970, 1, 1, tzinfo=timezone.utc)) // timedelta(microseconds=1)


def test_a_nodes_own_heartbeat_key_moves_its_time_forward_without_rewriting_the_state() -> None:
    store = HashStore()
    backend = _backend(store)
    _write(backend, _state())
    a, b = sorted(_state().last_heartbeats, key=lambda n: n.addr)
    stored = bytes(store.get(NAME))
    later = _state().deadline + timedelta(seconds=7)
    backend.beat(a, _micros(later))
    backend.beat(b, _micros(_state().deadline - timedelta(seconds=9)))  # older: not back
    assert bytes(store.get(NAME)) == stored  # a heartbeat is not a write of the whole state
    bits, token = _backend(store).get_state()
    beats = pickle.loads(bits).last_heartbeats
    assert beats == {a: later, b: _state().last_heartbeats[b]} and token == stored


def test_while_the_state_is_planted_the_nodes_heartbeats_still_move() -> None:
    """Regression: the last good state stood in for a planted one with the heartbeats it had
    then, so within a few seconds every member looked silent to every other and the job
    ended (test_store_tampering)."""
    store = HashStore()
    backend = _backend(store)
    _write(backend, _state())
    a = min(_state().last_heartbeats, key=lambda n: n.addr)
    store.set(NAME, b"planted by someone without the secret")
    later = _state().deadline + timedelta(seconds=7)
    backend.beat(a, _micros(later))
    with capture_logs():
        bits, token = backend.get_state()
    assert (
        pickle.loads(bits).last_heartbeats[a] == later
        and token == b"planted by someone without the secret"
    )
    assert bytes(store.get(NAME)) != b"planted by someone without the secret"  # put back


def test_a_heartbeat_key_the_job_did_not_sign_is_refused() -> None:
    store = HashStore()
    backend = _backend(store)
    _write(backend, _state())
    a = min(_state().last_heartbeats, key=lambda n: n.addr)
    store.set(state_backend.beat_key("job", state_backend.node_entry(a)), b"9" * 18)
    with capture_logs() as logs:
        bits, _ = _backend(store).get_state()
    assert pickle.loads(bits).last_heartbeats == _state().last_heartbeats
    assert [(e["event"], e["reason"]) for e in logs] == [("store.tampered", "bad_tag")]


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b"123", 123),
        (None, None),
        (b"", None),
        (b"-1", None),
        (b"1e9", None),
        (b"9" * 21, None),
        (str(2**63).encode(), None),
    ],
    ids=["digits", "none", "empty", "negative", "float", "too-long", "out-of-range"],
)
def test_a_heartbeat_value_is_a_bounded_count_of_microseconds(payload, expected) -> None:
    assert state_backend.parse_beat(payload) == expected


def test_get_each_hides_only_the_forged_value() -> None:
    store = HashStore()
    signed = SignedStore(store, KEY)
    signed.set("k1", b"one")
    store.set("k2", b"planted")
    signed.set("k3", b"three")
    with capture_logs() as logs:
        assert signed.get_each(["k1", "k2", "k3"]) == [b"one", None, b"three"]
    assert [(e["event"], e["key"]) for e in logs] == [("store.tampered", "k2")]
    with pytest.raises(TamperedValue):
        signed.multi_get(["k1", "k2"])


def test_every_write_of_the_state_marks_it_and_a_read_does_not() -> None:
    store = HashStore()
    backend = _backend(store)
    assert backend.version() is None
    _write(backend, _state())
    first = backend.version()
    backend.get_state()
    backend.peek()
    assert first is not None and backend.version() == first == _backend(store).version()
    changed = _state()
    changed.round = 7
    _write(backend, changed)
    assert backend.version() not in (None, first)


def test_a_forged_write_mark_is_ignored_and_the_store_keeps_serving() -> None:
    """Regression: the mark was a c10d counter, and a value that is not a number at its key
    made the store's server drop the connection of every node that polled it."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=10))  # fmt: skip
    backend = _backend(server)
    _write(backend, _state())
    attacker = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=10))
    attacker.set(backend._version_key, "not a number")
    assert backend.version() is None  # not ours: the waiter reads the state instead
    assert backend.peek() is not None


def test_a_state_of_256_members_with_long_addresses_is_admitted() -> None:
    state = _RendezvousState()
    nodes = [_NodeDesc(f"node-{i:03d}.rack-{i // 16:02d}.cluster.example.org", 10**6 + i, 0)
             for i in range(256)]  # fmt: skip
    state.participants = {n: rank for rank, n in enumerate(nodes)}
    state.last_heartbeats = dict.fromkeys(nodes, datetime(2026, 1, 2, tzinfo=timezone.utc))
    state.wait_list = set(nodes[:8])
    payload = state_codec.encode(torch_compat.state_to_plain(state), fingerprint="k")
    assert len(payload) < state_codec.MAX_STATE_BYTES // 100  # far inside the bound
    assert vars(torch_compat.state_from_plain(state_codec.decode(payload))) == vars(state)


def test_a_node_expired_on_purpose_stays_expired_though_its_key_holds_a_recent_beat() -> None:
    store = HashStore()
    backend = _backend(store)
    state = _state()
    a = min(state.last_heartbeats, key=lambda n: n.addr)
    backend.beat(a, _micros(state.deadline + timedelta(seconds=5)))
    state.last_heartbeats[a] = datetime(1970, 1, 1, tzinfo=timezone.utc)  # expire_nodes
    _write(backend, state)
    bits, _ = _backend(store).get_state()
    assert pickle.loads(bits).last_heartbeats[a] == datetime(1970, 1, 1, tzinfo=timezone.utc)


class _CountingStore(HashStore):
    """A HashStore that counts the operations the backend calls on it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def check(self, keys: list[str]) -> bool:
        self.calls.append("check")
        return super().check(keys)

    def get(self, key: str) -> bytes:
        self.calls.append("get")
        return super().get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.calls.append("multi_get")
        return super().multi_get(keys)


def test_the_heartbeats_of_many_nodes_are_two_store_operations() -> None:
    store = _CountingStore()
    backend = _backend(store)
    nodes = [_NodeDesc(f"10.0.0.{i}", 100 + i, 0) for i in range(50)]
    for i, node in enumerate(nodes):
        backend.beat(node, 1_000 + i)
    store.calls.clear()
    assert backend.beats(nodes) == {n: 1_000 + i for i, n in enumerate(nodes)}
    assert store.calls == ["check", "multi_get"]
    # one never beaten (just joined): a check and a get per node, None for it
    store.calls.clear()
    new = _NodeDesc("10.0.1.1", 7, 0)
    beats = backend.beats([*nodes[:2], new])
    assert beats == {nodes[0]: 1_000, nodes[1]: 1_001, new: None}
    assert store.calls.count("check") == 4 and store.calls.count("get") == 2


def test_a_state_read_again_soon_takes_the_heartbeats_just_read(monkeypatch) -> None:
    """A lost write, a waiter woken by a join: the state is read again and again within a
    fraction of a second; its N heartbeat keys are read once per ``beats_reuse_s``, and a
    reused time only makes a node look older than its key says, never newer."""
    store = _CountingStore()
    backend = _backend(store)
    _write(backend, _state())
    a, b = sorted(_state().last_heartbeats, key=lambda n: n.addr)
    backend.beat(a, _micros(_state().deadline + timedelta(seconds=7)))
    backend.beat(b, _micros(_state().deadline))
    now = [100.0]
    monkeypatch.setattr(state_backend.time, "monotonic", lambda: now[0])
    backend.beats_reuse_s = 0.25
    reader = _backend(store)
    reader.beats_reuse_s = 0.25
    reader.get_state()
    backend.beat(a, _micros(_state().deadline + timedelta(seconds=8)))
    store.calls.clear()
    now[0] += 0.2
    bits, _ = reader.get_state()
    assert "multi_get" not in store.calls  # the keys' times of 0.2 s ago
    assert pickle.loads(bits).last_heartbeats[a] == _state().deadline + timedelta(seconds=7)
    now[0] += 0.1
    bits, _ = reader.get_state()
    assert "multi_get" in store.calls
    assert pickle.loads(bits).last_heartbeats[a] == _state().deadline + timedelta(seconds=8)


def test_only_entries_older_than_the_fresh_bound_read_their_nodes_keys(monkeypatch) -> None:
    """A round just opened stamps every member with the opener's time: each member read all
    N members' keys after it anyway (two store operations of O(N) bytes, N signature checks),
    though a younger time than the bound changes nothing torch does with the state. An entry
    expired on purpose stays at the epoch and is not read either."""
    store = _CountingStore()
    writer, reader = _backend(store), _backend(store)
    reader.beats_fresh_s = 0.5
    now = datetime(2026, 11, 29, 12, 0, 0, tzinfo=timezone.utc)
    monkeypatch.setattr(state_backend.time, "time_ns", lambda: _micros(now) * 1000)
    fresh, old, expired = _NodeDesc("a", 1, 0), _NodeDesc("b", 2, 0), _NodeDesc("c", 3, 0)
    me = _NodeDesc("d", 4, 0)
    state = _state()
    state.participants = {fresh: 0, old: 1, expired: 2, me: 3}
    state.wait_list = set()
    state.last_heartbeats = {
        fresh: now - timedelta(seconds=0.4),
        old: now - timedelta(seconds=0.6),
        expired: datetime(1970, 1, 1, tzinfo=timezone.utc),
        me: now - timedelta(seconds=5),
    }
    _write(writer, state)
    for node in (fresh, old, expired):
        writer.beat(node, _micros(now))
    reader.beat(me, _micros(now - timedelta(seconds=0.1)))  # its own: known without a read
    store.calls.clear()
    beats = pickle.loads(reader.get_state()[0]).last_heartbeats
    assert beats[fresh] == now - timedelta(seconds=0.4)  # its own time: its key not read
    assert beats[old] == now and beats[expired] == state.last_heartbeats[expired]
    assert beats[me] == now - timedelta(seconds=0.1)
    assert store.calls == ["check", "multi_get"]  # of the one key due
    monkeypatch.setattr(state_backend.time, "time_ns", lambda: _micros(now) * 1000 - 10**9)
    store.calls.clear()
    builds: list[int] = []
    build = torch_compat.state_from_plain
    monkeypatch.setattr(torch_compat, "state_from_plain", lambda p: builds.append(1) or build(p))
    first, second = reader.get_state()[0], reader.get_state()[0]  # every time fresh a second ago
    assert "check" not in store.calls and "multi_get" not in store.calls
    assert first == second and builds == [1]  # the same value: built and pickled once
    assert pickle.loads(first).last_heartbeats == {**state.last_heartbeats, me: beats[me]}


@pytest.mark.parametrize(
    ("times", "due"),
    [([10, 9, 5, 0], [2]), ([5, 6, 4], [0, 2]), ([10, 10], []), ([], [])],
)
def test_the_entries_due_a_key_read_are_those_at_least_the_bound_old(times, due) -> None:
    entries = [["h", i, 0, t] for i, t in enumerate(times)]
    assert state_backend.due_beats(entries, now_us=10, fresh_us=5) == due


def test_a_lost_write_pauses_longer_the_more_nodes_there_are(monkeypatch) -> None:
    """N nodes writing at one moment: each loser pauses a random time drawn from a range
    that grows with N before its retry, instead of all retrying at once again."""
    store = HashStore()
    pauses: list[float] = []
    monkeypatch.setattr(state_backend.random, "uniform", lambda low, high: high)
    monkeypatch.setattr(state_backend.time, "sleep", pauses.append)
    winner, loser = _backend(store), _backend(store)
    stale = loser.get_state()
    _write(winner, _state())  # two nodes in it
    state = _state()
    state.round = 5
    assert loser.set_state(pickle.dumps(state), stale[1] if stale else None)[2] is False
    big = _state()
    big.last_heartbeats = {_NodeDesc(f"n{i}", i, 0): big.deadline for i in range(40)}
    big.participants = dict.fromkeys(big.last_heartbeats, 0)
    _write(winner, big)
    assert loser.set_state(pickle.dumps(state), stale[1] if stale else None)[2] is False
    assert pauses == [2 * state_backend.BACKOFF_S_PER_NODE, 40 * state_backend.BACKOFF_S_PER_NODE]
    assert store.get(NAME) and pauses[-1] <= state_backend.MAX_BACKOFF_S
